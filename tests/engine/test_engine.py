"""Acceptance tests of the capture engine: deferred capture is faithful to the
live call's ambient state, and the session costs the live forward nothing
but a thin wrapper.

Every faithfulness claim is shown against the unfaithful baseline
(``replay="off"``), which must get it wrong in the same setting.
"""

from __future__ import annotations

import dataclasses
import gc
import types
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from engine_models import BF16, F32, MatmulBlock, bf16, matmul_dtypes, out_dtypes
from metadata_check import check_report, finalize_checked
from torch import nn
from torch._C._dynamo.guards import GlobalStateGuard

import ctxreplay
from ctxreplay.backends.passes import graph_nodes

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


def _x(*shape: int) -> torch.Tensor:
    return torch.rand(*shape)


# -- 1. the motivating regression ---------------------------------------------

def test_bf16_matmul_is_captured_in_bf16_after_autocast_exits() -> None:
    torch.manual_seed(0)
    model = MatmulBlock()
    x = _x(4, 16)
    with ctxreplay.capture_with(model, backend="export") as faithful, \
            ctxreplay.capture_with(model, backend="export", replay="off") as baseline, bf16():
        live = model(x)
    assert live.dtype == BF16
    assert not torch.is_autocast_enabled("cpu")  # capture happens after the block exited

    report = finalize_checked(faithful)
    base = finalize_checked(baseline)

    (c,) = report.captures
    (b,) = base.captures
    assert matmul_dtypes(c) == {BF16}
    assert matmul_dtypes(b) == {F32}  # the regression ctxreplay exists for
    assert out_dtypes(c.graph_outputs) == [BF16]
    assert c.fidelity.ok and report.ok
    assert not b.fidelity.ok
    (m,) = [m for m in b.fidelity.mismatches if m.level == "signature"]
    assert (m.field, m.live, m.captured) == ("dtype", "bfloat16", "float32")
    assert "autocast" in (m.hint or "")
    # and the default's value check of the live call finds it too
    assert any(m.level == "sampled" for m in b.fidelity.mismatches)


# -- 2. same shapes, different context: two variants ---------------------------

def test_same_shapes_under_two_contexts_give_two_variants() -> None:
    model = MatmulBlock()
    with ctxreplay.capture_with(model, backend="export") as s, \
            ctxreplay.capture_with(model, backend="export", replay="off") as off:
        model(_x(4, 16))
        model(_x(4, 16))
        with bf16():
            model(_x(4, 16))
    report = finalize_checked(s)
    assert len(report.captures) == 2
    by_ctx = {c.snapshot.describe()["autocast"]: c for c in report.captures}
    assert set(by_ctx) == {"off", "cpu:bfloat16"}
    assert matmul_dtypes(by_ctx["off"]) == {F32}
    assert matmul_dtypes(by_ctx["cpu:bfloat16"]) == {BF16}
    assert by_ctx["off"].calls == 2 and by_ctx["cpu:bfloat16"].calls == 1
    assert by_ctx["off"].fingerprint != by_ctx["cpu:bfloat16"].fingerprint
    assert report.ok
    # without replay the same two variants are seen, but both come out float32
    base = finalize_checked(off)
    assert sorted({d for c in base.captures for d in matmul_dtypes(c)}, key=str) == [F32]
    assert not base.ok


# -- 3. inference mode ------------------------------------------------------------

def test_inference_mode_forward_is_captured_outside_inference_mode() -> None:
    model = MatmulBlock()
    with ctxreplay.capture_with(model, backend="export", verify="execute") as s, \
            torch.inference_mode():
        x = _x(4, 16)
        assert x.is_inference()
        live = model(x)
    assert live.is_inference()
    assert not torch.is_inference_mode_enabled()
    report = finalize_checked(s)
    assert not report.failures, report.failures
    (c,) = report.captures
    assert c.snapshot.describe()["grad_mode"] == "inference_mode"
    assert c.fidelity.ok and c.fidelity.checked == ("signature", "execute")
    assert not torch.is_inference_mode_enabled()


# -- 4. no live tensor is retained -----------------------------------------------

