"""Observation: what the live forward really ran is what the
report counts and what ``finalize()`` leaves of the user's.

* Another tool setting a member's ``forward`` anew mid-session (accelerate's
  ``remove_hook_from_module``, a user's ``block.forward = ...``): the later
  calls are still observed, and the calls recorded under the forward that
  capture no longer sees are ``observation_lost``, naming the member.  A tool
  that wraps on top of ctxreplay's wrapper is not observed twice.
* A call that raised in the user's forward (the caller handled it) is a
  ``call_raised`` notice, not a variant and not a call.
* A block that ``copy.deepcopy`` refuses (it holds a ``threading.Lock``) is
  captured on a view that shares only the lock: the user's list is never
  appended to; a block no view can be made of fails ``isolation_failed``
  without being run; a second session open on the blocks does not count the
  calls another session's ``finalize()`` makes.

The oracle is the test's own: forward hooks registered before the session
record every real call (``trust_oracle.record``, which sees calls through
``nn.Module.__call__`` whatever ``forward`` holds) and each one is replayed
through the capture that claims it; the user's lists are compared before
and after ``finalize()``.
"""

from __future__ import annotations

import copy
import threading
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from metadata_check import finalize_checked
from torch import nn
from trust_oracle import record, unreproduced

import ctxreplay
import ctxreplay.observation.attach as attach_module
import ctxreplay.observation.wrapper as wrapper_module
import ctxreplay.observation.wrapping as wrapping_module

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

DIM = 8


def _accelerate() -> Any:
    """accelerate's hooks module (an optional test dependency: skipped without it)."""
    return pytest.importorskip("accelerate.hooks")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x))


