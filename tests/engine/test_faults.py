"""Fault injection: probes and backends that raise, return garbage, hang or
interrupt.  For every fault the user's forward is undisturbed, the other
variants still capture, the failure is recorded with a reason code, global
state is restored and no reference to the user's inputs survives."""

from __future__ import annotations

import contextvars
import gc
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torchstate as ts
from metadata_check import assert_metadata_only, metadata_violations
from torch import nn
from torch._C._dynamo.guards import GlobalStateGuard

import ctxreplay
from ctxreplay._base.jsonread import read_str
from ctxreplay.backends import Backend, BackendError, get_backend
from ctxreplay.testing import global_state, state_changes

SENTINEL = "SENTINEL-fault-7c1e9 do not leak this text"
TAG: contextvars.ContextVar[str] = contextvars.ContextVar("ctxreplay_fault_tag", default="ok")
BAD_BATCH = 5


class Boom(RuntimeError):
    pass


class FaultProbe(ctxreplay.probes.ContextProbe[str]):
    """State: the value of ``TAG``.  Its fault fires only for the ``"bad"``
    state, so the other variants of the same session are unaffected."""

    portable = True

    def __init__(self, fault: str | None = None, *, traceable: bool = False) -> None:
        self.name = "fault"
        self.fault = fault
        self._traceable = traceable
        self.cleared = 0

    @property
    def traceable(self) -> bool:  # type: ignore[override]
        return self._traceable

    def _fire(self, where: str, state: str) -> None:
        if self.fault == where and state == "bad":
            raise Boom(SENTINEL)
        if self.fault == f"{where}_interrupt" and state == "bad":
            raise KeyboardInterrupt

    def observe(self) -> str:
        tag = TAG.get()
        self._fire("observe", tag)
        return tag

    def replay(self, state: str) -> AbstractContextManager[None]:
        self._fire("replay_call", state)
        return self._replay(state)

    @contextmanager
    def _replay(self, state: str) -> Iterator[None]:
        self._fire("replay_enter", state)
        token = TAG.set(state)
        try:
            yield
        finally:
            TAG.reset(token)  # restores its own state, then fails
            self._fire("replay_exit", state)

    def split_replay(self, state: str) -> tuple[AbstractContextManager[None] | None,
                                                AbstractContextManager[None] | None]:
        self._fire("split_replay", state)
        return super().split_replay(state)

    def clear(self) -> None:
        self.cleared += 1
        if self.fault == "clear":
            raise Boom(SENTINEL)
        if self.fault == "clear_interrupt":
            raise KeyboardInterrupt

    def encode(self, state: str) -> Any:
        self._fire("encode", state)
        return state

    def decode(self, data: Any, path: str) -> str:
        return read_str(data, path)

    def describe(self, state: str) -> str:
        self._fire("describe", state)
        return state


class _Opaque:
    """An artifact without a graph."""


