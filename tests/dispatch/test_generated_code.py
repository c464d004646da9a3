"""The flat program a dispatched call runs is generated source a maintainer
can read in a traceback, and it leans on no torch internal the installed
torch is not known to have: where one does not hold (a ``CAPS`` field false),
the program takes torch's own path or is not flattened, and answers alike."""

from __future__ import annotations

import dataclasses
import traceback
from typing import Any

import pytest
import torch
from torch import nn

import ctxreplay
from ctxreplay.dispatch import flat as flat_module
from ctxreplay.dispatch.bound import Bound
from ctxreplay.dispatch.flat import Flat, flatten

pytestmark = [pytest.mark.filterwarnings("ignore::FutureWarning")]

DIM = 8


class Gather(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.index_select(x, 0, idx))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Gather() for _ in range(2))

    def forward(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x, idx)
        return x


def _captured(model: nn.Module, *args: Any) -> ctxreplay.CaptureReport:
    with ctxreplay.capture_with(model, targets="repeated", verify="execute") as session, \
            torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        model(*args)
    report = session.finalize()
    assert report.ok, report.problems
    return report


@pytest.fixture
def net() -> Net:
    torch.manual_seed(0)
    return Net().eval()


X, IDX = torch.rand(3, DIM), torch.tensor([0, 2, 1])


def test_a_dispatched_call_that_raises_shows_the_generated_line(net: Net) -> None:
    report = _captured(net, X, IDX)
    made = flatten(report.captures[0].artifact, keep_guards=False)
    assert isinstance(made, Flat)
    with ctxreplay.install(net, report) as handle, \
            torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        net(X, IDX)
        assert handle.stats().unflattened == {} and handle.stats().total_hits == 2
        with pytest.raises(IndexError) as info:
            net(X, torch.tensor([0, 9, 1]))  # out of range: the op raises inside the program
    frames = [f for f in traceback.extract_tb(info.value.__traceback__)
              if f.filename.startswith("<ctxreplay flat program #")]
    assert len(frames) == 1
    line = frames[0].line
    assert line and line in made.source  # the generated line, shown where it raised
    shown = "".join(traceback.format_tb(info.value.__traceback__))
    assert line in shown


def _with(**fields: Any) -> Any:
    return dataclasses.replace(flat_module.CAPS, **fields)


def test_an_autocast_region_is_not_inlined_where_torchs_autocast_differs(
        net: Net, monkeypatch: pytest.MonkeyPatch) -> None:
    report = _captured(net, X, IDX)
    program = report.captures[0].artifact
    assert "wrap_with_autocast" in str(program.graph)
    assert isinstance(flatten(program, keep_guards=False), Flat)
    monkeypatch.setattr(flat_module, "CAPS", _with(autocast_inlinable=False))
    why = flatten(program, keep_guards=False)
    assert isinstance(why, str) and "autocast" in why
    # installed, the program runs through torch's own module, bit-exactly
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        want = net(X, IDX)
        with ctxreplay.install(net, report) as handle:
            assert torch.equal(net(X, IDX), want)
            stats = handle.stats()
    assert stats.total_hits == 2 and stats.unflattened != {}


def test_ops_are_called_through_their_overload_where_it_does_more_than_op(
        net: Net, monkeypatch: pytest.MonkeyPatch) -> None:
    report = _captured(net, X, IDX)
    program = report.captures[0].artifact

    def run(made: Any) -> tuple[torch.Tensor, list[Any]]:
        assert isinstance(made, Flat)
        state = Bound.of(made, net.blocks[0], "").state()
        with torch.no_grad():
            out = made.rebuild(made.fn(*state, X, IDX))
        return out, list(made.fn.__globals__.values())

    # torch 2.14's OpOverload.__call__ does more than call ``_op``, so the
    # release's own answer may be either: both are set here
    monkeypatch.setattr(flat_module, "CAPS", _with(op_overload_calls_op=True))
    fast_out, fast_bound = run(flatten(program, keep_guards=False))
    monkeypatch.setattr(flat_module, "CAPS", _with(op_overload_calls_op=False))
    slow_out, slow_bound = run(flatten(program, keep_guards=False))
    assert torch.equal(fast_out, slow_out)
    overloads = [v for v in slow_bound if isinstance(v, torch._ops.OpOverload)]
    assert overloads and not any(isinstance(v, torch._ops.OpOverload) for v in fast_bound)


def test_a_program_is_not_flattened_without_the_pytree_code_generator(
        net: Net, monkeypatch: pytest.MonkeyPatch) -> None:
    program = _captured(net, X, IDX).captures[0].artifact
    monkeypatch.setattr(flat_module, "CAPS", _with(fx_pytree_codegen=False))
    assert flatten(program, keep_guards=False) == "the program's module has no pytree specs"


class TakesModule(nn.Module):
    def forward(self, x: torch.Tensor, scale: nn.Module) -> torch.Tensor:
        return x * scale.w


class Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.full((3,), 2.0))


def test_a_module_input_is_seen_without_example_inputs() -> None:
    """A program read from a file or the cache holds no example inputs: the
    in-spec, where export records a module input as a node of its class,
    still says so (torch's module enters a state for it the flat function
    would not)."""
    program = torch.export.export(TakesModule(), (torch.rand(3), Scale()), strict=False)
    assert flatten(program, keep_guards=False) == "a graph input is a module"
    program.example_inputs = None
    assert flatten(program, keep_guards=False) == "a graph input is a module"
