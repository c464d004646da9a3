"""User hooks: the traced unit is the observed unit, and no user hook runs in finalize.

Observation wraps a member's ``forward``, so the live call it records is
``forward`` alone: ``nn.Module.__call__`` runs the member's forward
pre-hooks and hooks, and torch's global module hooks at the member's
level, around it.  A capture holds that same unit -- ``install`` runs the
member's own hooks around the dispatched program again.  Hooks *inside*
the member (its submodules', torch's global ones at its submodules' level)
ran inside the live forward; ``finalize()`` runs none of them either (a
hook is the user's code: a recording hook would append a FakeTensor), so
the capture is traced without them, and only a comparison with live
outputs can show whether they changed what the call computed: at a level
that makes none the report is not ok (a ``hooks`` mismatch naming them),
at ``values`` it is ok exactly when they changed nothing, and the hint of a
value mismatch names them.  ``install`` never dispatches a call of a member
holding such hooks (the graph would skip them): it runs eagerly, counted as
``hooks``, and the hooks run exactly as in eager.

The oracle is independent of the code under test: the hooks record what
really ran (registered before the session, or while it is open), and eager
runs of the model -- ``member.forward`` alone, ``member(...)``, the whole
model -- give the truth.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import pytest
import torch
from metadata_check import finalize_checked
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils.hooks import RemovableHandle

import ctxreplay

DEPTH = 3
register_global_forward_hook = torch.nn.modules.module.register_module_forward_hook


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) + x


class LockedBlock(Block):
    """Holds a lock, so ``copy.deepcopy`` refuses it: capture works on the
    live module in place."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()