class _Poison:
    """An artifact whose accessors fail."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner


class FaultyBackend(Backend):
    """Wraps a real backend; faults only for the variant whose first input
    has ``BAD_BATCH`` rows."""

    def __init__(self, inner: str, fault: str | None,
                 release: threading.Event | None = None) -> None:
        self.inner = get_backend(inner)
        self.name = f"faulty-{inner}"
        self.records_embedded = self.inner.records_embedded
        self.fault = fault
        self.release = release

    @staticmethod
    def _bad(args: tuple[Any, ...]) -> bool:
        return bool(args) and isinstance(args[0], torch.Tensor) \
            and args[0].shape[0] == BAD_BATCH

    def capture(self, module: nn.Module, args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> Any:
        if not self._bad(args):
            return self.inner.capture(module, args, kwargs)
        f = self.fault
        if f == "raise":
            raise Boom(SENTINEL)
        if f == "backend_error":
            raise BackendError("custom_reason", "Boom")
        if f == "none":
            return None
        if f == "no_graph":
            return _Opaque()
        if f in ("graph_module", "output_spec", "resolve"):
            return _Poison(self.inner.capture(module, args, kwargs))
        if f == "hang":
            assert self.release is not None
            self.release.wait(60)
        if f == "keyboard_interrupt":
            raise KeyboardInterrupt
        if f == "leak":
            # a global the variant's own replay leaves alone (its state is current)
            torch.set_float32_matmul_precision("medium")
        return self.inner.capture(module, args, kwargs)

    def resolve(self, artifact: Any) -> tuple[Backend, Any]:
        if isinstance(artifact, _Poison) and self.fault == "resolve":
            raise Boom(SENTINEL)
        return self, artifact

    def graph_module(self, artifact: Any) -> torch.fx.GraphModule | None:
        if isinstance(artifact, _Poison):
            if self.fault == "graph_module":
                raise Boom(SENTINEL)
            artifact = artifact.inner
        if isinstance(artifact, _Opaque) or artifact is None:
            return super().graph_module(artifact)
        return self.inner.graph_module(artifact)

    def output_spec(self, artifact: Any, args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> Any:
        if isinstance(artifact, _Poison):
            if self.fault == "output_spec":
                raise Boom(SENTINEL)
            artifact = artifact.inner
        if isinstance(artifact, _Opaque) or artifact is None:
            return super().output_spec(artifact, args, kwargs)
        return self.inner.output_spec(artifact, args, kwargs)

    def run(self, artifact: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.fault == "run" and self._bad(args):
            raise Boom(SENTINEL)
        return self.inner.run(artifact, args, kwargs)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x))


# -- the live workload: two good variants, one bad ------------------------------

@contextmanager
def _tagged(tag: str) -> Iterator[None]:
    token = TAG.set(tag)
    try:
        yield
    finally:
        TAG.reset(token)


def _bad_context() -> AbstractContextManager[None]:
    """Non-neutral thread-local *and* process-global state, so a replay that
    fails half way has real state to restore."""
    stack = ExitStack()
    stack.enter_context(_tagged("bad"))
    stack.enter_context(torch.autocast("cpu", dtype=torch.bfloat16))
    stack.enter_context(torch.no_grad())
    stack.enter_context(ts.default_dtype(torch.float64))
    stack.enter_context(ts.deterministic(True))
    return stack


WORKLOAD: list[tuple[str, int, Callable[[], AbstractContextManager[Any]]]] = [
    ("plain", 2, nullcontext),
    ("autocast", 2, lambda: torch.autocast("cpu", dtype=torch.bfloat16)),
    ("bad", BAD_BATCH, _bad_context),
]


def _inputs(order: list[str]) -> list[tuple[str, torch.Tensor]]:
    batch = {name: b for name, b, _ in WORKLOAD}
    g = torch.Generator().manual_seed(1)
    return [(name, torch.rand(batch[name], 8, generator=g)) for name in order for _ in range(2)]


def _run_live(model: nn.Module, inputs: list[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
    ctx = {name: make for name, _, make in WORKLOAD}
    outs = []
    for name, x in inputs:
        with ctx[name]():
            outs.append(model(x).detach())
    return outs


# -- the cases ---------------------------------------------------------------------

@dataclass(frozen=True)
class Fault:
    id: str
    expect: str  # "failure:<reason>", "observation:<where>", "mismatch:<field>", "ok", "raises"
    probe_fault: str | None = None
    traceable: bool = False
    backend_fault: str | None = None
    backend: str = "symbolic"
    timeout: float | None = None
    verify: str = "signature"
    replay: str = "embedded"
    order: tuple[str, ...] = ("plain", "autocast", "bad")


FAULTS = [
    Fault("probe-observe", "observation:observe", probe_fault="observe"),
    Fault("probe-replay-call-around", "failure:replay_failed", probe_fault="replay_call"),
    Fault("probe-replay-call-inside", "failure:replay_failed", probe_fault="replay_call",
          traceable=True, backend="export"),
    Fault("probe-replay-enter-around", "failure:replay_failed", probe_fault="replay_enter"),
    Fault("probe-replay-enter-inside", "failure:replay_failed", probe_fault="replay_enter",
          traceable=True, backend="export"),
    Fault("probe-replay-exit-around", "failure:replay_failed", probe_fault="replay_exit"),
    Fault("probe-replay-exit-inside", "failure:replay_failed", probe_fault="replay_exit",
          traceable=True, backend="export"),
    Fault("probe-replay-enter-ambient-export", "failure:replay_failed",
          probe_fault="replay_enter", traceable=True, backend="export", replay="ambient",
          order=("bad", "plain", "autocast")),
    Fault("probe-split-replay", "failure:replay_failed", probe_fault="split_replay",
          traceable=True, backend="export"),
    Fault("probe-clear", "observation:clear", probe_fault="clear"),
    Fault("probe-encode", "ok", probe_fault="encode"),
    Fault("probe-describe", "ok", probe_fault="describe"),
    Fault("backend-raises", "failure:trace_error", backend_fault="raise"),
    Fault("backend-raises-export", "failure:trace_error", backend_fault="raise",
          backend="export"),
    Fault("backend-error-code", "failure:custom_reason", backend_fault="backend_error"),
    Fault("backend-returns-none", "failure:no_artifact", backend_fault="none"),
    Fault("backend-returns-no-graph", "mismatch:graph", backend_fault="no_graph"),
    Fault("backend-resolve-raises", "failure:bad_artifact", backend_fault="resolve"),
    Fault("backend-graph-module-raises", "failure:bad_artifact",
          backend_fault="graph_module"),
    Fault("backend-output-spec-raises", "failure:bad_artifact", backend_fault="output_spec"),
    Fault("backend-run-raises", "mismatch:execution", backend_fault="run", verify="execute",
          backend="export"),
    Fault("backend-hangs-last", "failure:timeout", backend_fault="hang", timeout=0.5),
    Fault("backend-hangs-first", "failure:timeout", backend_fault="hang", timeout=0.5,
          order=("bad", "plain", "autocast")),
    Fault("backend-leaks-global-state", "failure:state_leak", backend_fault="leak"),
    Fault("backend-keyboard-interrupt", "raises", backend_fault="keyboard_interrupt"),
    Fault("probe-replay-enter-keyboard-interrupt", "raises",
          probe_fault="replay_enter_interrupt"),
    Fault("probe-replay-exit-keyboard-interrupt-inside", "raises",
          probe_fault="replay_exit_interrupt", traceable=True, backend="export"),
    Fault("probe-clear-keyboard-interrupt", "raises", probe_fault="clear_interrupt"),
    Fault("backend-keyboard-interrupt-thread", "raises", backend_fault="keyboard_interrupt",
          timeout=5.0),
]

SURVIVED: set[str] = set()


def _oracle() -> Callable[[], list[str]]:
    """The conftest oracle's comparison, usable mid-test."""
    snap = ctxreplay.snapshot(ctxreplay.probes.default_probes())
    before = global_state()
    guard = GlobalStateGuard()
    return lambda: state_changes(guard, before, snap)


