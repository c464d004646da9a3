"""Failures are contained: a raising probe or backend never disturbs the live
forward, never costs the other variants, never leaks global state, and is
reported by code -- never by its message -- in a metadata-only report."""

from __future__ import annotations

import gc
import json
import logging
import subprocess
import sys
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import pytest
import torch
from capability import FOLDS
from engine_models import BF16, MatmulBlock, bf16, matmul_dtypes
from metadata_check import MetadataViolation, assert_metadata_only, finalize_checked
from torch._C._dynamo.guards import GlobalStateGuard

import ctxreplay
from ctxreplay.backends import ExportBackend
from ctxreplay.engine import capturing
from ctxreplay.testing import global_state

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

SENTINEL = "SENTINEL-5f0c1d-secret-prompt-text"


class Boom(Exception):
    pass


_MODE = {"state": "good"}


@contextmanager
def _mode(state: str) -> Iterator[None]:
    before = _MODE["state"]
    _MODE["state"] = state
    try:
        yield
    finally:
        _MODE["state"] = before


def _inputs() -> list[torch.Tensor]:
    torch.manual_seed(3)
    return [torch.rand(4, 16), torch.rand(2, 16)]


def _run(model: torch.nn.Module, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Two good variants and one 'bad' one, in the middle."""
    outs = [model(xs[0])]
    with _mode("bad"), bf16():
        outs.append(model(xs[0]))
    outs.append(model(xs[1]))
    return outs


def _assert_undisturbed(model: torch.nn.Module, xs: list[torch.Tensor],
                        observed: list[torch.Tensor]) -> None:
    bare = _run(model, xs)
    for a, b in zip(bare, observed, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


def _assert_clean(guard: GlobalStateGuard, before: Any, report: ctxreplay.CaptureReport) -> None:
    gc.collect()  # an abandoned replay context would restore "its" state now
    assert guard.check(), guard.reason()
    assert global_state() == before
    assert "state_leak" not in {f.reason for f in report.failures}
    assert SENTINEL not in json.dumps(report.to_json())


# -- a probe whose observe() raises ------------------------------------------------

class ObserveBoom(ctxreplay.probes.ContextProbe[str]):
    name = "test_observe_boom"

    def observe(self) -> str:
        if _MODE["state"] == "bad":
            raise Boom(SENTINEL)
        return _MODE["state"]

    def replay(self, state: str) -> AbstractContextManager[None]:
        return _mode(state)


def test_a_probe_whose_observe_raises() -> None:
    model, xs = MatmulBlock(), _inputs()
    guard, before = GlobalStateGuard(), global_state()
    with ctxreplay.capture_with(model, probes=["autocast", ObserveBoom()],
                                backend="export") as s:
        observed = _run(model, xs)
        with _mode("bad"):
            observed.append(model(xs[1]))
    report = finalize_checked(s, sentinels=[SENTINEL])
    _assert_undisturbed(model, xs, observed[:3])
    # the failing calls ran but were not recorded; the others were captured
    # (batch 4 and 2 under one context: one graph folded over both sizes, or
    # one each where ctxreplay does not fold)
    shapes = [tuple(c.signature.args[0].shape) for c in report.captures]  # type: ignore[union-attr]
    if FOLDS:
        [capture] = report.captures
        assert shapes == [(4, 16)]
        assert capture.folding is not None and capture.folded == (1,)
        assert [r.low for r in capture.folding.ranges] == [2]
    else:
        assert shapes == [(4, 16), (2, 16)]
        assert all(c.folding is None and c.folded == () for c in report.captures)
    assert report.failures == ()
    assert report.observation_errors == (("observe", "Boom", 2),)
    # what was captured is faithful, but two calls are covered by no capture
    assert all(c.fidelity.ok for c in report.captures)
    assert not report.ok
    [problem] = report.problems
    assert (problem.reason, problem.calls) == ("observation_error", 2)
    _assert_clean(guard, before, report)


# -- a probe whose replay raises ------------------------------------------------------

class ReplayBoom(ctxreplay.probes.ContextProbe[str]):
    """Raises for the 'bad' state: when replay() is called, when its context is
    entered, or when it exits.  Traceable ones are entered inside the traced
    callable, the others around the capture."""

    name = "test_replay_boom"

    def __init__(self, traceable: bool, when: str) -> None:
        self._traceable = traceable
        self.when = when

    @property
    def traceable(self) -> bool:  # type: ignore[override]
        return self._traceable

    def observe(self) -> str:
        return _MODE["state"]

    def replay(self, state: str) -> AbstractContextManager[None]:
        if state == "bad" and self.when == "call":
            raise Boom(SENTINEL)
        return self._replay(state)

    @contextmanager
    def _replay(self, state: str) -> Iterator[None]:
        if state == "bad" and self.when == "enter":
            raise Boom(SENTINEL)
        with _mode(state):
            yield
        if state == "bad" and self.when == "exit":
            raise Boom(SENTINEL)


@pytest.mark.parametrize("when", ["call", "enter", "exit"])
@pytest.mark.parametrize("traceable", [True, False], ids=["inside", "around"])
def test_a_probe_whose_replay_raises(traceable: bool, when: str) -> None:
    model, xs = MatmulBlock(), _inputs()
    guard, before = GlobalStateGuard(), global_state()
    # autocast is replayed beside it (and sorts first): its context is entered
    # before the failing one and must be unwound with it
    with ctxreplay.capture_with(model, probes=["autocast", "grad_mode",
                                               ReplayBoom(traceable, when)],
                                backend="export") as s:
        observed = _run(model, xs)
    _assert_undisturbed(model, xs, observed)
    report = finalize_checked(s, sentinels=[SENTINEL])
    # variants 0 and 2 differ in the batch size only: one graph folded over
    # both, or one each where ctxreplay does not fold
    assert [(c.variant, c.folded) for c in report.captures] == (
        [(0, (2,))] if FOLDS else [(0, ()), (2, ())])
    (f,) = report.failures
    assert (f.variant, f.reason, f.exc_type) == (1, "replay_failed", "Boom")
    assert f.context["test_replay_boom"] == repr("bad")
    assert all(c.fidelity.ok for c in report.captures)
    assert _MODE["state"] == "good"
    _assert_clean(guard, before, report)


# -- a backend that raises ---------------------------------------------------------------

class FlakyBackend:
    """Fails on batch size 2 with a message that must never reach the report."""

    name = "flaky"

    def __init__(self) -> None:
        self.inner = ExportBackend()

    def capture(self, module: torch.nn.Module, args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> Any:
        if args[0].shape[0] == 2:
            raise Boom(SENTINEL)
        return self.inner.capture(module, args, kwargs)

    def output_spec(self, artifact: Any, args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> Any:
        return self.inner.output_spec(artifact, args, kwargs)


def test_a_backend_that_raises() -> None:
    model, xs = MatmulBlock(), _inputs()
    guard, before = GlobalStateGuard(), global_state()
    with ctxreplay.capture_with(model, backend=FlakyBackend()) as s:
        observed = _run(model, xs)
    _assert_undisturbed(model, xs, observed)
    report = finalize_checked(s, sentinels=[SENTINEL])
    assert [c.variant for c in report.captures] == [0, 1]
    assert matmul_dtypes(report.captures[1]) == {BF16}  # the bf16 variant still faithful
    (f,) = report.failures
    assert (f.variant, f.backend, f.reason, f.exc_type) == (2, "flaky", "trace_error", "Boom")
    _assert_clean(guard, before, report)
    # what finalize(strict=True) would raise lists the failure
    assert "trace_error" in str(ctxreplay.FidelityError(report))


class BackendReturningNothing:
    name = "nothing"

    def capture(self, module: torch.nn.Module, args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> Any:
        return None


def test_a_backend_that_returns_no_artifact_fails_that_variant() -> None:
    model = MatmulBlock()
    with ctxreplay.capture_with(model, backend=BackendReturningNothing()) as s:
        model(torch.rand(4, 16))
    report = finalize_checked(s)
    assert report.captures == ()
    (f,) = report.failures
    assert (f.backend, f.reason) == ("nothing", "no_artifact")


def test_an_internal_error_is_a_reason_code_and_its_traceback_a_debug_log(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def broken(ask: Any, tracing: Any) -> Any:
        raise RuntimeError("boom")

    monkeypatch.setattr(capturing, "capture_variant", broken)
    model = MatmulBlock()
    with ctxreplay.capture_with(model, backend="export", cache=False) as s:
        model(torch.rand(4, 16))
    with caplog.at_level(logging.DEBUG, logger="ctxreplay"):
        report = finalize_checked(s)
    (f,) = report.failures
    assert (f.reason, f.exc_type) == ("internal_error", "RuntimeError")
    assert "boom" not in json.dumps(report.to_json())  # the report keeps no message
    logged = [r for r in caplog.records if r.name == "ctxreplay" and r.exc_info]
    assert len(logged) == 1 and logged[0].levelno == logging.DEBUG
    assert "internal_error" in logged[0].getMessage()
    exc_info = logged[0].exc_info
    assert exc_info is not None and isinstance(exc_info[1], RuntimeError)
    assert str(exc_info[1]) == "boom"
    assert "in broken" in caplog.text  # the traceback itself, down to the raise


# -- a probe that raises in clear() and one that cannot be described --------------

class ClearBoom(ctxreplay.probes.ContextProbe[str]):
    name = "test_clear_boom"

    def observe(self) -> str:
        return "x"

    def replay(self, state: str) -> AbstractContextManager[None]:
        return nullcontext()

    def clear(self) -> None:
        raise Boom(SENTINEL)

    def describe(self, state: str) -> str:
        raise Boom(SENTINEL)


def test_a_probe_whose_clear_and_describe_raise() -> None:
    model = MatmulBlock()
    with ctxreplay.capture_with(model, probes=["autocast", ClearBoom()],
                                backend="export") as s:
        model(torch.rand(4, 16))
    report = finalize_checked(s, sentinels=[SENTINEL])
    assert len(report.captures) == 1 and report.ok
    assert ("clear", "Boom", 1) in report.observation_errors
    assert report.captures[0].snapshot.describe()["test_clear_boom"].startswith("<")


# -- 12. the metadata oracle itself can fail ----------------------------------------------

def _good_doc() -> dict[str, Any]:
    model = MatmulBlock()
    # (signature: one mismatch, the hint's; the levels above add their own)
    with ctxreplay.capture_with(model, backend="export", replay="off",
                                verify="signature") as s, bf16():
        model(torch.rand(4, 16))
    return finalize_checked(s).to_json()


@pytest.mark.parametrize(("where", "bad"), [
    ("settings", {"note": "x" * 201}),
    ("settings", {"note": "line one\nline two"}),
    ("settings", {"error": "expected a tensor of shape 4 but got something else"}),
    ("settings", {"value": [0.25, 0.5, 0.75]}),
    ("settings", {"weights": [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]}),
    ("settings", {"trace": 'File "model.py", line 3'}),
    ("settings", {"x": float("nan")}),
    ("settings", {"x": object()}),
    ("settings", {"sentinel": SENTINEL}),
])
def test_the_metadata_checker_rejects_non_metadata(where: str, bad: dict[str, Any]) -> None:
    doc = _good_doc()
    assert_metadata_only(doc, sentinels=[SENTINEL])
    doc[where] = {**doc[where], **bad}
    with pytest.raises(MetadataViolation):
        assert_metadata_only(doc, sentinels=[SENTINEL])


def test_the_metadata_checker_accepts_the_library_hint_only_under_its_key() -> None:
    doc = _good_doc()
    (m,) = doc["captures"][0]["fidelity"]["mismatches"]
    assert m["hint"].startswith("not carried by the artifact:")
    assert_metadata_only(doc)
    doc["settings"] = {**doc["settings"], "note": m["hint"]}
    with pytest.raises(MetadataViolation, match="prose"):
        assert_metadata_only(doc)


def test_a_single_process_finalize_never_imports_the_distributed_machinery() -> None:
    # the one-rank exchange and the records the ranks share sit below it
    code = ("import sys, torch, ctxreplay\n"
            "m = torch.nn.Linear(4, 4)\n"
            "with ctxreplay.capture_with(m) as s:\n"
            "    m(torch.rand(2, 4))\n"
            "assert s.finalize().ok\n"
            "print(sorted(n for n in sys.modules if n.startswith('ctxreplay.distributed')))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
