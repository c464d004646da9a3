"""The traced unit is the observed unit: a member's own hooks stay out of its graph.

Observation wraps a member's ``forward``, so the live call it records is
``forward`` alone: ``nn.Module.__call__`` runs the member's forward
pre-hooks and hooks, and torch's global module hooks at the member's
level, around it.  A capture must hold that same unit -- ``install`` runs
the hooks around the dispatched program again -- while hooks of the
member's submodules ran inside the live forward and belong in the graph.

The oracle is independent of the code under test: the hooks record what
really ran (registered before the session, or while it is open), and eager
runs of the model -- ``member.forward`` alone, ``member(...)``, the whole
model -- give the truth.  For every case: the report is ok; the artifact run
on fresh inputs equals ``forward`` alone (and the hooks do change a call of
the member, so the comparison can tell); ``finalize()`` never calls a
member-level hook (no fake tensor ever reaches one); ``install`` gives the
model's eager outputs with every member's programs hit and each member-level
hook run exactly once per member call.
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


def _global(model: Net, seen: list[Any]) -> list[RemovableHandle]:
    """A global forward hook: at a block's level (the member's) it adds 1,
    at a Linear's (inside the member) it scales -- that part is traced."""

    def hook(m: nn.Module, args: tuple[Any, ...], out: Any) -> Any:
        if isinstance(m, Block):
            seen.append(out)
            return out + 1
        if type(m) is nn.Linear:
            return out * 2
        return None

    return [register_global_forward_hook(hook)]


def _global_pre(model: Net, seen: list[Any]) -> list[RemovableHandle]:
    def hook(m: nn.Module, args: tuple[Any, ...]) -> Any:
        if isinstance(m, Block):
            seen.append(args[0])
            return (args[0] * 2,)
        return None

    return [torch.nn.modules.module.register_module_forward_pre_hook(hook)]


def _submodule_too(model: Net, seen: list[Any]) -> list[RemovableHandle]:
    """A hook on each block's Linear (inside the live forward: it must stay in
    the graph and reproduce) beside one on the block itself."""

    def inner(m: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
        return out * 3

    return [b.lin.register_forward_hook(inner) for b in model.blocks] + \
        _post_adds(model, seen)


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
    Case("global-hook", _global),
    Case("global-pre-hook", _global_pre),
    Case("registered-in-session", _pre_scales, when="open"),
    Case("registered-after-the-call", _post_adds, when="called"),
    Case("submodule-hook-stays", _submodule_too),
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


def test_a_global_hook_on_every_module_never_gives_a_wrong_installed_model(
        hooks: list[RemovableHandle]) -> None:
    """A global hook that changes every module's tensor output, the program's
    too (dispatch calls it as a module): the report may say not ok, but
    finalize() never runs it at a member's level, and the installed model
    computes what the eager one does."""
    model, x, at_members = _net(), _x(), []

    def hook(m: nn.Module, args: tuple[Any, ...], out: Any) -> Any:
        if isinstance(m, Block):
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
    with ctxreplay.install(model, report), torch.no_grad():
        out = model(x)
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
