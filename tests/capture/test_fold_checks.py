"""A fold's by-value checks: one graph run at every observed size, for every
member, with that member's own weights -- the program unlifted once for all
of them (``ExportedProgram.module()`` recompiles every graph each call).

Where ctxreplay does not fold (torch 2.7) the same session is one capture
per size, each dispatched at its own size only."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from capability import FOLDS
from metadata_check import finalize_checked
from torch import nn

import ctxreplay
from ctxreplay.backends.builtin import ExportBackend

SIZES = (2, 3, 5, 7)


def _served_at_every_size(model: nn.Module, eager: nn.Module,
                          report: ctxreplay.CaptureReport) -> Any:
    """Install's stats after each observed size and 4 (never seen) ran,
    every output equal to the eager copy's."""
    handle = ctxreplay.install(model, report)
    try:
        with torch.no_grad():
            for n in (*SIZES, 4):
                x = torch.rand(n, 16)
                torch.testing.assert_close(model(x), eager(x))
        return handle.stats()
    finally:
        handle.remove()


def _assert_one_per_size(model: nn.Module, eager: nn.Module,
                         report: ctxreplay.CaptureReport) -> None:
    """No fold: a capture per observed size for all three members, each size
    dispatched with every member's eager output, and 4 (never seen) eager."""
    assert report.ok and len(report.captures) == len(SIZES)
    assert all(c.folding is None and c.fidelity.members == 3 for c in report.captures)
    stats = _served_at_every_size(model, eager, report)
    assert stats.total_hits == 3 * len(SIZES) and stats.total_misses == 3


class UnliftCounting(ExportBackend):
    """``ExportBackend`` that counts the modules it unlifts from a program."""

    def __init__(self) -> None:
        super().__init__()
        self.unlifted = 0

    def module(self, artifact: Any) -> nn.Module | None:
        self.unlifted += 1
        return super().module(artifact)


class Members(nn.Module):
    """Three ``Linear`` blocks of one structure, each its own weights."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = torch.tanh(b(x))
        return x


@pytest.mark.parametrize(("verify", "unlifts"), [("signature", 1), ("execute", 2)])
def test_a_fold_unlifts_its_program_once_for_every_size(verify: str, unlifts: int) -> None:
    torch.manual_seed(0)
    model = Members().eval()
    eager = copy.deepcopy(model)
    backend = UnliftCounting()
    with ctxreplay.capture_with(model, targets="repeated", backend=backend, verify=verify,
                                fold=True) as session, torch.no_grad():
        for n in SIZES:
            model(torch.rand(n, 16))
    report = finalize_checked(session)
    if not FOLDS:
        _assert_one_per_size(model, eager, report)
        return
    assert report.ok and len(report.captures) == 1
    cap = report.captures[0]
    assert cap.folding is not None and cap.folding.sizes == len(SIZES)
    assert cap.fidelity.members == 3 and "execute" in cap.fidelity.checked
    # the fold's runs at the other sizes share one unlifted program (was one
    # per size); "execute" unlifts once more for the example's own check
    assert backend.unlifted == unlifts
    # each member dispatched to the one graph at every size gives that
    # member's eager output (the test's own copy of the model)
    stats = _served_at_every_size(model, eager, report)
    assert stats.total_misses == 0 and stats.total_hits == 3 * (len(SIZES) + 1)
