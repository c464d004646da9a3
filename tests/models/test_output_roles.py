"""Each graph output of a saved capture says what it is: the call's own
output, or a write of state.

A decoder layer called with transformers' default ``DynamicCache`` is
captured with the cache's new keys and values as extra graph outputs:
torch's output specs call all three ``USER_OUTPUT``, while the call itself
returns one tensor.  The capture record, the sidecar and ``ctxreplay
inspect`` name each output's role.  The consumer test holds the roles to
what a tool that reads only the ``.pt2`` and its sidecar can do with them:
in a fresh process that never imports ctxreplay, it runs the program on the
live call's inputs and sorts its outputs by role; the outputs equal the live
call's, at the paths the roles name, and the writes equal what the live
forward left in the cache (or the buffer and the input it wrote in place).

The oracles are the live call itself (recorded by forward hooks on the
block, its inputs copied before it runs), torch's own output specs, and the
keyword the model passed the cache under, read from the live call.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import real_models
import torch
from torch import nn

import ctxreplay
from ctxreplay.backends import ExportBackend

pytestmark = [pytest.mark.models,
              pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning")]

#: what a tool that has only the files runs: torch, the .pt2, the sidecar
CONSUMER = textwrap.dedent("""
    import json, sys
    import torch

    pt2, live_inputs, result = sys.argv[1:4]
    side = json.load(open(pt2 + ".json"))
    assert side["binding"] == "flattened"  # the call's tensor leaves, positionally
    paths = [path for path, _ in side["inputs"]["leaves"]]
    given = torch.load(live_inputs)
    leaves = [given[p].clone() for p in paths]
    program = torch.export.load(pt2).module()
    roles = side["output_roles"]
    returned = [r for r in roles if r["returned"]]
    # module() rebuilds the flat outputs it returns into the program's
    # out_spec: flattened again, they are the returned roles' outputs, in order
    outputs = torch.utils._pytree.tree_leaves(program(*leaves))
    assert len(outputs) == len(returned), (len(outputs), returned)
    got = {"output": {}, "assigned": {}, "input": {}}
    for role, value in zip(returned, outputs):
        got[role["kind"]][role["path"]] = value
    for role in roles:  # applied in place by module(): read from what it wrote
        if role["kind"] == "input":
            got["input"][role["path"]] = leaves[paths.index(role["path"])]

    # on fresh inputs built from the sidecar's specs, the outputs the roles
    # call the call's own have the live call's output shapes, in order
    def fresh(spec):
        t = torch.empty_strided(spec["shape"], spec["stride"], dtype=getattr(torch, spec["dtype"]))
        return t.uniform_() if t.is_floating_point() else t.zero_()
    again = program(*[fresh(s["tensor"]) for _, s in side["inputs"]["leaves"]])
    again = torch.utils._pytree.tree_leaves(again)
    own = [list(v.shape) for r, v in zip(returned, again) if r["kind"] == "output"]
    assert own == [s["tensor"]["shape"] for s in side["output_leaves"]], own

    assert "ctxreplay" not in sys.modules
    torch.save(got, result)
