"""Observation's ``detach`` and dispatch's ``remove`` take their wrappers
out by one rule (``observation.wrapping``): a module whose ``forward`` is
still ctxreplay's gets back exactly what it held (stopped ctxreplay
wrappers under ours left out); a wrapper another tool set on top stays,
and ours under it only passes calls through.  Each case runs for both
kinds, and for each order of two of them on one model."""

from __future__ import annotations

import copy
import gc
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import ctxreplay
from ctxreplay.observation.modules import NO_FORWARD

KINDS = ("observe", "install")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.lin(x).relu()
        return out


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = x + b(x)
        return x


def _net() -> Net:
    torch.manual_seed(0)
    return Net().eval()


class Theirs:
    """Another tool's wrapper: set on top of whatever ``forward`` was."""

    def __init__(self, inner: Callable[..., Any]) -> None:
        self.inner = inner
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.inner(*args, **kwargs)


def own_forward(module: nn.Module) -> Callable[..., Any]:
    """A forward a user set on the instance before ctxreplay came."""
    def own(x: torch.Tensor) -> torch.Tensor:
        return Block.forward(module, x)  # type: ignore[arg-type]
    return own


@pytest.fixture(scope="module")
def report() -> ctxreplay.CaptureReport:
    net = _net()
    with ctxreplay.capture_with(net, targets="repeated", backend="export") as s:
        net(torch.rand(2, 8))
    out = s.finalize()
    assert out.ok, out.failures
    return out


def _wrap(kind: str, net: nn.Module, report: ctxreplay.CaptureReport) -> Callable[[], Any]:
    """Wrap ``net`` by ``kind``; returns what unwraps it."""
    if kind == "observe":
        return ctxreplay.capture_with(net, targets="repeated", backend="export").close
    return ctxreplay.install(net, report).remove


def _chain(net: nn.Module) -> dict[str, list[str]]:
    """Each module's instance ``forward``, link by link: another tool's
    (``theirs``), a user's own (``own``), ctxreplay's (``ctxreplay on`` /
    ``ctxreplay off``: only passing calls through)."""
    out = {}
    for name, m in net.named_modules():
        links = []
        fn: Any = m.__dict__.get("forward", NO_FORWARD)
        while fn is not NO_FORWARD:
            holder = getattr(fn, "__self__", None)
            if isinstance(fn, Theirs):
                links.append("theirs")
                fn = fn.inner
            elif getattr(type(holder), "ctxreplay_holder", False):
                links.append("ctxreplay off" if holder.off else "ctxreplay on")  # type: ignore[union-attr]
                fn = holder.prev  # type: ignore[union-attr]
            else:
                links.append("own" if getattr(fn, "__name__", "") == "own" else repr(fn))
                break
        if links:
            out[name] = links
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_a_wrapper_set_on_top_stays_and_ours_only_passes_through(
        kind: str, report: ctxreplay.CaptureReport) -> None:
    net = _net()
    x = torch.rand(2, 8)
    expected = net(x)
    net.blocks[1].forward = own_forward(net.blocks[1])
    unwrap = _wrap(kind, net, report)
    theirs = Theirs(net.blocks[0].forward)
    net.blocks[0].forward = theirs
    top = Theirs(net.forward)
    net.forward = top  # type: ignore[method-assign]
    unwrap()
    assert _chain(net) == {"": ["theirs", "ctxreplay off"],
                           "blocks.0": ["theirs", "ctxreplay off"],
                           "blocks.1": ["own"]}
    assert torch.equal(net(x), expected)
    assert theirs.calls == top.calls == 1


@pytest.mark.parametrize("under", KINDS)
@pytest.mark.parametrize("over", KINDS)
@pytest.mark.parametrize("first", ["under", "over"])
def test_two_wrappings_unwrapped_in_either_order_restore_exactly(
        under: str, over: str, first: str, report: ctxreplay.CaptureReport) -> None:
    net = _net()
    x = torch.rand(2, 8)
    expected = net(x)
    own = own_forward(net.blocks[1])
    net.blocks[1].forward = own
    unwraps = {"under": _wrap(under, net, report), "over": _wrap(over, net, report)}
    assert _chain(net)["blocks.0"] == ["ctxreplay on", "ctxreplay on"]
    unwraps[first]()
    if first == "under":  # the one on top still holds it: a pass-through in its chain
        assert _chain(net)["blocks.0"] == ["ctxreplay on", "ctxreplay off"]
    else:
        assert _chain(net)["blocks.0"] == ["ctxreplay on"]
    assert torch.equal(net(x), expected)
    unwraps["over" if first == "under" else "under"]()
    assert _chain(net) == {"blocks.1": ["own"]}
    assert net.blocks[1].__dict__["forward"] is own
    assert torch.equal(net(x), expected)


@pytest.mark.parametrize("kind", KINDS)
def test_a_copy_of_another_tools_wrapper_over_ours_runs_the_copys_forward(
        kind: str, report: ctxreplay.CaptureReport) -> None:
    net = _net()
    x = torch.rand(2, 8)
    expected = net(x)
    unwrap = _wrap(kind, net, report)
    net.blocks[0].forward = Theirs(net.blocks[0].forward)
    twin = copy.deepcopy(net)
    with torch.no_grad():
        twin.blocks[0].lin.weight.zero_()  # the copy's own weights, not the live ones
    assert torch.equal(twin.blocks[0](x), twin.blocks[0].lin.bias.relu().expand(2, 8))
    assert torch.equal(net(x), expected)
    unwrap()


def test_a_finalized_session_under_another_tool_passes_through_holding_no_module() -> None:
    net = _net()
    x = torch.rand(2, 8)
    expected = net(x)
    session = ctxreplay.capture_with(net, targets="repeated", backend="export")
    theirs = Theirs(net.blocks[0].forward)
    net.blocks[0].forward = theirs
    net(x)
    report = session.finalize()
    assert report.ok and sum(c.calls for c in report.captures) == 3
    assert torch.equal(net(x), expected) and theirs.calls == 2
    module = weakref.ref(net.blocks[0])  # the session still holds the wrapper under theirs
    del net, theirs
    gc.collect()
    assert module() is None, "the finalized session keeps the module alive"
    assert session.report is report


def test_install_on_a_session_closed_first_restores_exactly(
        report: ctxreplay.CaptureReport) -> None:
    net = _net()
    x = torch.rand(2, 8)
    expected = net(x)
    session = ctxreplay.capture_with(net, targets="repeated", backend="export")
    handle = ctxreplay.install(net, report)
    session.finalize()  # its wrappers stay under dispatch's, passing calls through
    assert torch.equal(net(x), expected)
    handle.remove()
    assert _chain(net) == {}
    assert torch.equal(net(x), expected)


def test_detach_restores_a_compiled_root_exactly() -> None:
    net = _net()
    compiled = torch.compile(net)  # an OptimizedModule: its forward is an instance attribute
    before = dict(compiled.__dict__)
    session = ctxreplay.capture_with(compiled, targets=["_orig_mod.blocks.0"], backend="export")
    assert compiled.__dict__["forward"] is not before["forward"]
    session.close()
    assert compiled.__dict__ == before