class Net(nn.Module):
    def __init__(self, block: type[Block] = Block) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([block() for _ in range(DEPTH)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def _net(block: type[Block] = Block) -> Net:
    torch.manual_seed(0)
    return Net(block).eval()


def _x(seed: int = 1) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.rand(3, 4)


#: registers a case's hooks on the model; what a member-level hook ran on is appended to
#: the list (the tensor it was given)
Register = Callable[[Net, list[Any]], list[RemovableHandle]]


def _pre_scales(model: Net, seen: list[Any]) -> list[RemovableHandle]:
    def hook(m: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        seen.append(args[0])
        return (args[0] * 2,)

    return [b.register_forward_pre_hook(hook) for b in model.blocks]


def _pre_scales_kwargs(model: Net, seen: list[Any]) -> list[RemovableHandle]:
    def hook(m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
             ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        seen.append(args[0])
        return (args[0] * 2,), kwargs

    return [b.register_forward_pre_hook(hook, with_kwargs=True) for b in model.blocks]


def _post_adds(model: Net, seen: list[Any]) -> list[RemovableHandle]:
    def hook(m: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
        seen.append(out)
        return out + 1

    return [b.register_forward_hook(hook) for b in model.blocks]


def _post_adds_kwargs(model: Net, seen: list[Any]) -> list[RemovableHandle]:
    def hook(m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
             out: torch.Tensor) -> torch.Tensor:
        seen.append(out)
        return out + 1

    return [b.register_forward_hook(hook, with_kwargs=True, always_call=True)
            for b in model.blocks]


@attrs.frozen
class Case:
    id: str
    register: Register
    #: "before": before capture_with; "open": in the session, before the call;
    #: "called": in the session, after the call
    when: str = "before"
    block: type[Block] = Block


CASES = [
    Case("pre-hook-scales", _pre_scales),
    Case("pre-hook-with-kwargs", _pre_scales_kwargs),
    Case("hook-adds", _post_adds),
    Case("hook-with-kwargs-always-call", _post_adds_kwargs),
    Case("registered-in-session", _pre_scales, when="open"),
    Case("registered-after-the-call", _post_adds, when="called"),
    Case("member-used-in-place", _post_adds, block=LockedBlock),
]


@pytest.fixture
def hooks() -> Iterator[list[RemovableHandle]]:
    """Handles removed after the test, whatever happens (a global hook would
    reach every later test)."""
    handles: list[RemovableHandle] = []
    yield handles
    for h in handles:
        h.remove()


def _session(model: nn.Module, **options: Any) -> ctxreplay.CaptureSession:
    return ctxreplay.capture_with(model, targets="repeated", backend="export",
                                  verify="execute", **options)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_the_capture_holds_forward_alone_and_install_runs_the_hooks_once(
        case: Case, hooks: list[RemovableHandle]) -> None:
    model, x, seen = _net(case.block), _x(), []
    if case.when == "before":
        hooks += case.register(model, seen)
    with _session(model) as session:
        if case.when == "open":
            hooks += case.register(model, seen)
        with torch.no_grad():
            model(x)
        if case.when == "called":
            hooks += case.register(model, seen)
    live = len(seen)
    report = finalize_checked(session)
    assert seen[live:] == [], "finalize() ran a member-level hook"
    assert report.ok, report.to_json()
    assert all(type(b) is case.block for b in model.blocks)

    (capture,) = report.captures
    member = model.get_submodule(capture.weights_from)
    t = _x(seed=2)
    with torch.no_grad():
        produced = capture.artifact.module()(t)
        alone = member.forward(t)
        called = member(t)
    torch.testing.assert_close(produced, alone, rtol=0, atol=0)
    assert not torch.allclose(called, alone), "the hooks change nothing: no test"

    with torch.no_grad():
        truth = model(x)
    before = len(seen)
    with ctxreplay.install(model, report) as handle, torch.no_grad():
        out = model(x)
    assert handle.stats().total_hits == DEPTH
    torch.testing.assert_close(out, truth, rtol=0, atol=0)
    assert len(seen) - before == DEPTH, "a member-level hook ran other than once per call"
    assert not any(isinstance(s, FakeTensor) for s in seen)


# -- hooks inside the member -------------------------------------------------------

#: registers hooks that run inside the members' forwards; every call of one
#: is appended to the list (the tensor it was given), whichever module it is at
Inner = Callable[[Net, list[Any]], list[RemovableHandle]]


def _records(model: Net, seen: list[Any]) -> list[RemovableHandle]:
    """A monitoring hook on each block's Linear: it records, returns None."""
    def hook(m: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> None:
        seen.append(out)

    return [b.lin.register_forward_hook(hook) for b in model.blocks]


def _scales(model: Net, seen: list[Any]) -> list[RemovableHandle]:
    def hook(m: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
        seen.append(out)
        return out * 3

    return [b.lin.register_forward_hook(hook) for b in model.blocks]


def _writes_in_place(model: Net, seen: list[Any]) -> list[RemovableHandle]:
    """Returns None, yet changes the output: it writes into it."""
    def hook(m: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> None:
        seen.append(out)
        out.mul_(2)

    return [b.lin.register_forward_hook(hook) for b in model.blocks]


def _pre_with_kwargs(model: Net, seen: list[Any]) -> list[RemovableHandle]:
    def hook(m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
             ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        seen.append(args[0])
        return (args[0] + 1,), kwargs

    return [b.lin.register_forward_pre_hook(hook, with_kwargs=True) for b in model.blocks]


def _global_records(model: Net, seen: list[Any]) -> list[RemovableHandle]:
    """A global forward hook recording every module's output (a profiler)."""
    def hook(m: nn.Module, args: tuple[Any, ...], out: Any) -> None:
        seen.append(out)

    return [register_global_forward_hook(hook)]


def _global_scales(model: Net, seen: list[Any]) -> list[RemovableHandle]:
    """A global hook: at a block's level (around the member) it adds 1, at a
    Linear's (inside it) it scales."""
    def hook(m: nn.Module, args: tuple[Any, ...], out: Any) -> Any:
        seen.append(out)
        if isinstance(m, Block):
            return out + 1
        return out * 2 if type(m) is nn.Linear else None

    return [register_global_forward_hook(hook)]


def _global_pre(model: Net, seen: list[Any]) -> list[RemovableHandle]:
    def hook(m: nn.Module, args: tuple[Any, ...]) -> Any:
        seen.append(args[0])
        return (args[0] * 2,) if type(m) is nn.Linear else None

    return [torch.nn.modules.module.register_module_forward_pre_hook(hook)]


def _full_backward(model: Net, seen: list[Any]) -> list[RemovableHandle]:
    """Backward hooks never fire in an inference call, yet a dispatched
    member's backward would skip them."""
    def hook(m: nn.Module, grad_in: Any, grad_out: Any) -> None:
        seen.append(grad_out)

    return [b.lin.register_full_backward_hook(hook) for b in model.blocks]


@attrs.frozen
class InnerCase:
    id: str
    register: Inner
    #: whether the hooks change what a member's call returns
    changes: bool


INNER = [
    InnerCase("submodule-hook-records", _records, False),
    InnerCase("submodule-hook-scales", _scales, True),
    InnerCase("submodule-hook-writes-in-place", _writes_in_place, True),
    InnerCase("submodule-pre-hook-with-kwargs", _pre_with_kwargs, True),
    InnerCase("global-hook-records", _global_records, False),
    InnerCase("global-hook-scales", _global_scales, True),
    InnerCase("global-pre-hook", _global_pre, True),
    InnerCase("full-backward-hook", _full_backward, False),
]


def _observed(model: Net, seen: list[Any], register: Inner, hooks: list[RemovableHandle],
              **options: Any) -> tuple[ctxreplay.CaptureReport, int]:
    """Hooks registered before the session, two calls observed, finalize:
    the report and how many hook calls finalize made."""
    hooks += register(model, seen)
    with ctxreplay.capture_with(model, targets="repeated", backend="export",
                                **options) as session, torch.no_grad():
        model(_x())
        model(_x(seed=3))
    live = len(seen)
    report = finalize_checked(session)
    return report, len(seen) - live


@pytest.mark.parametrize("case", INNER, ids=lambda c: c.id)
@pytest.mark.parametrize("verify", [None, "execute"])
def test_finalize_runs_no_hook_inside_a_member_and_says_it_could_not_compare(
        case: InnerCase, verify: str | None, hooks: list[RemovableHandle]) -> None:
    """Not one call of a user hook in finalize, at the default level or at
    ``execute`` (they ran once and 4 times, once with a FakeTensor).  The
    default compares a sample of live calls by value: ok exactly when the
    hooks change nothing, else a value mismatch whose hint names them.  At
    ``execute`` no live output is compared by value: nothing shows the hooks
    changed nothing, so the report is not ok, and says why."""
    model, seen = _net(), []
    options = {} if verify is None else {"verify": verify}
    report, in_finalize = _observed(model, seen, case.register, hooks, **options)
    assert in_finalize == 0, "finalize() ran a user hook"
    assert not any(isinstance(s, FakeTensor) for s in seen)
    if verify is None:
        assert report.ok is not case.changes, report.to_json()
        assert all("hook=" in (m.hint or "") for _, m in report.mismatches())
    else:
        assert not report.ok
        found = [m for _, m in report.mismatches() if m.field == "hooks"]
        assert found and all("hook[" in m.live for m in found), found
        assert all("hook=" in (m.hint or "") for m in found), found


@pytest.mark.parametrize("case", INNER, ids=lambda c: c.id)
def test_compared_by_value_the_report_is_ok_exactly_when_the_hooks_change_nothing(
        case: InnerCase, hooks: list[RemovableHandle]) -> None:
    model, seen = _net(), []
    report, in_finalize = _observed(model, seen, case.register, hooks, verify="values")
    assert in_finalize == 0
    if not case.changes:
        assert report.ok, report.to_json()
        return
    assert not report.ok
    differ = [m for _, m in report.mismatches() if m.level == "values"]
    assert differ, report.to_json()
    assert all("hook=" in (m.hint or "") for m in differ), differ


@pytest.mark.parametrize("case", INNER, ids=lambda c: c.id)
def test_install_runs_a_member_holding_hooks_eagerly_and_its_hooks_as_eager_does(
        case: InnerCase, hooks: list[RemovableHandle]) -> None:
    """Captured without the hooks (so the report is ok), then hooks
    registered: every member call runs eagerly (``hooks``), with the same
    hook calls, on the same values, as the eager model makes (6: 3 blocks, 2
    calls) -- not 0 -- and the same outputs."""
    model = _net()
    with ctxreplay.capture_with(model, targets="repeated", backend="export",
                                verify="values") as session, torch.no_grad():
        model(_x())
    report = finalize_checked(session)
    assert report.ok, report.to_json()
    eager: list[Any] = []
    handles = case.register(model, eager)
    hooks += handles
    with torch.no_grad():
        truth = [model(_x()), model(_x(seed=3))]
    installed: list[Any] = []
    for h in handles:
        h.remove()
    hooks += case.register(model, installed)
    with ctxreplay.install(model, report) as handle, torch.no_grad():
        out = [model(_x()), model(_x(seed=3))]
        stats = handle.stats()
    assert stats.total_hits == 0 and stats.reasons == {"hooks": 2 * DEPTH}, stats
    for a, b in zip(out, truth):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert len(installed) == len(eager)
    for a, b in zip(installed, eager):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_member_whose_hooks_are_removed_is_dispatched_again(
        hooks: list[RemovableHandle]) -> None:
    model, seen = _net(), []
    report, _ = _observed(model, seen, _records, hooks, verify="values")
    assert report.ok
    with ctxreplay.install(model, report) as handle, torch.no_grad():
        model(_x())
        assert handle.stats().reasons == {"hooks": DEPTH}
        hooks.pop(0).remove()  # block 0's
        model(_x())
        stats = handle.stats()
    assert stats.total_hits == 1 and stats.reasons == {"hooks": 2 * DEPTH - 1}


def test_a_global_hook_on_every_module_never_gives_a_wrong_installed_model(
        hooks: list[RemovableHandle]) -> None:
    """A global hook that changes every module's tensor output, the program's
    too (a check runs it as a module): the report is not ok, finalize() never
    runs it anywhere, and the installed model computes what the eager one
    does, every member running eagerly."""
    model, x, at_members = _net(), _x(), []

    def hook(m: nn.Module, args: tuple[Any, ...], out: Any) -> Any:
        at_members.append(out)
        return out + 1 if isinstance(out, torch.Tensor) else None

    hooks.append(register_global_forward_hook(hook))
    with torch.no_grad():
        truth = model(x)
    with _session(model) as session, torch.no_grad():
        model(x)
    live = len(at_members)
    report = finalize_checked(session)
    assert at_members[live:] == []
    assert not report.ok
    with ctxreplay.install(model, report) as handle, torch.no_grad():
        out = model(x)
        assert handle.stats().total_hits == 0
    torch.testing.assert_close(out, truth, rtol=0, atol=0)
    assert not any(isinstance(s, FakeTensor) for s in at_members)


class WaitingBlock(Block):
    """Waits in a traced forward (fake inputs) until ``release`` is set; its
    event makes ``copy.deepcopy`` refuse it, so the isolated view shares the
    event (the same one ``release.set()`` sets) and copies the rest."""

    release = threading.Event()

    def __init__(self) -> None:
        super().__init__()
        self.event = WaitingBlock.release

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, FakeTensor):
            self.event.wait(60)
        return super().forward(x)


def test_a_trace_abandoned_on_timeout_never_runs_the_hooks_of_the_member_it_holds(
        hooks: list[RemovableHandle]) -> None:
    """The abandoned trace (on a view sharing the member's event) goes on
    once released: it never runs the member's hooks, and the
    member is the user's again -- class and hooks -- once it is done."""
    model, x, seen = _net(WaitingBlock), _x(), []
    hooks += _pre_scales(model, seen)
    with torch.no_grad():
        truth = model(x)
    WaitingBlock.release.clear()
    try:
        with _session(model, capture_timeout=0.5) as session, torch.no_grad():
            model(x)
        report = session.finalize()
        assert not report.ok and report.failures[0].reason == "timeout"
    finally:
        WaitingBlock.release.set()
        for t in threading.enumerate():
            if t.name == "ctxreplay-capture":
                t.join(30)
    assert not any(isinstance(s, FakeTensor) for s in seen)
    assert all(type(b) is WaitingBlock for b in model.blocks)
    before = len(seen)
    with torch.no_grad():
        out = model(x)
    torch.testing.assert_close(out, truth, rtol=0, atol=0)
    assert len(seen) - before == DEPTH
