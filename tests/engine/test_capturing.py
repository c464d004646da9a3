"""Every capture of a finalize is one call: ``RankCapture.capture(ask)``.

Folding and the capture cache wrap that call -- they build an ``Ask`` and
hand it on -- instead of being called back from inside a capture.  The
tests record each ask the engine makes and each ``capture_variant`` call
the ask turns into, and hold the report to what the test's own hooks
recorded of the live calls (``trust_oracle``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import trust_oracle
from capability import FOLDS
from torch import nn

import ctxreplay
from ctxreplay.cache import entries, use
from ctxreplay.capture.asking import Ask
from ctxreplay.engine import capturing

#: rows 4 and 6 fold into one graph; the batch-1 call is traced apart (a size of 1)
SHAPES = ((2, 4, 8), (2, 6, 8), (1, 5, 8))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


class _Calls:
    """The asks the engine made, and the ``capture_variant`` calls they became."""

    def __init__(self) -> None:
        self.asked: list[Ask] = []
        self.traced: list[Ask] = []


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Calls]:
    seen = _Calls()
    capture = capturing.RankCapture.capture

    def asked(self: capturing.RankCapture, ask: Ask) -> Any:
        seen.asked.append(ask)
        return capture(self, ask)

    def traced(real: Any) -> Any:
        def call(ask: Ask, tracing: Any) -> Any:
            seen.traced.append(ask)
            return real(ask, tracing)
        return call

    monkeypatch.setattr(capturing.RankCapture, "capture", asked)
    for module in (capturing, use, entries):
        monkeypatch.setattr(module, "capture_variant", traced(module.capture_variant))
    yield seen


def _finalize(model: nn.Module, **kw: Any) -> tuple[ctxreplay.CaptureReport, list[Any]]:
    members = trust_oracle.members_of(model, "blocks")
    with trust_oracle.record(model, members) as live:
        session = ctxreplay.capture_with(model, targets="repeated", backend="export", **kw)
        with session, torch.no_grad():
            for shape in SHAPES:
                model(torch.rand(shape))
        report = session.finalize()
    return report, live


def test_a_fold_and_a_single_variant_are_each_one_ask(calls: _Calls) -> None:
    torch.manual_seed(0)
    report, live = _finalize(Stack(), verify="execute")
    assert report.ok, report.summary()
    assert trust_oracle.unreproduced(report, live) == []
    assert [id(a) for a in calls.traced] == [id(a) for a in calls.asked]
    if not FOLDS:  # no fold asked: one ask per variant, each its own capture
        assert [ask.fold for ask in calls.asked] == [None] * 3
        assert [len(c.folded) for c in report.captures] == [0] * 3
        return
    # the family of rows 4 and 6 is one fold ask; the batch-1 variant its own
    assert [ask.fold is not None for ask in calls.asked] == [True, False]
    fold = calls.asked[0].fold
    assert fold is not None
    rows = sorted(next(iter(r.inputs.leaves()))[1].shape[1] for r in fold.pending)
    assert rows == [4, 6]
    # without a cache, the ask is handed to the capture as it is
    assert [id(a) for a in calls.traced] == [id(a) for a in calls.asked]
    assert sorted(len(c.folded) for c in report.captures) == [0, 1]


#: the asks SHAPES makes: a fold and a single variant, or one per variant
#: where ctxreplay does not fold
ASKS = 2 if FOLDS else 3


def test_the_cache_wraps_the_one_call(calls: _Calls, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    torch.manual_seed(0)
    model = Stack()
    first, _ = _finalize(model, verify="execute", cache=cache)
    assert first.ok, first.summary()
    # a miss: traced, with no program of its own
    assert calls.traced and all(a.source is None for a in calls.traced)
    assert len(calls.traced) == len(calls.asked) == ASKS
    calls.asked.clear()
    calls.traced.clear()

    second, live = _finalize(model, verify="execute", cache=cache)
    assert second.ok, second.summary()
    assert trust_oracle.unreproduced(second, live) == []
    assert all(c.from_cache for c in second.captures)
    # a hit at a level that runs: the same ask, with the stored program as its source
    assert len(calls.traced) == len(calls.asked) == ASKS
    assert all(t.source is not None and t.request is a.request
               for t, a in zip(calls.traced, calls.asked))
    assert [t.fold is a.fold for t, a in zip(calls.traced, calls.asked)] == [True] * ASKS


def test_a_signature_level_hit_runs_no_capture(calls: _Calls, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    torch.manual_seed(0)
    model = Stack()
    _finalize(model, verify="signature", cache=cache)
    calls.asked.clear()
    calls.traced.clear()
    report, _ = _finalize(model, verify="signature", cache=cache)
    assert report.ok, report.summary()
    assert all(c.from_cache for c in report.captures)
    assert len(calls.asked) == ASKS and calls.traced == []
