"""Strict snapshot documents: every built-in probe's ``decode``
refuses what the probe would never observe, with a ``ValueError`` naming the
path of the bad value.

Two layers: a systematic mutation of valid documents (every leaf replaced by
values of every JSON type, every mapping given an unknown key and stripped of
each key) -- each mutant either decodes to a state that encodes back to the
mutant, or is refused naming a path under the mutated one -- and targeted
values that are well-typed but impossible (an int64 autocast dtype, a
precision name torch does not know, contradictory TF32 flags).
"""

from __future__ import annotations

import contextlib
import copy
import json
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from probe_cases import CASES
from torchstate import cudnn_allow_tf32

import ctxreplay
from ctxreplay._base.environment import ACCELERATORS
from ctxreplay.probes.autocast import AutocastState
from ctxreplay.probes.rng import RngState

PORTABLE = sorted({c.probe for c in CASES})
JUNK: tuple[Any, ...] = (None, True, False, 0, -1, 1.5, "", "bogus", "float64", [], [None],
                         {}, {"x": 1})


def _valid_documents(name: str) -> list[Any]:
    probe = ctxreplay.probes.get_probe(name)
    states = [probe.observe()]
    for case in CASES:
        if case.probe == name:
            with case.make():
                states.append(probe.observe())
    return [json.loads(json.dumps(probe.encode(s))) for s in states]


def _paths(doc: Any, path: str = "$.state") -> Iterator[tuple[str, tuple[Any, ...]]]:
    """``(path, keys)`` for every node, the root included."""
    yield path, ()
    if isinstance(doc, dict):
        for k, v in doc.items():
            for p, ks in _paths(v, f"{path}.{k}" if k.isidentifier() else f"{path}[{k!r}]"):
                yield p, (k, *ks)
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            for p, ks in _paths(v, f"{path}[{i}]"):
                yield p, (i, *ks)


def _set(doc: Any, keys: tuple[Any, ...], value: Any) -> Any:
    if not keys:
        return value
    out = copy.deepcopy(doc)
    node = out
    for k in keys[:-1]:
        node = node[k]
    node[keys[-1]] = value
    return out


def _decodes_or_names_the_path(probe: ctxreplay.probes.ContextProbe[Any], doc: Any,
                               where: str) -> str:
    try:
        state = probe.decode(doc, "$.state")
    except ValueError as exc:
        msg = str(exc)
        assert msg.startswith("$.state"), f"{probe.name}: no path in {msg!r} for {doc!r}"
        # the named path is the mutated node, one of its parents or children
        named = msg.split(":", 1)[0]
        assert named.startswith(where) or where.startswith(named.split("[")[0]), \
            f"{probe.name}: {msg!r} does not name {where} (document {doc!r})"
        assert "\n" not in msg and len(msg) < 400
        return "rejected"
    except Exception as exc:  # anything else is a bug
        raise AssertionError(f"{probe.name}: decode raised {type(exc).__name__}: {exc} "
                             f"for {doc!r}") from exc
    # accepted: it must be a state the probe can carry back unchanged, or one
    # whose omitted fields were filled in (matmul_precision keeps missing flags)
    again = json.loads(json.dumps(probe.encode(state)))
    assert probe.decode(again, "$.state") == state
    return "accepted"


@pytest.mark.parametrize("name", PORTABLE)
def test_every_mutated_leaf_is_decoded_or_rejected_naming_its_path(name: str) -> None:
    probe = ctxreplay.probes.get_probe(name)
    outcomes = {"accepted": 0, "rejected": 0}
    for doc in _valid_documents(name):
        assert probe.decode(copy.deepcopy(doc), "$.state") is not None
        for where, keys in _paths(doc):
            for junk in JUNK:
                outcomes[_decodes_or_names_the_path(probe, _set(doc, keys, junk), where)] += 1
    # the mutation must actually exercise the refusals
    assert outcomes["rejected"] > outcomes["accepted"] > 0 or outcomes["accepted"] == 0


@pytest.mark.parametrize("name", PORTABLE)
def test_unknown_and_missing_fields_are_rejected(name: str) -> None:
    probe = ctxreplay.probes.get_probe(name)
    optional = {"matmul_precision": {"fp32_precision"}, "rng": {"accelerator",
                                                               "accelerator_state"}}
    for doc in _valid_documents(name):
        for _where, keys in _paths(doc):
            node = doc
            for k in keys:
                node = node[k]
            if not isinstance(node, dict):
                continue
            with pytest.raises(ValueError, match=r"^\$\.state.*unknown field"):
                probe.decode(_set(doc, keys, {**node, "zz_extra": 1}), "$.state")
            for k in node:
                if not keys and k in optional.get(name, set()):
                    continue
                if name == "matmul_precision" and keys == ("flags",):
                    continue  # a flag the document lacks keeps its current value
                short = {kk: vv for kk, vv in node.items() if kk != k}
                with pytest.raises(ValueError, match=r"^\$\.state"):
                    probe.decode(_set(doc, keys, short), "$.state")