""")

_STEP = re.compile(r"\.(\w+)|\[(\d+)\]|\['([^']*)'\]")


def _at(roots: dict[str, Any], path: str) -> Any:
    """The value at a path as the roles write it (``kwargs['cache'].layers[0].keys``)."""
    head = re.match(r"\w+", path)
    assert head is not None, path
    value = roots[head.group()]
    rest = path[head.end():]
    for step in _STEP.finditer(rest):
        attr, index, key = step.groups()
        value = getattr(value, attr) if attr else value[int(index)] if index else value[key]
    assert "".join(m.group() for m in _STEP.finditer(rest)) == rest, path
    return value


class _Live:
    """The block's first call: its arguments as they were before it ran (a
    deep copy), the live objects after it, and its output."""

    def __init__(self, block: nn.Module) -> None:
        self.seen: dict[str, Any] = {}
        self.handles = [block.register_forward_pre_hook(self._pre, with_kwargs=True),
                        block.register_forward_hook(self._post, with_kwargs=True)]

    def _pre(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if "before" not in self.seen:
            self.seen["before"] = copy.deepcopy({"args": args, "kwargs": kwargs})
            self.seen["after"] = {"args": args, "kwargs": kwargs}

    def _post(self, module: nn.Module, args: Any, kwargs: Any, out: Any) -> None:
        self.seen.setdefault("out", out)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _qwen2_layer() -> tuple[ctxreplay.Capture, _Live]:
    from transformers import DynamicCache
    model = real_models.qwen2()
    prompt = torch.randint(1, real_models.VOCAB, (1, 5),
                           generator=torch.Generator().manual_seed(1))
    live = _Live(model.model.layers[0])
    with ctxreplay.capture_with(model, targets=["model.layers.0"]) as session, \
            torch.no_grad():
        model(prompt, past_key_values=DynamicCache(config=model.config), use_cache=True)
    live.remove()
    report = session.finalize()
    assert report.ok, report.summary
    (capture,) = report.captures
    return capture, live


def _cache_keyword(live: _Live) -> str:
    from transformers import DynamicCache
    (name,) = [k for k, v in live.seen["after"]["kwargs"].items()
               if isinstance(v, DynamicCache)]
    return name


def _roles(capture: ctxreplay.Capture | ctxreplay.LoadedCapture) -> list[tuple[str, str]]:
    assert capture.output_roles is not None
    return [(r.kind, r.path) for r in capture.output_roles]


def test_a_decoder_layer_names_its_output_and_the_cache_writes(tmp_path: Path) -> None:
    capture, live = _qwen2_layer()
    cache = f"kwargs[{_cache_keyword(live)!r}].layers[0]"
    expected = [("output", "out"), ("assigned", f"{cache}.keys"),
                ("assigned", f"{cache}.values")]
    # torch calls all three user outputs; the call returns one tensor
    kinds = [s.kind.name for s in capture.artifact.graph_signature.output_specs]
    assert kinds == ["USER_OUTPUT"] * 3
    assert isinstance(live.seen["out"], torch.Tensor)
    assert capture.graph_outputs is not None and len(capture.graph_outputs.items) == 1
    assert _roles(capture) == expected
    assert [r.returned for r in capture.output_roles or ()] == [True] * 3
    assert capture.to_json()["output_roles"] == [
        {"kind": k, "path": p, "returned": True} for k, p in expected]

    saved = capture.save(tmp_path / "layer.pt2")
    side = json.loads(saved.sidecar.read_text())
    assert [(r["kind"], r["path"]) for r in side["output_roles"]] == expected
    assert _roles(ctxreplay.load(saved.path)) == expected

    shown = subprocess.run([sys.executable, "-m", "ctxreplay.cli", "inspect", str(saved.path)],
                           capture_output=True, text=True, timeout=300)
    assert shown.returncode == 0, shown.stderr
    assert (f"graph outputs of model.layers.0#0: 0 out (output), 1 {cache}.keys (assigned), "
            f"2 {cache}.values (assigned)") in shown.stdout.splitlines(), shown.stdout


class _Cache:
    def __init__(self) -> None:
        self.keys = torch.zeros(2, 0, 8)


class _Block(nn.Module):
    """Returns a tuple, assigns a tensor to an argument object, writes a
    buffer and an input in place."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x: torch.Tensor, cache: _Cache,
                total: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = self.proj(x)
        cache.keys = torch.cat([cache.keys, k], dim=1)
        self.steps.add_(1)
        total.add_(x.sum())
        return x + cache.keys.mean(1, keepdim=True), k


def _toy_report(lower: bool) -> tuple[ctxreplay.CaptureReport, _Live, _Block]:
    torch.manual_seed(0)
    block = _Block().eval()
    live = _Live(block)
    # under autocast the program holds a context wrapper: ``lower=True``
    # lowers it at capture, which makes the program functional
    with ctxreplay.capture_with(block, verify="execute",
                                backend=ExportBackend(lower=True) if lower else "export"
                                ) as session, \
            torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        block(torch.rand(2, 3, 8), _Cache(), torch.zeros(()))
    live.remove()
    report = session.finalize()
    assert report.ok, report.summary
    return report, live, block


def _toy(lower: bool) -> tuple[ctxreplay.Capture, _Live, _Block]:
    report, live, block = _toy_report(lower)
    (capture,) = report.captures
    return capture, live, block