def test_live_input_and_output_die_while_the_session_is_open() -> None:
    model = MatmulBlock()
    with ctxreplay.capture_with(model, backend="export") as s:
        x = _x(4, 16)
        y = model(x)
        wx, wy = weakref.ref(x), weakref.ref(y)
        with bf16():
            z = model(x)
        wz = weakref.ref(z)
        del x, y, z
        gc.collect()
        assert wx() is None, "the session keeps the live input alive"
        assert wy() is None, "the session keeps the live output alive"
        assert wz() is None
        assert not s.closed
    report = finalize_checked(s)
    assert len(report.captures) == 2 and report.ok


# -- 5. embedded vs ambient replay ------------------------------------------------

def test_embedded_replay_makes_a_self_contained_artifact() -> None:
    model = MatmulBlock()
    with ctxreplay.capture_with(model, backend="export", replay="embedded",
                                verify="execute") as s, bf16():
        model(_x(4, 16))
    (c,) = finalize_checked(s).captures
    assert "autocast" in c.embedded and "autocast" not in c.ambient_only
    assert not torch.is_autocast_enabled("cpu")
    out = c.artifact.module()(_x(4, 16))
    assert out.dtype == BF16
    assert c.fidelity.ok and "execute" in c.fidelity.checked


def test_ambient_replay_gets_metadata_right_but_not_the_artifact() -> None:
    model = MatmulBlock()
    with ctxreplay.capture_with(model, backend="export", replay="ambient",
                                verify="execute") as s, bf16():
        model(_x(4, 16))
    (c,) = finalize_checked(s).captures
    assert out_dtypes(c.graph_outputs) == [BF16]
    assert matmul_dtypes(c) == {BF16}
    assert c.embedded == () and "autocast" in c.ambient_only
    assert not torch.is_autocast_enabled("cpu")
    assert c.artifact.module()(_x(4, 16)).dtype == F32  # DESIGN.md fact 2
    # the execute check sees it and names the probe the artifact does not carry
    assert [(m.level, m.field) for m in c.fidelity.mismatches] == [("execute", "dtype")]
    assert "autocast" in (c.fidelity.mismatches[0].hint or "")


# -- 7. a new probe needs no engine change ----------------------------------------

_FLAG = {"upcast": False}


@contextmanager
def _upcast(on: bool) -> Iterator[None]:
    before = _FLAG["upcast"]
    _FLAG["upcast"] = on
    try:
        yield
    finally:
        _FLAG["upcast"] = before


class UpcastFlagProbe(ctxreplay.probes.ContextProbe[bool]):
    """A framework flag read by the model's forward (selects an output dtype)."""

    name = "test_upcast_flag"
    description = "test-only module flag"
    default = True

    def observe(self) -> bool:
        return _FLAG["upcast"]

    def replay(self, state: bool) -> Any:
        return _upcast(state)

    def neutral(self, state: bool) -> bool:
        return not state

    def encode(self, state: bool) -> bool:
        return state

    def decode(self, data: Any, path: str) -> bool:
        if not isinstance(data, bool):
            raise ValueError(f"{path}: expected a bool")
        return data


class FlagModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if _FLAG["upcast"]:
            y = y.to(torch.float64) * 2
        return y


def test_a_runtime_registered_probe_is_replayed_without_engine_changes() -> None:
    model = FlagModel()
    ctxreplay.probes.register_probe(UpcastFlagProbe)
    try:
        assert "test_upcast_flag" in ctxreplay.probes.default_probes()
        without = [n for n in ctxreplay.probes.default_probes() if n != "test_upcast_flag"]
        with ctxreplay.capture_with(model, backend="export") as s, \
                ctxreplay.capture_with(model, probes=without, backend="export") as blind, \
                _upcast(True):
            live = model(_x(2, 8))
        assert live.dtype == torch.float64 and not _FLAG["upcast"]
        report = finalize_checked(s)
        base = finalize_checked(blind)
    finally:
        ctxreplay.probes.unregister_probe("test_upcast_flag")
    (c,) = report.captures
    (b,) = base.captures
    assert "test_upcast_flag" in report.probes
    assert c.snapshot["test_upcast_flag"] is True
    assert out_dtypes(c.graph_outputs) == [torch.float64] and c.fidelity.ok
    ops = {str(n.target) for n in graph_nodes(c.artifact.graph_module)}
    assert "aten._to_copy.default" in ops or "aten.to.dtype" in ops
    # the same capture without the probe takes the other branch
    assert "test_upcast_flag" not in base.probes
    assert out_dtypes(b.graph_outputs) == [F32] and not b.fidelity.ok
    assert c.fingerprint != b.fingerprint