class Net(nn.Module):
    def __init__(self, block: type[nn.Module] = Block, n: int = 2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(block() for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


MEMBERS = ["blocks.0", "blocks.1"]


def _run(model: nn.Module, *rows: int) -> None:
    with torch.no_grad():
        for n in rows:
            model(torch.rand(n, DIM))


def _lost(report: ctxreplay.CaptureReport) -> ctxreplay.Problem:
    (p,) = [p for p in report.problems if p.reason == "observation_lost"]
    return p


def _calls(report: ctxreplay.CaptureReport) -> int:
    return sum(c.calls for c in report.captures)


# -- case 6: a forward set anew by another tool ------------------------------------------

def test_accelerate_removing_its_hook_mid_session_is_rewrapped_and_named() -> None:
    hooks = _accelerate()
    model = Net()
    for b in model.blocks:
        hooks.add_hook_to_module(b, hooks.ModelHook())
    saved = [b._old_forward for b in model.blocks]
    with record(model, MEMBERS) as calls:
        with ctxreplay.capture_with(model, targets="repeated") as session:
            _run(model, 2)
            for b in model.blocks:
                hooks.remove_hook_from_module(b)  # module.forward = the forward it saved
            _run(model, 3, 4)
        report = finalize_checked(session)
    assert len(calls) == 6
    # every call observed (before the fix: the two before the removal only): those
    # after it captured, those before it a failure naming the forward they ran ...
    assert _calls(report) == 4, [(c.variant, c.calls) for c in report.captures]
    (failed,) = report.failures
    assert failed.reason == "state_not_restorable" and "forward" in failed.message
    # ... those after it reproduced by value ...
    assert unreproduced(report, calls[2:]) == []
    # ... and those before it ran accelerate's hook, which capture no longer sees
    assert not report.ok
    p = _lost(report)
    assert p.names == ("blocks.0", "blocks.1") and p.calls == 2 and not p.exact
    assert "remove_hook_from_module" in p.message
    # the model holds exactly what accelerate left
    assert [b.__dict__.get("forward") for b in model.blocks] == saved
    assert all(b.__dict__["forward"] is s for b, s in zip(model.blocks, saved))


def test_a_forward_set_anew_before_any_call_is_observed_and_ok() -> None:
    hooks = _accelerate()
    model = Net()
    for b in model.blocks:
        hooks.add_hook_to_module(b, hooks.ModelHook())
    with record(model, MEMBERS) as calls:
        with ctxreplay.capture_with(model, targets="repeated") as session:
            for b in model.blocks:
                hooks.remove_hook_from_module(b)
            _run(model, 2, 3, 2)
        report = finalize_checked(session, strict=True)
    assert report.ok and report.problems == ()
    assert _calls(report) == len(calls) == 6
    assert unreproduced(report, calls) == []


def test_a_forward_set_anew_inside_a_model_call_is_never_a_silent_ok() -> None:
    hooks = _accelerate()
    model = Net()
    hooks.add_hook_to_module(model.blocks[1], hooks.ModelHook())

    def remove_later_hook(*_: Any) -> None:  # a user hook on blocks.0 removes it
        if hasattr(model.blocks[1], "_hf_hook"):
            hooks.remove_hook_from_module(model.blocks[1])

    handle = model.blocks[0].register_forward_hook(remove_later_hook)
    with record(model, MEMBERS) as calls:
        with ctxreplay.capture_with(model, targets="repeated") as session:
            _run(model, 2, 3)
        report = finalize_checked(session)
    handle.remove()
    # blocks.1's first call ran unobserved: its forward was set anew inside
    # that model call, before it ran
    assert len(calls) == 4 and _calls(report) == 3
    assert not report.ok
    p = _lost(report)
    assert p.names == ("blocks.1",) and not p.exact
    assert unreproduced(report, [c for c in calls if c.args[0].shape[0] == 3]) == []


def _calling(inner: Any) -> Any:
    def forward(x: torch.Tensor) -> Any:
        return inner(x)
    return forward


def _chained_session(model: Net) -> tuple[ctxreplay.CaptureReport, list[Any]]:
    # each size its own capture (fold=False): the oracle tells the forwards
    # apart by the sizes each ran at, not by the identity install holds to
    hooks = _accelerate()
    with record(model, MEMBERS) as calls:
        with ctxreplay.capture_with(model, targets="repeated", fold=False) as session:
            _run(model, 2)
            for b in model.blocks:  # wraps ours: its __wrapped__ is our wrapper
                hooks.add_hook_to_module(b, hooks.ModelHook())
            _run(model, 3)
            for b in model.blocks:  # puts ours back
                hooks.remove_hook_from_module(b)
            _run(model, 4)
            saved = [b.forward for b in model.blocks]
            for b in model.blocks:  # a user's wrapper holding ours in a closure
                b.forward = _calling(b.forward)
            _run(model, 2, 5)
            for b, f in zip(model.blocks, saved):  # and put back
                b.forward = f
            _run(model, 3)
        report = finalize_checked(session)
    return report, calls


def test_a_tool_wrapping_on_top_of_ours_is_neither_lost_nor_counted_twice(
        monkeypatch: pytest.MonkeyPatch) -> None:
    report, calls = _chained_session(Net())
    assert len(calls) == 12
    assert report.ok, report.problems
    assert _calls(report) == 12
    assert unreproduced(report, calls) == []
    # the oracle sees it: taking every chain for a forward set anew says the
    # calls were lost, though each one was observed
    monkeypatch.setattr(attach_module, "reaches", lambda fn, wrapper: False)
    monkeypatch.setattr(wrapping_module, "reaches", lambda fn, wrapper: False)
    naive, _ = _chained_session(Net())
    assert not naive.ok and _lost(naive).calls > 0


def doubled(self: Block, x: torch.Tensor) -> torch.Tensor:
    return 2 * torch.relu(self.lin(x))


def test_a_user_forward_assigned_mid_session_counts_the_calls_it_hides() -> None:
    model = Net()
    with record(model, MEMBERS) as calls:
        # fold=False: as in ``_chained_session``
        with ctxreplay.capture_with(model, targets="repeated", fold=False) as session:
            _run(model, 2)
            model.blocks[0].forward = types.MethodType(doubled, model.blocks[0])
            _run(model, 3, 4)
        report = finalize_checked(session)
    assert _calls(report) == len(calls) == 6
    # the calls after the assignment ran the new forward on blocks.0 and the
    # class's on blocks.1: they no longer share a capture, and the first
    # calls' capture is traced from blocks.1, which still runs the class's
    assert unreproduced(report, calls) == []
    (first,) = [c for c in report.captures if c.members == ("blocks.1", "blocks.0")]
    assert first.weights_from == "blocks.1" and first.calls == 2
    # what blocks.0 ran before is no forward of it any more: not ok, named
    assert not report.ok
    p = _lost(report)
    assert (p.names, p.calls) == (("blocks.0",), 1)


def test_a_forward_assigned_after_the_last_call_is_counted_at_finalize() -> None:
    model = Net()
    with ctxreplay.capture_with(model, targets="repeated") as session:
        _run(model, 2, 2)
        model.blocks[0].forward = types.MethodType(doubled, model.blocks[0])
    report = finalize_checked(session)
    assert not report.ok
    p = _lost(report)
    assert (p.names, p.calls) == (("blocks.0",), 2)


def test_the_model_own_forward_set_anew_mid_session_is_never_a_silent_ok() -> None:
    # the model given to capture_with is the member: with its forward set
    # anew (to the same function), no wrapper of ctxreplay sees its calls
    model = Block()
    with record(model, [""]) as calls:
        with ctxreplay.capture_with(model) as session:
            _run(model, 2)
            model.forward = types.MethodType(Block.forward, model)
            _run(model, 2, 3)
        report = finalize_checked(session)
    assert len(calls) == 3 and _calls(report) == 1
    assert not report.ok and _lost(report).names == ("Block",)


def test_a_session_finalized_inside_a_model_call_never_wraps_again() -> None:
    model = Net()
    session = ctxreplay.capture_with(model, targets="repeated")
    reports: list[ctxreplay.CaptureReport] = []

    def finalize_now(*_: Any) -> None:
        if not reports:
            reports.append(session.finalize())

    handle = model.blocks[0].register_forward_hook(finalize_now)
    _run(model, 2)
    handle.remove()
    assert reports and reports[0].captures
    # detach put back every forward; the end of the model call wrapped nothing
    assert all("forward" not in m.__dict__ for m in model.modules())


# -- case 10: a call that raised ---------------------------------------------------------

_RAISE = {"on": False}


class Flaky(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _RAISE["on"] or x.shape[0] == 7:
            raise ValueError("refused")
        return super().forward(x)


@pytest.fixture
def flaky() -> Iterator[None]:
    yield
    _RAISE["on"] = False


def test_a_call_that_raised_is_a_notice_not_a_variant_nor_a_call(flaky: None) -> None:
    model = Flaky()
    returned: list[int] = []
    model.register_forward_hook(lambda m, a, out: returned.append(a[0].shape[0]))
    with record(model, [""]) as calls, ctxreplay.capture_with(model) as session, \
            torch.no_grad():
        for _ in range(3):
            model(torch.rand(2, DIM))  # completes: its memo answers the next calls
        _RAISE["on"] = True
        with pytest.raises(ValueError):
            model(torch.rand(2, DIM))  # raised in a memo hit
        _RAISE["on"] = False
        for _ in range(2):
            with pytest.raises(ValueError):
                model(torch.rand(7, DIM))  # a shape whose every call raises
        model(torch.rand(2, DIM))
    report = finalize_checked(session, strict=True)
    assert returned == [2, 2, 2, 2]
    assert report.ok and report.problems == () and report.failures == ()
    (c,) = report.captures
    assert c.calls == len(returned) == 4
    assert [n for n in report.notices if n.reason == "call_raised"] == [
        ctxreplay.Notice("call_raised", "Flaky", None, 3, ("Flaky",))]
    assert unreproduced(report, calls) == []


# -- case 12: isolation without deep copies -----------------------------------------------

class Locked(Block):
    """Holds a lock (``copy.deepcopy`` refuses it) and appends to a list."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()
        self.log: list[str] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.lock:
            self.log.append(type(x).__name__)
        return super().forward(x)


def _user_state(model: Net) -> list[tuple[Any, ...]]:
    return [(b.lock, b.log, list(b.log)) for b in model.blocks]


def _unchanged(model: Net, before: list[tuple[Any, ...]]) -> None:
    for b, (lock, log, items) in zip(model.blocks, before):
        assert b.lock is lock and b.log is log
        assert b.log == items, b.log  # nothing appended by capture or checks
        assert lock.acquire(blocking=False)
        lock.release()


@pytest.mark.parametrize("verify", ["signature", "execute"])
def test_a_block_holding_a_lock_is_captured_on_a_view_sharing_only_the_lock(
        verify: str) -> None:
    model = Net(Locked)
    with pytest.raises(TypeError):  # what made capture run on the live module
        copy.deepcopy(model.blocks[0])
    with record(model, MEMBERS) as calls:
        with ctxreplay.capture_with(model, targets="repeated", verify=verify,
                                    ignore_attributes=["log"]) as session:
            _run(model, 2, 3)
        before = _user_state(model)
        assert [b.log for b in model.blocks] == [["Tensor", "Tensor"]] * 2
        report = finalize_checked(session, strict=True)
    _unchanged(model, before)
    assert report.ok and _calls(report) == len(calls) == 4
    assert unreproduced(report, calls) == []


class Sealed:
    """An object that refuses every copy."""

    def __init__(self) -> None:
        self.items: list[int] = []

    def __deepcopy__(self, memo: dict[int, Any]) -> Sealed:
        raise TypeError("Sealed objects cannot be copied")


class Unisolable(Block):
    def __init__(self) -> None:
        super().__init__()
        self.sealed = Sealed()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.sealed.items.append(x.shape[0])
        return super().forward(x)


def test_a_block_no_view_can_be_made_of_is_refused_not_run() -> None:
    model = Net(Unisolable, n=1)
    with ctxreplay.capture_with(model, targets=["blocks.0"], verify="execute") as session:
        _run(model, 2)
    items = model.blocks[0].sealed.items
    assert items == [2]
    report = session.finalize()
    assert model.blocks[0].sealed.items is items and items == [2]  # never run by finalize
    assert not report.ok and report.captures == ()
    (f,) = report.failures
    assert f.reason == "isolation_failed" and "Unisolable" in f.message


def _nested(model: Net, verify: str, inner_first: bool
            ) -> tuple[ctxreplay.CaptureReport, ctxreplay.CaptureReport, list[tuple[Any, ...]]]:
    with ctxreplay.capture_with(model, targets="repeated", verify=verify,
                                ignore_attributes=["log"]) as outer:
        with ctxreplay.capture_with(model, targets="repeated", verify=verify,
                                    ignore_attributes=["log"]) as inner:
            _run(model, 2, 2)
            before = _user_state(model)
            if not inner_first:  # the outer finalize() runs while inner observes
                outer_report = finalize_checked(outer)
        inner_report = finalize_checked(inner)
    if inner_first:
        outer_report = finalize_checked(outer)
    return outer_report, inner_report, before


@pytest.mark.parametrize("inner_first", [True, False])
def test_nested_sessions_on_lock_holding_blocks_count_only_the_user_calls(
        inner_first: bool) -> None:
    model = Net(Locked)
    with record(model, MEMBERS) as calls:
        outer, inner, before = _nested(model, "execute", inner_first)
    _unchanged(model, before)
    assert [b.log for b in model.blocks] == [["Tensor", "Tensor"]] * 2
    for r in (outer, inner):
        assert r.ok and _calls(r) == len(calls) == 4, [(c.members, c.calls) for c in r.captures]
        assert unreproduced(r, calls) == []


class Caller(Block):
    """Calls a module it reaches through a function it holds (``deepcopy``
    keeps functions as they are, so its view calls the live module)."""

    def __init__(self, helper: nn.Module) -> None:
        super().__init__()
        self.call_helper = lambda x: helper(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(self.call_helper(x))


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.helper = Block()
        self.caller = Caller(self.helper)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.caller(x)
        return out


def _helper_calls_seen_by_outer() -> tuple[int, int]:
    model = Pair()
    with record(model, ["helper"]) as calls:
        with ctxreplay.capture_with(model, targets=["helper"]) as outer:
            with ctxreplay.capture_with(model, targets=["caller"], verify="execute") as inner:
                _run(model, 2, 2)
            user = len(calls)
            inner.finalize()  # runs the caller's view, which calls the live helper
        report = outer.finalize()
    return user, _calls(report)


def test_a_session_does_not_count_calls_another_sessions_finalize_makes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    user, counted = _helper_calls_seen_by_outer()
    assert counted == user == 2
    # the oracle sees it: without the ``isolating()`` check the outer session
    # counts the inner finalize's execution of the live helper as live calls
    monkeypatch.setattr(wrapper_module, "isolating", lambda: False)
    user, counted = _helper_calls_seen_by_outer()
    assert counted > user == 2