@pytest.mark.parametrize("lower", [False, True], ids=["as-traced", "functional"])
def test_a_toy_block_names_its_tuple_its_assignment_and_its_writes_in_place(
        lower: bool, tmp_path: Path) -> None:
    capture, _, _ = _toy(lower)
    specs = [(s.kind.name, s.target) for s in capture.artifact.graph_signature.output_specs]
    own = [("output", "out[0]"), ("output", "out[1]"), ("assigned", "args[1].keys")]
    if lower:
        # a functional program returns its writes in place first, as torch names them
        assert specs[:2] == [("BUFFER_MUTATION", "inner.steps"),
                             ("USER_INPUT_MUTATION", specs[1][1])]
        expected = [("buffer", "steps"), ("input", "args[2]"), *own]
    else:
        # as traced, the writes in place are ops inside the graph, not outputs
        expected = own
    assert len(specs) == len(expected)
    assert [k for k, _ in specs[-3:]] == ["USER_OUTPUT"] * 3
    assert _roles(capture) == expected
    saved = capture.save(tmp_path / "block.pt2")
    assert _roles(ctxreplay.load(saved.path)) == expected


def _consumer(saved: Path, live: _Live, tmp_path: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Run the consumer on the saved capture with the live call's inputs."""
    side = json.loads(Path(str(saved) + ".json").read_text())
    inputs = {p: _at(live.seen["before"], p) for p, _ in side["inputs"]["leaves"]}
    torch.save(inputs, tmp_path / "inputs.pt")
    script = tmp_path / "consumer.py"
    script.write_text(CONSUMER)
    ran = subprocess.run([sys.executable, str(script), str(saved), str(tmp_path / "inputs.pt"),
                          str(tmp_path / "result.pt")], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr[-3000:]
    got: dict[str, dict[str, torch.Tensor]] = torch.load(tmp_path / "result.pt")
    return got


def _assert_rebuilt(got: dict[str, dict[str, torch.Tensor]], live: _Live) -> None:
    out = live.seen["out"]
    own = got["output"]
    # every tensor the call returned is among the outputs, at its path
    leaves = torch.utils._pytree.tree_leaves(out)
    assert len(own) == len(leaves)
    for path, value in own.items():
        assert torch.equal(value, _at({"out": out}, path)), path
    for path, value in [*got["assigned"].items(), *got["input"].items()]:
        assert torch.equal(value, _at(live.seen["after"], path)), path


def test_a_consumer_rebuilds_the_decoder_layers_call_from_the_files_alone(
        tmp_path: Path) -> None:
    capture, live = _qwen2_layer()
    saved = capture.save(tmp_path / "layer.pt2")
    got = _consumer(saved.path, live, tmp_path)
    cache = f"kwargs[{_cache_keyword(live)!r}].layers[0]"
    assert sorted(got["assigned"]) == [f"{cache}.keys", f"{cache}.values"]
    assert got["input"] == {}
    _assert_rebuilt(got, live)
    # the writes are the live cache's new tensors, not the call's output
    assert got["assigned"][f"{cache}.keys"].shape != live.seen["out"].shape


def test_a_consumer_rebuilds_a_toy_blocks_call_and_its_writes_from_the_files_alone(
        tmp_path: Path) -> None:
    capture, live, block = _toy(lower=True)
    saved = capture.save(tmp_path / "block.pt2")
    got = _consumer(saved.path, live, tmp_path)
    assert sorted(got["output"]) == ["out[0]", "out[1]"]
    assert list(got["assigned"]) == ["args[1].keys"]
    assert list(got["input"]) == ["args[2]"]
    _assert_rebuilt(got, live)
    assert got["input"]["args[2]"].item() != 0  # the input the forward wrote
    assert block.steps.item() == 1  # finalize changed nothing of the user's


def test_inspect_names_the_roles_of_every_capture_of_a_manifest_and_a_report(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from ctxreplay.cli import main
    report, _, _ = _toy_report(lower=True)
    report.save_all(tmp_path / "captures")
    report.save(tmp_path / "report.json")
    line = ("graph outputs of _Block#0: 0 steps (buffer), 1 args[2] (input), 2 out[0] (output), "
            "3 out[1] (output), 4 args[1].keys (assigned)")
    for path in (tmp_path / "captures", tmp_path / "report.json"):
        assert main(["inspect", str(path)]) == 0
        assert line in capsys.readouterr().out.splitlines(), path


def test_the_artifacts_page_explains_every_role_kind() -> None:
    # the page's table of kinds, read as the reader sees it: one row per kind
    # (``buffer``, ``parameter`` share one), each kind in backticks in its first cell
    from ctxreplay.artifacts.roles import ROLES

    page = (Path(__file__).resolve().parents[2] / "docs" / "artifacts.md").read_text()
    rows = re.findall(r"^\| (`[a-z]+`(?:, `[a-z]+`)*) \|", page, flags=re.M)
    named = {kind for cell in rows for kind in re.findall(r"`([a-z]+)`", cell)}
    assert set(ROLES) <= named, sorted(set(ROLES) - named)