# -- 10. arguments torch's pytree does not know -----------------------------------

@dataclasses.dataclass
class Batch:
    tokens: torch.Tensor
    positions: torch.Tensor


class AttnMetadata:
    """A framework's opaque metadata object: a tensor plus plain fields."""

    def __init__(self, scale: torch.Tensor, num_seqs: int) -> None:
        self.scale = scale
        self.num_seqs = num_seqs


class MetaBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, batch: Batch, meta: AttnMetadata) -> torch.Tensor:
        h = self.lin(batch.tokens + batch.positions)  # bfloat16 under autocast
        return h[: meta.num_seqs] * meta.scale.to(h.dtype)


def test_dataclass_and_opaque_metadata_arguments_are_flattened() -> None:
    model = MetaBlock()
    with ctxreplay.capture_with(model, backend="export", verify="execute") as s, bf16():
        live = model(Batch(_x(3, 8), _x(3, 8)), AttnMetadata(_x(2, 8), 2))
    assert live.dtype == BF16 and live.shape == (2, 8)
    report = finalize_checked(s)
    assert not report.failures, report.failures
    (c,) = report.captures
    assert c.binding == "flattened"
    assert any("num_seqs" in p for p in c.constants), c.constants
    assert out_dtypes(c.graph_outputs) == [live.dtype]
    assert c.fidelity.ok and "execute" in c.fidelity.checked
    # the artifact takes the tensor leaves in order and returns what ran live
    out = c.artifact.module()(_x(3, 8), _x(3, 8), _x(2, 8))
    assert out.dtype == live.dtype and out.shape == live.shape


# -- 11. kwargs and nested outputs ------------------------------------------------

class KwBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, *, bias: torch.Tensor, scale: int = 1,
                mask: torch.Tensor | None = None) -> Any:
        h = self.a(x) * scale  # bfloat16 under autocast
        if mask is not None:
            h = h.masked_fill(mask, 0.0)
        return h, {"small": self.b(h), "pair": (h.float().sum(-1), bias + 1)}


@pytest.mark.parametrize("backend", ["export", "dynamo", "symbolic"])
def test_kwargs_and_nested_outputs(backend: str) -> None:
    model = KwBlock()
    kwargs = {"bias": _x(4), "scale": 3, "mask": torch.zeros(2, 8, dtype=torch.bool)}
    with ctxreplay.capture_with(model, backend=backend) as s, \
            ctxreplay.capture_with(model, backend=backend, replay="off") as off, bf16():
        live = model(_x(2, 8), **kwargs)
    live_dtypes = [live[0].dtype, live[1]["small"].dtype, live[1]["pair"][0].dtype,
                   live[1]["pair"][1].dtype]
    assert live_dtypes == [BF16, BF16, F32, F32]
    report = finalize_checked(s)
    assert not report.failures, report.failures
    (c,) = report.captures
    assert [k for k, _ in c.signature.kwargs] == ["bias", "scale", "mask"]
    assert c.backend == backend
    assert out_dtypes(c.outputs) == live_dtypes
    assert out_dtypes(c.graph_outputs) == live_dtypes
    if backend == "symbolic":
        # its graph holds no autocast: the artifact alone does not reproduce
        # the call (the runs that check it say so), with autocast around it does
        assert not c.fidelity.ok and c.fidelity.ok_with_needs
        assert c.ambient_only == ("autocast",)
    else:
        assert c.fidelity.ok
    # the baseline: mismatches, located by path in the nested output
    (b,) = finalize_checked(off).captures
    assert out_dtypes(b.graph_outputs) == [F32] * 4
    assert sorted(m.path for m in b.fidelity.mismatches if m.level == "signature") == [
        "out[0]", "out[1]"]