@pytest.mark.parametrize("fault", FAULTS, ids=lambda f: f.id)
def test_fault_is_survived(fault: Fault) -> None:
    changes = _oracle()
    model = Net()
    inputs = _inputs(list(fault.order))
    expected = _run_live(model, inputs)  # no session

    probe = FaultProbe(fault.probe_fault, traceable=fault.traceable)
    tail = FaultProbe()  # replayed and cleared after the faulty one
    tail.name = "zz_tail"
    release = threading.Event()
    backend = FaultyBackend(fault.backend, fault.backend_fault, release)
    session = ctxreplay.capture_with(
        model, probes=[*ctxreplay.probes.default_probes(), probe, tail], backend=backend,
        verify=fault.verify, replay=fault.replay, capture_timeout=fault.timeout)
    with session:
        got = _run_live(model, inputs)
    for a, b in zip(expected, got, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b), "the live forward was disturbed"
    del got, expected
    refs = [weakref.ref(x) for _, x in inputs]
    del inputs

    try:
        if fault.expect == "raises":
            with pytest.raises(KeyboardInterrupt):
                session.finalize()
            assert session.closed
            report = None
        else:
            report = session.finalize()
        assert changes() == [], "global state changed by finalize"
        assert "forward" not in model.__dict__, "the forward wrapper was not removed"
        assert probe.cleared >= 1 and tail.cleared >= 1, "probes were not cleared"
        assert all(v.module is None for _, v in session.variants)
        gc.collect()
        assert [r() for r in refs] == [None] * len(refs), "an input is still referenced"
        if report is not None:
            _check_report(fault, report)
    finally:
        release.set()
        for t in threading.enumerate():
            if t.name == "ctxreplay-capture":
                t.join(30)
    # the abandoned worker's late restore (if any) changed nothing either
    assert changes() == []
    SURVIVED.add(fault.id)


def _check_report(fault: Fault, report: ctxreplay.CaptureReport) -> None:
    by_kind: dict[str, ctxreplay.Capture] = {}
    for c in report.captures:
        batch = c.signature.args[0].shape[0]  # type: ignore[union-attr]
        kind = "bad" if batch == BAD_BATCH else (
            "autocast" if c.snapshot["autocast"].enabled else "plain")
        by_kind[kind] = c
    # the good variants always capture, with both calls counted
    for kind in ("plain", "autocast"):
        assert kind in by_kind, f"good variant {kind!r} missing: {report.failures}"
        c = by_kind[kind]
        assert c.calls == 2
        assert c.fidelity.ok, c.fidelity.mismatches
    expect, _, code = fault.expect.partition(":")
    failures = [f for f in report.failures]
    if expect == "failure":
        assert [f.reason for f in failures] == [code], failures
        assert failures[0].variant == (0 if fault.order[0] == "bad" else 2)
        assert failures[0].scope == "Net"
    else:
        assert failures == [], failures
    if expect == "observation":
        assert any(w == code and t == "Boom" for w, t, _ in report.observation_errors), \
            report.observation_errors
        if code == "observe":
            assert "bad" not in by_kind
            assert (code, "Boom", 2) in report.observation_errors
    if expect == "mismatch":
        assert not by_kind["bad"].fidelity.ok
        assert [m.field for m in by_kind["bad"].fidelity.mismatches] == [code]
    if expect == "ok":
        assert by_kind["bad"].fidelity.ok
    if fault.probe_fault == "encode":
        doc = by_kind["bad"].snapshot.to_json()
        assert doc["probes"]["fault"] == {"portable": False, "type": "str"}
    if fault.probe_fault == "describe":
        assert by_kind["bad"].snapshot.describe()["fault"] == "<undescribable: Boom>"
    if code == "state_leak":
        assert by_kind["bad"].fidelity.ok  # the capture itself succeeded
        assert "matmul_precision" in failures[0].context
    # metadata only, whatever went wrong
    assert_metadata_only(report.to_json(), sentinels=[SENTINEL])


