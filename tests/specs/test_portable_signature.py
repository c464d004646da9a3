"""A saved capture whose call holds objects or strings, matched with live calls.

The document of a saved capture writes an argument object's class by import
path and a constant it does not write (a string: it may be a prompt) by a
digest of its equality key, so a loaded capture is compared with a live call
through that document: the same call dispatches, bound to the live
object's tensors, and a call that differs in any part runs eagerly.  What no
other process can key -- a class defined inside a function, a constant
compared by identity -- is refused, and ``check()`` names the part.

The oracle is eager: each installed call against the same call run without
install, and the live object's tensors against eager's.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import ctxreplay
from ctxreplay.specs.signature import call_spec, tensor_values
from ctxreplay.specs.specjson import call_to_json

SECRET = "a prompt nobody may read back"


class Holder:
    """A plain object holding a tensor, a string and an int."""

    def __init__(self, mode: str = SECRET, scale: int = 2) -> None:
        self.state = torch.zeros(3, 4)
        self.mode = mode
        self.scale = scale


@dataclasses.dataclass
class Packed:
    x: torch.Tensor
    tag: str = "left"


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, holder: Any, packed: Packed,
                pos: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.lin(x + packed.x) * holder.scale
        if holder.mode == SECRET and packed.tag == "left":
            y = y + 1
        holder.state.index_copy_(0, pos, y)  # in place: a mutated input of the graph
        return y


def _call(**change: Any) -> tuple[Any, ...]:
    torch.manual_seed(0)
    holder = Holder(**{k: v for k, v in change.items() if k in ("mode", "scale")})
    packed = Packed(torch.rand(2, 4), change.get("tag", "left"))
    return torch.rand(2, 4), holder, packed, torch.tensor([0, 2])


def _saved(tmp_path: Path, block: nn.Module, holder: Any = None) -> ctxreplay.LoadedManifest:
    args = list(_call())
    if holder is not None:
        args[1] = holder
    with ctxreplay.capture_with(block, verify="execute") as session, torch.no_grad():
        block(*args)
    report = session.finalize()
    assert report.ok, report.explain()
    report.save_all(tmp_path / "caps")
    loaded = ctxreplay.load(tmp_path / "caps")
    assert isinstance(loaded, ctxreplay.LoadedManifest)
    return loaded


def _eager(block: nn.Module, args: tuple[Any, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        return block(*args), args[1].state


def test_an_object_and_strings_in_a_saved_signature_match_the_same_call(
        tmp_path: Path) -> None:
    torch.manual_seed(0)
    block = Block()
    loaded = _saved(tmp_path, block)
    [capture] = loaded.captures
    # the document rebuilds no object, and keys every part of it
    assert capture.signature() is None and capture.unmatched() is None
    assert SECRET not in (tmp_path / "caps" / capture.sidecar.path.name).read_text()
    want, want_state = _eager(block, _call())
    with ctxreplay.install(block, loaded, object_args="dispatch") as handle, torch.no_grad():
        args = _call()
        got = block(*args)
        assert handle.stats().total_hits == 1, handle.stats()
    assert torch.equal(got, want)
    assert torch.equal(args[1].state, want_state)  # the live object's tensor was written
    assert want_state.abs().sum() > 0


@pytest.mark.parametrize("change", [{"mode": "another prompt"}, {"tag": "right"}, {"scale": 3}],
                         ids=["string_in_object", "string_in_dataclass", "int"])
def test_a_call_that_differs_in_a_constant_runs_eagerly(tmp_path: Path,
                                                        change: dict[str, Any]) -> None:
    torch.manual_seed(0)
    block = Block()
    loaded = _saved(tmp_path, block)
    want, want_state = _eager(block, _call(**change))
    with ctxreplay.install(block, loaded, object_args="dispatch") as handle, torch.no_grad():
        args = _call(**change)
        got = block(*args)
        assert handle.stats().reasons == {"signature": 1}
    assert torch.equal(got, want) and torch.equal(args[1].state, want_state)
    # the control: dispatched anyway, the graph gives the captured call's answer
    [capture] = loaded.captures
    program = capture.module()
    leaves = [t for a in _call(**change) for t in tensor_values(a)]
    assert not torch.equal(program(*leaves), want)


class OtherHolder(Holder):
    pass


def test_an_object_of_another_class_runs_eagerly(tmp_path: Path) -> None:
    torch.manual_seed(0)
    block = Block()
    loaded = _saved(tmp_path, block)
    with ctxreplay.install(block, loaded, object_args="dispatch") as handle, torch.no_grad():
        args = list(_call())
        other = OtherHolder()
        other.state = args[1].state
        block(args[0], other, *args[2:])
        assert handle.stats().reasons == {"signature": 1}


def test_a_class_defined_inside_a_function_is_refused_and_check_names_it(
        tmp_path: Path) -> None:
    class Local(Holder):
        pass

    torch.manual_seed(0)
    block = Block()
    loaded = _saved(tmp_path, block, Local())
    [capture] = loaded.captures
    [why] = [d for d in loaded.check() if d.kind == "dispatch"]
    assert why.field == "not_rebuildable" and why.captures == (capture.label,)
    assert why.found.startswith("args[1]: an object of type "
                                "test_a_class_defined_inside_a_function_is_refused_and_check_"
                                "names_it.<locals>.Local whose class has no import path")
    with ctxreplay.install(block, loaded, object_args="dispatch") as handle, torch.no_grad():
        args = list(_call())
        local = Local()
        block(args[0], local, *args[2:])
        assert handle.stats().reasons == {"not_rebuildable": 1}


def test_a_constant_compared_by_identity_is_refused_and_named(tmp_path: Path) -> None:
    torch.manual_seed(0)
    block = Block()
    holder = Holder()
    holder.hook = print  # type: ignore[attr-defined]  # a callable: compared by identity
    loaded = _saved(tmp_path, block, holder)
    [why] = [d for d in loaded.check() if d.kind == "dispatch"]
    assert why.field == "not_rebuildable"
    assert why.found.startswith("args[1].hook: a constant of type "
                                "builtin_function_or_method: its writer recorded no key")
    assert str(why).startswith("not_rebuildable: args[1].hook")


def test_documents_key_dicts_by_their_key_types() -> None:
    # the names a document writes for dict keys do not tell 1 from "1"
    doc_int = call_to_json(call_spec(({1: torch.ones(1)},), {}))
    doc_str = call_to_json(call_spec(({"1": torch.ones(1)},), {}))
    assert doc_int["args"][0]["items"] == doc_str["args"][0]["items"]
    assert doc_int != doc_str
    assert json.loads(json.dumps(doc_int)) == doc_int