def test_a_different_kwarg_value_is_a_different_variant() -> None:
    model = KwBlock()
    with ctxreplay.capture_with(model, backend="export") as s:
        model(_x(2, 8), bias=_x(4), scale=2)
        model(_x(2, 8), bias=_x(4), scale=2)
        model(_x(2, 8), bias=_x(4), scale=5)
    report = finalize_checked(s)
    assert [c.calls for c in report.captures] == [2, 1]
    assert report.ok


# -- 13. profiler ranges ----------------------------------------------------------

def test_profile_ranges_name_scope_and_variant() -> None:
    model = MatmulBlock()
    with ctxreplay.capture_with(model, backend="export", profile_ranges=True) as s, \
            torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(_x(4, 16))
        model(_x(4, 16))
        with bf16():
            model(_x(4, 16))
    names = [e.name for e in prof.events() if e.name.startswith("ctxreplay:")]
    report = finalize_checked(s)
    scope = report.captures[0].scope
    assert sorted(set(names)) == [f"ctxreplay:{scope}#0", f"ctxreplay:{scope}#1"]
    assert names.count(f"ctxreplay:{scope}#0") == 2


def test_no_profile_ranges_by_default() -> None:
    model = MatmulBlock()
    with ctxreplay.capture_with(model, backend="export") as s, \
            torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(_x(4, 16))
    assert not [e for e in prof.events() if e.name.startswith("ctxreplay:")]
    finalize_checked(s)


# -- 14. session lifecycle ----------------------------------------------------------

def test_context_manager_removes_the_wrapper() -> None:
    model = MatmulBlock()
    assert "forward" not in model.__dict__
    with ctxreplay.capture_with(model, backend="export") as s:
        assert "forward" in model.__dict__
        model(_x(4, 16))
    assert "forward" not in model.__dict__
    assert s.closed
    model(_x(4, 16))  # not observed any more
    report = finalize_checked(s)
    assert report.captures[0].calls == 1


def test_close_and_finalize_detach_without_a_context_manager() -> None:
    m1, m2 = MatmulBlock(), MatmulBlock()
    s1 = ctxreplay.capture_with(m1, backend="export")
    s2 = ctxreplay.capture_with(m2, backend="export")
    m1(_x(4, 16))
    m2(_x(4, 16))
    s1.close()
    assert "forward" not in m1.__dict__ and s1.closed
    s1.close()  # idempotent
    r2 = finalize_checked(s2)
    assert "forward" not in m2.__dict__
    r1 = finalize_checked(s1)
    assert len(r1.captures) == len(r2.captures) == 1
    assert s2.report is r2 and s1.report is r1
    # a completed finalize detached: a second one would silently ignore every
    # call since, so it says so instead
    for s in (s1, s2):
        with pytest.raises(ctxreplay.SessionError, match="already completed"):
            s.finalize()


def test_a_finalized_session_holds_neither_module_nor_example_tensors() -> None:
    model = MatmulBlock()
    wmodel = weakref.ref(model)
    s = ctxreplay.capture_with(model, backend="export")
    x = _x(4, 16)
    with bf16():
        model(x)
    wx = weakref.ref(x)
    # the walk below does see a module the session holds (its observed member)
    assert any(o is model for o in _reachable(s, skip=(ctxreplay.CaptureReport,)))
    report = finalize_checked(s)
    assert report.ok
    del model, x
    gc.collect()
    assert wx() is None
    assert wmodel() is None, "the session or its report keeps the module alive"
    assert s.report is report
    del report
    gc.collect()
    # Nothing reachable from the session is a module or a tensor -- except
    # through the report it keeps for finalize(), whose artifacts hold the
    # exported programs (parameters and example inputs of the capture).
    for obj in _reachable(s, skip=(ctxreplay.CaptureReport,)):
        assert not isinstance(obj, nn.Module | torch.Tensor), type(obj)


