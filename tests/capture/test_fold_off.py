"""Where torch's exported programs do not check the size guards of their
trace (torch 2.7), ctxreplay does not fold sizes: a fold's program would run
a size inside its range that the trace took another path for, silently.

Run everywhere: on a torch that has the guards the capability is replaced
by one that has not, and the control shows what a fold does there.  The
oracle is eager: each installed call is compared with the model run
without ctxreplay, and a block's own pre-hook counts the calls that ran it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import fold_cases as fc
import pytest
import torch
from forward_count import forwards_run
from torch import nn

import ctxreplay
from ctxreplay._base.torchcaps import CAPS
from ctxreplay.capture import fold

# the sizes observed; 7 lies inside their range and takes another path
OBSERVED = (4, 6, 9)


@pytest.fixture
def without_size_guards(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fold, "CAPS", dataclasses.replace(CAPS, export_guards_sizes=False))


def _session(model: nn.Module, **options: Any) -> ctxreplay.CaptureReport:
    with ctxreplay.capture_with(model, targets="repeated", **options) as session, \
            torch.no_grad():
        for n in OBSERVED:
            (x,), _ = fc.sequence(n)
            model(x)
    return session.finalize()


def _installed(model: nn.Module, report: ctxreplay.CaptureReport, n: int) -> tuple[bool, int]:
    """``(installed output equals eager, block calls that ran eagerly)``."""
    (x,), _ = fc.sequence(n)
    with torch.no_grad():
        want = model(x)
    # a dispatched block runs its graph, never its own ``lin`` (counted
    # without a hook on it, which would make install run the block eagerly)
    with forwards_run(b.lin for b in model.blocks) as eager, \
            ctxreplay.install(model, report), torch.no_grad():  # type: ignore[union-attr]
        got = model(x)
    return torch.equal(got, want), eager[0]


@pytest.mark.usefixtures("without_size_guards")
def test_without_size_guards_each_size_is_captured_on_its_own_and_says_why() -> None:
    model = fc.stack(fc.Special)
    report = _session(model, max_variants=2)
    # every size its own capture (two kept: the limit), none folded
    assert report.captures and all(c.folding is None for c in report.captures)
    [limit] = [p for p in report.problems if p.reason == "variant_limit"]
    [why] = [n for n in limit.names if n.startswith("fold:off:")]
    assert "size_guards=False" in why and "torch" in why


@pytest.mark.usefixtures("without_size_guards")
def test_without_size_guards_only_observed_sizes_are_dispatched() -> None:
    model = fc.stack(fc.Special)
    report = _session(model)
    assert report.ok and len(report.captures) == len(OBSERVED)
    for n in OBSERVED:
        assert _installed(model, report, n) == (True, 0), n
    assert _installed(model, report, 7) == (True, len(model.blocks))  # never seen


def test_the_control_a_fold_dispatches_a_size_it_never_saw() -> None:
    """What turning folding off gives up: with the guards, one fold takes
    the sizes in its range it never saw, and its own guard refuses 7.  A
    torch without the guards never folds: there the same session, the
    capability its own, gives what the faked one does."""
    model = fc.stack(fc.Special)
    if not CAPS.export_guards_sizes:
        report = _session(model)
        assert report.ok and len(report.captures) == len(OBSERVED)
        assert all(c.folding is None for c in report.captures)
        assert _installed(model, report, 5) == (True, len(model.blocks))  # never seen
        assert _installed(model, report, 4) == (True, 0)
        return
    report = _session(model)
    assert report.ok and [c.folding is not None for c in report.captures] == [True]
    assert _installed(model, report, 5) == (True, 0)
    assert _installed(model, report, 7) == (True, len(model.blocks))
