"""The default verification compares values: state no probe observes,
and a forward that reuses what it computed before, make the report not ok
without the user asking for ``verify="values"``.

The default level (``"sampled"``) keeps copies of each member's first call
of each variant and of a reservoir of later calls chosen before they run;
every other call stays on the observation's fast path.  Each test records
what really ran with its own hooks (tests/helpers/trust_oracle.py) and shows
the control: the same session at ``verify="execute"``, whose checks run on
fresh inputs under the state ``finalize()`` finds, calls the same capture ok.
"""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
import torch
from torch import nn
from trust_oracle import record, unreproduced

import ctxreplay
from ctxreplay.capture.checker import UNOBSERVED_HINT
from ctxreplay.observation.retained import SAMPLED, Schedule
from ctxreplay.observation.wrapper import _Member

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

DIM = 16

#: a framework's module-level backend switch, as attention dispatchers keep it
BACKEND = {"name": "default"}


class Switched(nn.Module):
    """Reads the module-level backend string no probe observes."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return torch.tanh(y) if BACKEND["name"] == "fast" else torch.relu(y)


class Stack(nn.Module):
    def __init__(self, block: type[nn.Module], n: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(block() for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def _switched_session(verify: str | None, mode: Any = torch.no_grad
                      ) -> tuple[ctxreplay.CaptureReport, list[str]]:
    torch.manual_seed(0)
    model = Stack(Switched).eval()
    kwargs = {} if verify is None else {"verify": verify}
    with record(model, [f"blocks.{i}" for i in range(3)]) as calls:
        with ctxreplay.capture_with(model, targets="repeated", backend="export",
                                    **kwargs) as session:
            BACKEND["name"] = "fast"
            try:
                with mode():
                    for _ in range(4):
                        model(torch.randn(2, DIM))
            finally:
                BACKEND["name"] = "default"  # the context manager exited
        report = session.finalize()
    return report, unreproduced(report, calls)


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_a_probe_left_out_is_not_ok_at_the_default_verify(mode: Any) -> None:
    report, bad = _switched_session(None, mode)
    assert bad  # the oracle: the captures compute other values than what ran
    assert report.settings["verify"] == "sampled"
    assert not report.ok
    for c in report.captures:
        assert not c.fidelity.ok and c.checked >= 1
        hints = {m.hint for m in c.fidelity.mismatches if m.field == "values"}
        # every probe's state agreed: the hint names none of them (grad mode
        # under inference mode was the old, wrong, suspect)
        assert hints == {UNOBSERVED_HINT}


def test_the_control_execute_cannot_see_a_probe_left_out() -> None:
    # fresh inputs under the state finalize() finds: the capture and the
    # module agree with each other, not with what ran
    report, bad = _switched_session("execute")
    assert bad and report.ok


def test_nothing_left_out_is_ok_at_the_default_verify() -> None:
    torch.manual_seed(0)
    model = Stack(Switched).eval()
    with record(model, [f"blocks.{i}" for i in range(3)]) as calls:
        with ctxreplay.capture_with(model, targets="repeated", backend="export") as session, \
                torch.no_grad():
            for _ in range(4):
                model(torch.randn(2, DIM))
        report = session.finalize()
    assert report.ok, report.problems
    assert not unreproduced(report, calls)
    # each member's first call and its later calls (3 of them) compared by value
    assert sum(c.checked for c in report.captures) == 3 * 4


class Memo:
    """A Python object a forward replacement keeps its last output on."""

    def __init__(self) -> None:
        self.out: torch.Tensor | None = None
        self.step = 0


class Reuses(nn.Module):
    """Computes on even steps and returns the memo on odd ones (a step cache)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.memo = _Holder(Memo())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        memo = self.memo.obj
        memo.step += 1
        if memo.step % 2 == 0 and memo.out is not None:
            return memo.out
        memo.out = self.lin(x)
        return memo.out


class _Holder:
    """Not a module, not a tensor: a plain object attribute (as a cache hook holds)."""

    def __init__(self, obj: Memo) -> None:
        self.obj = obj


def test_a_forward_that_alternates_compute_and_reuse_is_not_ok_by_default() -> None:
    torch.manual_seed(0)
    model = Stack(Reuses, n=2).eval()
    with record(model, ["blocks.0", "blocks.1"]) as calls:
        with ctxreplay.capture_with(model, targets="repeated", backend="export") as session, \
                torch.no_grad():
            for _ in range(6):
                model(torch.randn(2, DIM))
        report = session.finalize()
    assert unreproduced(report, calls)  # the oracle: reused calls are not what a graph computes
    assert not report.ok
    values = [m for c in report.captures for m in c.fidelity.mismatches if m.field == "values"]
    assert values and all(m.hint == UNOBSERVED_HINT for m in values)