# -- well-typed but impossible values ----------------------------------------------

@pytest.mark.parametrize("dtype", ["int64", "float32", "float64", "bool", "complex64",
                                   "float8_e4m3fn", "uint8"])
def test_autocast_refuses_a_dtype_autocast_rejects_for_that_device(dtype: str) -> None:
    probe = ctxreplay.probes.get_probe("autocast")
    doc = {"enabled": [["cpu", dtype]], "cache_enabled": True}
    with pytest.raises(ValueError, match=r"^\$\.state\.enabled\[0\]\[1\]: autocast on 'cpu' "
                                         r"does not run in"):
        probe.decode(doc, "$.state")
    # torch's own rule agrees: torch.autocast disables itself for that dtype
    with pytest.warns(UserWarning, match="not supported"), \
            torch.autocast("cpu", dtype=getattr(torch, dtype)):
        assert not torch.is_autocast_enabled("cpu")


def test_the_int64_autocast_document_of_issue_12_is_refused() -> None:
    """Through the public loader, with the consequence it prevents: replaying
    such a state makes ``nn.Linear`` return int64."""
    doc = ctxreplay.snapshot(["autocast"]).to_json()
    doc["probes"]["autocast"]["state"] = {"enabled": [["cpu", "int64"]], "cache_enabled": True}
    with pytest.raises(ValueError, match=r"^\$\.probes\.autocast\.state\.enabled\[0\]\[1\]"):
        ctxreplay.ContextSnapshot.from_json(doc)
    lin = torch.nn.Linear(2, 2)
    with ctxreplay.probes.get_probe("autocast").replay(AutocastState((("cpu", torch.int64),))):
        assert lin(torch.rand(1, 2)).dtype == torch.int64  # what decode now prevents
    assert lin(torch.rand(1, 2)).dtype == torch.float32
    good = {"enabled": [["cpu", "bfloat16"]], "cache_enabled": True}
    doc["probes"]["autocast"]["state"] = good
    assert ctxreplay.ContextSnapshot.from_json(doc)["autocast"].dtype_for("cpu") == torch.bfloat16


def test_autocast_devices_keep_the_observed_order() -> None:
    """decode(encode(s)) == s also for devices whose names sort differently
    from the probe's device order (xpu before mps before hpu)."""
    probe = ctxreplay.probes.get_probe("autocast")
    devices = [d for d in ("xpu", "mps", "hpu") if d in probe.devices]
    state = AutocastState(tuple((d, torch.bfloat16) for d in devices))
    doc = json.loads(json.dumps(probe.encode(state)))
    doc["enabled"].reverse()
    assert probe.decode(doc, "$.state") == state


@pytest.mark.parametrize("dtype", ["int64", "complex64", "float8_e4m3fn", "bool"])
def test_default_dtype_refuses_what_set_default_dtype_refuses(dtype: str) -> None:
    with pytest.raises(ValueError, match=r"^\$\.state: .* cannot be a default dtype"):
        ctxreplay.probes.get_probe("default_dtype").decode(dtype, "$.state")
    before = torch.get_default_dtype()
    with pytest.raises((TypeError, RuntimeError)):
        torch.set_default_dtype(getattr(torch, dtype))
    assert torch.get_default_dtype() == before


@pytest.mark.parametrize("device", ["cuda:-1", "nonsense", "CPU", "cpu:0:1", ""])
def test_default_device_refuses_what_torch_device_refuses(device: str) -> None:
    with pytest.raises(ValueError, match=r"^\$\.state: "):
        ctxreplay.probes.get_probe("default_device").decode(device, "$.state")


def _matmul_doc() -> dict[str, Any]:
    probe = ctxreplay.probes.get_probe("matmul_precision")
    doc: dict[str, Any] = json.loads(json.dumps(probe.encode(probe.observe())))
    return doc


@pytest.mark.parametrize("value", ["fast", "HIGH", "tf32", "default "])
def test_matmul_refuses_an_unknown_legacy_precision(value: str) -> None:
    doc = _matmul_doc()
    doc["float32_matmul_precision"] = value
    with pytest.raises(ValueError, match=r"^\$\.state\.float32_matmul_precision: .* is not "
                                         r"one of"):
        ctxreplay.probes.get_probe("matmul_precision").decode(doc, "$.state")


HAS_FP32_API = hasattr(torch._C, "_get_fp32_precision_getter")
#: what a torch without the per-backend API says of a document that has its values
WRITTEN_BY_A_NEWER_TORCH = "written by a torch with the per-backend fp32_precision settings"


@pytest.mark.parametrize(("key", "value"), [("cuda.matmul", "fast"), ("cuda.matmul", "bf16"),
                                            ("cuda.conv", "bf16"), ("mkldnn.matmul", "fp8"),
                                            ("generic.all", "TF32"), ("cuda.all", "")])