def test_keyboard_interrupt_in_observe_reaches_the_user() -> None:
    """A user's Ctrl-C during observation is not swallowed; the session
    stays usable and nothing leaks."""

    class Interrupting(FaultProbe):
        def observe(self) -> str:
            if TAG.get() == "bad":
                raise KeyboardInterrupt
            return TAG.get()

    changes = _oracle()
    model = Net()
    x = torch.rand(2, 8)
    with ctxreplay.capture_with(model, probes=["grad_mode", Interrupting()],
                                backend="symbolic") as session:
        with _tagged("bad"), pytest.raises(KeyboardInterrupt):
            model(x)
        torch.testing.assert_close(model(x), Net()(x), rtol=0, atol=0)
    report = session.finalize()
    assert [c.calls for c in report.captures] == [1]
    assert changes() == []
    SURVIVED.add("probe-observe-keyboard-interrupt")


def test_broken_probe_error_does_not_break_other_sessions() -> None:
    """A failing variant in one session has no effect on a second session
    on the same model."""
    model = Net()
    good = ctxreplay.capture_with(model, backend="symbolic")
    bad = ctxreplay.capture_with(model, probes=[*ctxreplay.probes.default_probes(),
                                                FaultProbe("replay_enter")],
                                 backend="symbolic")
    with good, bad, _tagged("bad"):
        model(torch.rand(2, 8))
    assert [f.reason for f in bad.finalize().failures] == ["replay_failed"]
    r = good.finalize()
    assert r.ok and [c.calls for c in r.captures] == [1]
    SURVIVED.add("two-sessions-one-broken")


def test_report_carries_no_values_texts_or_source() -> None:
    """Planted parameter and input values, a planted string argument and a
    planted exception text: none of them reaches the report."""
    weight, value = 0.123456789, 7.654321

    class Prompted(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            with torch.no_grad():
                self.lin.weight.fill_(weight)
                self.lin.bias.fill_(weight)

        def forward(self, x: torch.Tensor, prompt: str) -> torch.Tensor:
            # SENTINEL-source-comment: source text must not travel either
            if prompt == "explode":
                raise Boom(SENTINEL)
            return self.lin(x)

    model = Prompted()
    with ctxreplay.capture_with(model, verify="execute", backend="export") as session:
        model(torch.full((2, 4), value), prompt="SENTINEL-prompt-31f")
        model(torch.full((3, 4), value), prompt="explode-not")
    report = session.finalize()
    assert len(report.captures) == 2
    assert_metadata_only(report.to_json(), sentinels=[SENTINEL, "SENTINEL-prompt-31f",
                                                      "explode-not", "SENTINEL-source"],
                         sentinel_numbers=[weight, value])


def test_metadata_checker_catches_violations() -> None:
    """The checker is not vacuous: each kind of violation is reported."""
    bad = {
        "tensor": torch.ones(2),
        "bytes": b"\x00",
        "message": "short",
        "trace": 'Traceback (most recent call last):\n  File "x.py", line 1',
        "exc": "ValueError: the value 3 is bad",
        "source": "def forward(self, x):",
        "long": "x" * 600,
        "dump": [0.5] * 100,
        "planted": 0.123456789,
        "nan": float("nan"),
        "text": "SENTINEL-xyz",
    }
    problems = metadata_violations(bad, sentinels=["SENTINEL-xyz"],
                                   sentinel_numbers=[0.123456789])
    for key in ("$.tensor: non-JSON", "$.bytes: non-JSON", "$.message: forbidden key",
                "$.trace: control character", "$.exc: looks like free text",
                "$.source: forbidden key",
                "$.long: string of 600", "$.dump: 100 floats", "$.planted: planted number",
                "$.nan: non-finite", "$.text: contains the planted string"):
        assert any(p.startswith(key) for p in problems), (key, problems)
    assert metadata_violations({"scope": "Net", "shape": [2, 8], "dtype": "bfloat16"}) == []


def test_zz_fault_count() -> None:
    """Runs last in this file: the figure for the report."""
    total = len(FAULTS) + 2
    print(f"\nfault cases injected: {total}, survived: {len(SURVIVED)}")
    assert len(FAULTS) >= 25