def _reachable(root: object, skip: tuple[type, ...]) -> Iterator[object]:
    """Objects reachable from ``root`` by strong references, not entering
    classes, modules, weak references, function globals or ``skip``."""
    seen: set[int] = set()
    todo: list[Any] = [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, (type, types.ModuleType, weakref.ref, *skip)):
            continue
        seen.add(id(obj))
        yield obj
        refs = gc.get_referents(obj)
        if isinstance(obj, types.FunctionType):
            refs = [r for r in refs if r is not obj.__globals__]
        todo.extend(refs)


def test_a_wrapper_added_on_top_stays_working_after_close() -> None:
    model = MatmulBlock()
    s = ctxreplay.capture_with(model, backend="export")
    ours = model.forward
    calls: list[int] = []

    def theirs(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return ours(*args, **kwargs)

    model.forward = theirs  # another tool wraps on top of ours
    model(_x(4, 16))
    s.close()
    assert model.__dict__["forward"] is theirs  # not ripped out from under them
    model(_x(4, 16))
    assert len(calls) == 2
    report = finalize_checked(s)
    assert report.captures[0].calls == 1  # after close our wrapper only passes through
    del model.forward


def test_two_sessions_on_one_module_observe_independently() -> None:
    model = MatmulBlock()
    # each size its own capture (fold=False): each session's shapes are listed
    s1 = ctxreplay.capture_with(model, backend="export", fold=False)
    model(_x(4, 16))
    with ctxreplay.capture_with(model, backend="export", fold=False) as s2:
        with bf16():
            model(_x(4, 16))
        model(_x(2, 16))
    model(_x(3, 16))
    r1 = finalize_checked(s1)
    r2 = finalize_checked(s2)
    assert "forward" not in model.__dict__
    assert [tuple(c.signature.args[0].shape) for c in r1.captures] == [  # type: ignore[union-attr]
        (4, 16), (4, 16), (2, 16), (3, 16)]
    assert [tuple(c.signature.args[0].shape) for c in r2.captures] == [  # type: ignore[union-attr]
        (4, 16), (2, 16)]
    assert r1.ok and r2.ok


def test_forward_outputs_are_bit_identical_with_and_without_a_session() -> None:
    torch.manual_seed(1)
    model = MatmulBlock()
    xs = [_x(4, 16), _x(2, 16)]

    def run() -> list[torch.Tensor]:
        outs = [model(x) for x in xs]
        with bf16():
            outs += [model(x) for x in xs]
        with torch.no_grad():
            outs.append(model(xs[0]))
        return outs

    bare = run()
    with ctxreplay.capture_with(model, backend="export", profile_ranges=True) as s:
        observed = run()
        observed_again = run()  # the memoised path
    finalize_checked(s)
    for a, b, c in zip(bare, observed, observed_again, strict=True):
        assert a.dtype == b.dtype == c.dtype
        assert torch.equal(a, b) and torch.equal(a, c)
        assert a.requires_grad == b.requires_grad


def test_finalize_leaves_global_state_as_it_found_it() -> None:
    model = MatmulBlock()
    with ctxreplay.capture_with(model, backend="export") as s:
        with bf16(), torch.no_grad():
            model(_x(4, 16))
        with torch.inference_mode():
            model(_x(4, 16))
    guard = GlobalStateGuard()
    report = finalize_checked(s)
    gc.collect()
    assert guard.check(), guard.reason()
    assert len(report.captures) == 2 and report.ok


# -- 15. strict ----------------------------------------------------------------------

def test_strict_finalize_raises_listing_the_mismatch() -> None:
    model = MatmulBlock()
    with ctxreplay.capture_with(model, backend="export", replay="off") as s, bf16():
        model(_x(4, 16))
    with pytest.raises(ctxreplay.FidelityError) as info:
        s.finalize(strict=True)
    text = str(info.value)
    assert "dtype" in text and "live=bfloat16" in text and "captured=float32" in text
    assert not info.value.report.ok
    assert s.report is info.value.report
    check_report(s.report)  # the report exists and is metadata only


def test_strict_finalize_passes_when_replay_is_on() -> None:
    model = MatmulBlock()
    with ctxreplay.capture_with(model, backend="export") as s, bf16():
        model(_x(4, 16))
    assert finalize_checked(s, strict=True).ok