class Counting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def _counted_session(monkeypatch: pytest.MonkeyPatch, members: int, n: int
                     ) -> tuple[ctxreplay.CaptureReport, list[str], list[str]]:
    """``n`` calls of a stack of ``members`` identical blocks (one variant):
    the report, the members of the calls that took the slow path, and of
    those sampled into the variant's reservoir."""
    slow: list[str] = []
    pooled: list[str] = []
    call, retaining = _Member._call, _Member._retaining

    def counting(self: _Member, args: Any, kwargs: Any) -> Any:
        slow.append(self.name)
        return call(self, args, kwargs)

    def pooling(self: _Member, mv: Any, args: Any, kwargs: Any, pool: bool) -> Any:
        if pool:
            pooled.append(self.name)
        return retaining(self, mv, args, kwargs, pool)

    monkeypatch.setattr(_Member, "_call", counting)
    monkeypatch.setattr(_Member, "_retaining", pooling)
    model = Stack(Counting, n=members).eval()
    x = torch.randn(2, DIM)
    with ctxreplay.capture_with(model, targets="repeated", backend="export") as session, \
            torch.no_grad():
        for _ in range(n):
            model(x)
    return session.finalize(), slow, pooled


def test_unsampled_calls_stay_on_the_fast_path(monkeypatch: pytest.MonkeyPatch) -> None:
    members, n = 2, 400
    report, slow, _ = _counted_session(monkeypatch, members, n)
    assert report.ok
    per_member = {name: slow.count(name) for name in ("blocks.0", "blocks.1")}
    # each member's first call and the SAMPLED after it, then ever rarer
    # samples of the variant: about SAMPLED * ln(n / SAMPLED) in all, each
    # with one more slow call of the member that takes the next (a generous
    # bound; before, every call took the slow path at a value-checking level)
    bound = members * (2 + SAMPLED) + 2 * 3 * SAMPLED * (1 + math.log(n / SAMPLED))
    assert all(v > SAMPLED for v in per_member.values()), per_member
    assert sum(per_member.values()) < bound, per_member
    # the members' early calls and the variant's full reservoir
    assert sum(c.checked for c in report.captures) == members * (1 + SAMPLED) + SAMPLED


def test_the_reservoir_is_per_variant_not_per_member(monkeypatch: pytest.MonkeyPatch) -> None:
    # a stack of identical blocks is one variant: its later calls share one
    # reservoir, so the copies do not grow with the stack's depth (with a
    # reservoir per member, 8 members copy about 8 * SAMPLED * ln(n / SAMPLED)
    # calls), and the samples come from members picked at random
    members, n = 8, 1000
    report, _, pooled = _counted_session(monkeypatch, members, n)
    assert report.ok and report.retained is not None
    pooled_bound = 3 * SAMPLED * (1 + math.log(n / SAMPLED))
    early = members * (1 + SAMPLED)
    assert early < report.retained["retained_calls"] < early + pooled_bound, report.retained
    assert len(set(pooled)) >= members // 2, pooled
    assert sum(c.checked for c in report.captures) == early + SAMPLED


def test_the_schedule_samples_late_calls_too() -> None:
    # the reservoir stays a uniform sample of the calls after the first: over
    # many sessions, late calls are sampled about as often as early ones
    rng = random.Random(1)
    n = 2000
    late = early = 0
    for _ in range(300):
        schedule, slots = Schedule(), []
        i = schedule.due
        while i < n:
            if len(slots) < SAMPLED:
                slots.append(i)
            else:
                slots[rng.randrange(SAMPLED)] = i
            schedule.advance(i, rng)
            i = schedule.due
        late += sum(s > n // 2 for s in slots)
        early += sum(0 < s <= n // 2 for s in slots)
    assert 0.8 < late / early < 1.25, (late, early)


def test_a_call_that_could_not_be_copied_says_so() -> None:
    torch.manual_seed(0)
    model = Stack(Counting, n=2).eval()
    with ctxreplay.capture_with(model, targets="repeated", backend="export",
                                retain_bytes=16) as session, torch.no_grad():
        for _ in range(3):
            model(torch.randn(2, DIM))
    report = session.finalize()
    assert not report.ok
    (m, *_) = [m for c in report.captures for m in c.fidelity.mismatches]
    assert (m.field, m.live) == ("retained", "none kept")
    assert m.captured == "compared_by_value=0, retain_bytes=16"


def test_first_calls_displace_later_samples_within_the_budget() -> None:
    # room for the first call of every member and little else: each member is
    # still compared by value, on its first call at least -- and the later
    # samples the budget did not keep leave the capture not ok, counted
    torch.manual_seed(0)
    model = Stack(Counting, n=4).eval()
    call = 2 * DIM * 4 * 2  # inputs and outputs of one call, float32
    with ctxreplay.capture_with(model, targets="repeated", backend="export",
                                retain_bytes=4 * call + call // 2) as session, torch.no_grad():
        for _ in range(6):
            model(torch.randn(2, DIM))
    report = session.finalize()
    assert all(c.checked >= c.fidelity.members for c in report.captures)
    assert not report.ok
    for c in report.captures:
        assert c.fidelity.not_retained > 0
        assert {(m.field, m.live) for m in c.fidelity.mismatches} == \
            {("retained", "not all kept")}