def test_matmul_refuses_a_precision_name_torch_does_not_know(key: str, value: str) -> None:
    doc = _matmul_doc()
    doc.setdefault("fp32_precision", {})[key] = value
    with pytest.raises(ValueError, match=rf"^\$\.state\.fp32_precision\[{key!r}\]: ") as info:
        ctxreplay.probes.get_probe("matmul_precision").decode(doc, "$.state")
    if not HAS_FP32_API:
        # no per-backend value at all can be re-established here, and torch
        # itself has no setter to try the name with
        assert WRITTEN_BY_A_NEWER_TORCH in str(info.value)
        assert not hasattr(torch._C, "_set_fp32_precision_setter")
        return
    # torch refuses the same name: it raises (2.11 on), or only logs "call has
    # no effect" (2.9.1) -- either way the setting stays what it was
    b, _, op = key.partition(".")
    before = torch._C._get_fp32_precision_getter(b, op)
    with contextlib.suppress(RuntimeError):
        torch._C._set_fp32_precision_setter(b, op, value)
    assert torch._C._get_fp32_precision_getter(b, op) == before


@pytest.mark.parametrize(("edit", "named"), [
    ({"float32_matmul_precision": "high"}, "flags.cuda_matmul_tf32"),  # TF32 flag still off
    ({"flags": {"cuda_matmul_tf32": True}}, "flags.cuda_matmul_tf32"),
    ({"fp32_precision": {"cuda.matmul": "tf32"}}, "flags.cuda_matmul_tf32"),
    ({"flags": {"cudnn_tf32": False}}, "flags.cudnn_tf32"),
    ({"flags": {"cuda_fp16_reduced_precision": None}}, "flags.cuda_fp16_reduced_precision"),
    ({"fp32_precision": {"cuda.nonsense": "tf32"}}, "fp32_precision"),
])
def test_matmul_refuses_values_torch_never_reports_together(edit: dict[str, Any],
                                                              named: str) -> None:
    doc = _matmul_doc()
    for k, v in edit.items():
        if isinstance(v, dict):
            doc.setdefault(k, {}).update(v)
        else:
            doc[k] = v
    probe = ctxreplay.probes.get_probe("matmul_precision")
    if not HAS_FP32_API and "fp32_precision" in edit:
        # any per-backend value is refused as a newer torch's
        with pytest.raises(ValueError, match=r"^\$\.state\.fp32_precision\[") as info:
            probe.decode(doc, "$.state")
        assert WRITTEN_BY_A_NEWER_TORCH in str(info.value)
        return
    if not HAS_FP32_API and edit == {"flags": {"cudnn_tf32": False}}:
        # without the per-backend cuDNN values the flag is on its own: a
        # state torch reports once it is set
        with cudnn_allow_tf32(False):
            assert probe.decode(doc, "$.state") == probe.observe()
        return
    with pytest.raises(ValueError, match=rf"^\$\.state\.{named}"):
        probe.decode(doc, "$.state")


def test_matmul_a_document_without_per_backend_values_is_marked_not_recorded() -> None:
    """A document written by a torch without the per-backend API: the state
    says so (``None``) instead of guessing, and describes it.  On such a
    torch it is the probe's own document: it decodes to what it observes."""
    probe = ctxreplay.probes.get_probe("matmul_precision")
    doc = _matmul_doc()
    if not HAS_FP32_API:
        assert "fp32_precision" not in doc
        state = probe.decode(doc, "$.state")
        assert state.fp32_precision == () and state == probe.observe()
        assert "not recorded" not in probe.describe(state)
        return
    del doc["fp32_precision"]
    state = probe.decode(doc, "$.state")
    assert state.fp32_precision is None
    assert "not recorded" in probe.describe(state)
    assert state != probe.observe()


@pytest.mark.parametrize("device", ACCELERATORS)
def test_rng_decodes_the_generator_state_of_every_accelerator(device: str) -> None:
    """Whatever accelerator ``observe`` may record a generator state for, the
    document it encodes to decodes back to the same state."""
    probe = ctxreplay.probes.get_probe("rng")
    state = RngState(bytes(torch.get_rng_state().tolist()), device, b"\x01\x02\x03")
    assert probe.decode(json.loads(json.dumps(probe.encode(state))), "$.state") == state


@pytest.mark.parametrize("device", ["cpu", "meta", "bogus"])
def test_rng_refuses_an_accelerator_that_is_none(device: str) -> None:
    probe = ctxreplay.probes.get_probe("rng")
    doc = probe.encode(RngState(bytes(torch.get_rng_state().tolist()), device, b"\x01"))
    with pytest.raises(ValueError, match=r"\$\.state\.accelerator: "):
        probe.decode(doc, "$.state")
