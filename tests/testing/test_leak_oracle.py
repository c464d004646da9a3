"""The leak oracle catches a real leak, and the engine's safety net prevents it.

A deliberately broken probe whose ``replay()`` sets a global and never puts
it back: used directly, the oracle (the comparison the autouse conftest
fixture runs after every test) reports the change; run through
``capture_with`` / ``finalize`` it leaves nothing changed, because the engine
re-establishes the pre-finalize state and records a ``state_leak`` failure.
Without that safety net the same session leaks -- shown by switching it off.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import pytest
import torch
from metadata_check import assert_metadata_only
from torch import nn
from torch._C._dynamo.guards import GlobalStateGuard

import ctxreplay
import ctxreplay.engine.session
from ctxreplay._base.jsonread import read_str
from ctxreplay.testing import global_state, leak_check, state_changes


class ForgetfulProbe(ctxreplay.probes.ContextProbe[str]):
    """Its replay turns deterministic algorithms on and never restores them."""

    name = "forgetful"

    def observe(self) -> str:
        return "on"

    def replay(self, state: str) -> AbstractContextManager[None]:
        return self._replay()

    @contextmanager
    def _replay(self) -> Iterator[None]:
        torch.use_deterministic_algorithms(True)  # the bug: no try/finally restore
        yield

    def encode(self, state: str) -> Any:
        return state

    def decode(self, data: Any, path: str) -> str:
        return read_str(data, path)


def _oracle() -> Callable[[], list[str]]:
    """Exactly what tests/conftest.py compares before and after every test."""
    snap = ctxreplay.snapshot(ctxreplay.probes.default_probes())
    before = global_state()
    guard = GlobalStateGuard()
    return lambda: state_changes(guard, before, snap)


def _restore_determinism() -> None:
    torch.use_deterministic_algorithms(False)


def _workload() -> tuple[nn.Module, list[torch.Tensor]]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU()), [torch.rand(2, 4), torch.rand(3, 4)]


def test_oracle_detects_a_probe_that_leaks_when_used_directly() -> None:
    changes = _oracle()
    probe = ForgetfulProbe()
    with probe.replay("on"):
        pass
    try:
        problems = changes()
        assert any(p.startswith("GlobalStateGuard:") and "deterministic" in p
                   for p in problems), problems
        assert "deterministic_algorithms: False -> True" in problems
        assert any(p.startswith("probe determinism:") for p in problems), problems
    finally:
        _restore_determinism()
    assert changes() == []


def test_leak_check_context_fails_on_the_same_leak() -> None:
    with pytest.raises(AssertionError, match="deterministic_algorithms"):
        try:
            with leak_check("forgetful"), ForgetfulProbe().replay("on"):
                pass
        finally:
            _restore_determinism()


@pytest.mark.parametrize("blind_spot", ["autocast_dtype", "inference_mode", "default_device",
                                        "cudnn_enabled"])
def test_oracle_sees_what_the_global_state_guard_is_blind_to(blind_spot: str) -> None:
    """DESIGN.md fact 12: the guard alone misses these; the oracle does not."""
    changes = _oracle()
    guard = GlobalStateGuard()
    undo: Callable[[], object]
    if blind_spot == "autocast_dtype":
        before_dtype = torch.get_autocast_dtype("cpu")
        torch.set_autocast_dtype("cpu", torch.float16)

        def undo() -> None:
            torch.set_autocast_dtype("cpu", before_dtype)
    elif blind_spot == "inference_mode":
        outer = torch.no_grad()
        outer.__enter__()
        changes = _oracle()  # baseline: no_grad
        guard = GlobalStateGuard()
        inner = torch.inference_mode()
        inner.__enter__()

        def undo() -> None:
            inner.__exit__(None, None, None)
            outer.__exit__(None, None, None)
    elif blind_spot == "default_device":
        mode = torch.device("meta")
        mode.__enter__()

        def undo() -> None:
            mode.__exit__(None, None, None)
    else:
        before_cudnn = torch.backends.cudnn.enabled
        torch.backends.cudnn.enabled = not before_cudnn

        def undo() -> None:
            torch.backends.cudnn.enabled = before_cudnn
    try:
        assert guard.check(), "torch's guard is no longer blind to this: update fact 12"
        assert changes() != []
    finally:
        undo()
    if blind_spot != "inference_mode":
        assert changes() == []


def test_engine_restores_what_a_forgetful_probe_leaks() -> None:
    changes = _oracle()
    model, xs = _workload()
    probes = [*ctxreplay.probes.default_probes(), ForgetfulProbe()]
    with ctxreplay.capture_with(model, probes=probes,
                                backend="symbolic") as session:
        for x in xs:
            model(x)
    report = session.finalize()
    assert changes() == [], "finalize left global state changed"
    assert len(report.captures) == 2 and all(c.fidelity.ok for c in report.captures)
    leaks = [f for f in report.failures if f.reason == "state_leak"]
    assert [f.variant for f in leaks] == [0, 1]
    assert all(set(f.context) == {"determinism"} for f in leaks), leaks
    assert "deterministic_algorithms=True" in leaks[0].context["determinism"]
    assert not report.ok
    assert_metadata_only(report.to_json())


def test_without_the_safety_net_the_same_session_leaks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The counterfactual: switch the engine's net off and the oracle fires."""

    class NoNet:
        def restore(self) -> dict[str, str]:
            return {}

    monkeypatch.setattr(ctxreplay.engine.session, "SafetyNet", NoNet)
    changes = _oracle()
    model, xs = _workload()
    probes = [*ctxreplay.probes.default_probes(), ForgetfulProbe()]
    with ctxreplay.capture_with(model, probes=probes,
                                backend="symbolic") as session:
        model(xs[0])
    try:
        report = session.finalize()
        assert "deterministic_algorithms: False -> True" in changes()
        assert [f.reason for f in report.failures] == []  # nothing noticed it either
    finally:
        _restore_determinism()
    assert changes() == []


def test_engine_reports_what_it_cannot_put_back() -> None:
    """A backend that changes a global no default probe covers (the thread
    count): the guard names it in a ``state_leak`` failure; the caller is told.

    The change is made where the artifact is run for the check, in the
    caller's thread: the trace itself runs in a worker thread, whose thread
    count (OpenMP's, per thread) ends with it."""
    threads = torch.get_num_threads()

    class ThreadsBackend(ctxreplay.backends.Backend):
        name = "threads"
        records_embedded = False

        def capture(self, module: nn.Module, args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> Any:
            return torch.fx.symbolic_trace(module)

        def module(self, artifact: Any) -> nn.Module | None:
            torch.set_num_threads(1 if threads != 1 else 2)
            return super().module(artifact)

    model, xs = _workload()
    try:
        with ctxreplay.capture_with(model, backend=ThreadsBackend(),
                                    verify="execute") as session:
            model(xs[0])
        report = session.finalize()
    finally:
        torch.set_num_threads(threads)
    [leak] = [f for f in report.failures if f.reason == "state_leak"]
    assert "num_threads" in leak.context["torch_global_state"]
    assert len(report.captures) == 1
