"""State a forward reads that changes on a few of many calls.

The default level compares a sample of the live calls by value: a dict
entry, a module global or a plain object's field that a pipeline flips on
3 of 200 calls, or a tensor a block stores on one call and reads on the
next, changes what those calls compute, and a sample may never include
them.  Observation checks, on every call, the places a member's code reads
beside its arguments and weights; a capture whose trace read a place that
changed between its calls is not ok (a ``read_state`` mismatch naming
the place).  The controls: the same stacks without the change stay ok, and
a cache a block fills on its first call is no change.
"""

from __future__ import annotations

import types
from collections.abc import Callable

import pytest
import rare_knobs
import torch
from torch import nn

import ctxreplay

CALLS = 200
FLIPPED = (50, 120, 170)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.cfg = {"mode": "a"}
        self.opts = types.SimpleNamespace(flag=False)
        self.clock = types.SimpleNamespace(n=0)
        self.stored: torch.Tensor | None = None


class DictBlock(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return y * 3 if self.cfg["mode"] == "b" else y


class GlobalBlock(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return y - 2 if rare_knobs.MODE == "b" else y


class FieldBlock(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return y + 7 if self.opts.flag else y


class StoreEvery10(Block):
    """Stores its output on every 10th call and adds it to the next call's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if self.stored is not None:
            y, self.stored = y + self.stored, None
        elif self.clock.n % 10 == 9:
            self.stored = y.detach()
        return y


class LazyCache(Block):
    """Fills a tensor on its first call and reads it on every call."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stored is None:
            self.stored = torch.ones(8)
        return self.lin(x) + self.stored


class Stack(nn.Module):
    def __init__(self, cls: type[Block]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(cls() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def _flip_dict(m: Stack, i: int) -> None:
    for b in m.blocks:
        b.cfg["mode"] = "b" if i in FLIPPED else "a"


def _flip_global(m: Stack, i: int) -> None:
    rare_knobs.MODE = "b" if i in FLIPPED else "a"


def _flip_field(m: Stack, i: int) -> None:
    for b in m.blocks:
        b.opts.flag = i in FLIPPED


def _tick(m: Stack, i: int) -> None:
    for b in m.blocks:
        b.clock.n = i


def _nothing(m: Stack, i: int) -> None:
    del m, i


@pytest.fixture(autouse=True)
def _global_back() -> object:
    yield
    rare_knobs.MODE = "a"


def _report(cls: type[Block], before: Callable[[Stack, int], None]
            ) -> ctxreplay.CaptureReport:
    torch.manual_seed(0)
    model = Stack(cls).eval()
    xs = torch.randn(CALLS, 2, 8)
    with ctxreplay.capture_with(model, targets="repeated") as session, torch.no_grad():
        for i in range(CALLS):
            before(model, i)
            model(xs[i])
    return session.finalize()


CASES = [(DictBlock, _flip_dict, "cfg"), (GlobalBlock, _flip_global, "global rare_knobs.MODE"),
         (FieldBlock, _flip_field, "opts.flag")]


@pytest.mark.parametrize("cls,flip,place", CASES, ids=["dict entry", "module global",
                                                      "object field"])
def test_a_flip_on_three_of_two_hundred_calls_is_not_ok_naming_the_place(
        cls: type[Block], flip: Callable[[Stack, int], None], place: str) -> None:
    report = _report(cls, flip)
    assert not report.ok
    found = {(m.field, m.path) for c in report.captures for m in c.fidelity.mismatches}
    assert ("read_state", place) in found, found


@pytest.mark.parametrize("cls,flip,place", CASES, ids=["dict entry", "module global",
                                                      "object field"])
def test_control_the_same_stack_without_the_flip_is_ok(
        cls: type[Block], flip: Callable[[Stack, int], None], place: str) -> None:
    report = _report(cls, _nothing)
    assert report.ok, report.explain(Stack(cls))


def _read_state(report: ctxreplay.CaptureReport) -> set[str]:
    return {m.path for c in report.captures for m in c.fidelity.mismatches
            if m.field == "read_state"}


def test_a_block_that_stores_on_one_call_and_reads_on_the_next_is_not_ok() -> None:
    report = _report(StoreEvery10, _tick)
    assert not report.ok
    # the step it reads, or what it stored, named
    assert _read_state(report) & {"clock.n", "stored"}, report.captures[0].fidelity


def test_a_cache_filled_on_the_first_call_is_no_change() -> None:
    report = _report(LazyCache, _nothing)
    assert report.ok, [m for c in report.captures for m in c.fidelity.mismatches]


class TagBlock(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return -y if getattr(x, "_uncond", False) else y


class StoreFrom6(Block):
    """From its sixth call on, adds what it stored on the call before."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if self.clock.n >= 5:
            if self.stored is not None:
                y = y + self.stored
            self.stored = y.detach()
        return y


def test_a_block_that_starts_storing_at_its_sixth_call_is_not_ok() -> None:
    report = _report(StoreFrom6, _tick)
    assert not report.ok
    assert _read_state(report) & {"clock.n", "stored"}, report.captures[0].fidelity


def test_a_tag_on_every_seventh_input_tensor_is_not_ok_naming_it() -> None:
    torch.manual_seed(0)
    model = TagBlock().eval()
    xs = torch.randn(CALLS, 2, 8)
    with ctxreplay.capture_with(model) as session, torch.no_grad():
        for i in range(CALLS):
            x = xs[i].clone()
            if i % 7 == 3:
                x._uncond = True  # type: ignore[attr-defined]
            model(x)
    report = session.finalize()
    assert not report.ok
    found = {(m.field, m.path) for c in report.captures for m in c.fidelity.mismatches}
    assert ("read_state", "x._uncond") in found, found


def test_control_untagged_inputs_are_ok() -> None:
    torch.manual_seed(0)
    model = TagBlock().eval()
    with ctxreplay.capture_with(model) as session, torch.no_grad():
        for x in torch.randn(CALLS, 2, 8):
            model(x.clone())
    assert session.finalize().ok


def test_explain_names_the_place_that_changed() -> None:
    report = _report(DictBlock, _flip_dict)
    text = str(report.explain(Stack(DictBlock)))
    assert any("read state" in line and "cfg" in line for line in text.splitlines()), text
    control = str(_report(DictBlock, _nothing).explain(Stack(DictBlock)))
    assert "read state" not in control
