"""A capture whose live calls the ``retain_bytes`` budget could not keep is
not proven: its fidelity says how many calls were compared by value of how
many ran and how many its level meant to compare were not kept, it is not
ok, and ``install`` never dispatches it.

The stack's blocks read a module-level dict entry no probe observes (a
framework's switch); it changes after the first calls and is put back
before ``finalize()``, so the capture reproduces exactly the calls that fit
the budget and none of those that came after.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from torch import nn

import ctxreplay
from ctxreplay.observation.retained import SAMPLED
from ctxreplay.report.explain import Explanation

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

DIM = 8
BLOCKS = 3
ROUNDS = 30  # model calls: 90 block calls
#: one block call's input and output, float32
CALL = 2 * (2 * DIM * 4)

#: what the blocks read; no probe observes it
SWITCH = {"gain": 1.0}
#: the gain, read by code that has no source file: observation's watch of the
#: globals a forward's code loads (read from its bytecode) does not see it,
#: so only the value check of retained calls can tell the calls apart
_gain_now = eval("lambda: SWITCH['gain']")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) * _gain_now()


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


@contextmanager
def _gain(value: float) -> Iterator[None]:
    old, SWITCH["gain"] = SWITCH["gain"], value
    try:
        yield
    finally:
        SWITCH["gain"] = old


def _forward(model: nn.Module, inputs: list[torch.Tensor], switch_after: int | None
             ) -> list[torch.Tensor]:
    """Every round's output; from round ``switch_after`` on the gain is 2
    (``None``: never), and it is put back afterwards."""
    outs = []
    with torch.no_grad():
        for i, x in enumerate(inputs):
            with _gain(2.0 if switch_after is not None and i >= switch_after else 1.0):
                outs.append(model(x))
    return outs


def _session(retain_bytes: int, switch_after: int | None
             ) -> tuple[Stack, list[torch.Tensor], ctxreplay.CaptureReport]:
    torch.manual_seed(0)
    model = Stack().eval()
    inputs = [torch.randn(2, DIM) for _ in range(ROUNDS)]
    with ctxreplay.capture_with(model, targets="repeated", backend="export",
                                retain_bytes=retain_bytes) as session:
        _forward(model, inputs, switch_after)
    return model, inputs, session.finalize()


def _installed(model: Stack, inputs: list[torch.Tensor], report: ctxreplay.CaptureReport,
               switch_after: int | None) -> ctxreplay.DispatchStats:
    """Installed, the same rounds give eager's output on every one."""
    eager = _forward(model, inputs, switch_after)
    handle = ctxreplay.install(model, report)
    try:
        got = _forward(model, inputs, switch_after)
        stats = handle.stats()
    finally:
        handle.remove()
    assert [i for i, (a, b) in enumerate(zip(eager, got)) if not torch.equal(a, b)] == []
    return stats


def test_a_capture_whose_later_calls_were_not_kept_is_not_ok_and_not_dispatched() -> None:
    # room for each member's first call only: the gain switches after 10 rounds
    model, inputs, report = _session(BLOCKS * CALL + CALL // 2, switch_after=10)
    (c,) = report.captures
    fid = c.fidelity
    assert not report.ok
    assert not fid.ok and fid.status == "failed"
    stats = _installed(model, inputs, report, switch_after=10)
    assert stats.total_hits == 0
    assert stats.reasons == {"fidelity": BLOCKS * ROUNDS}
    assert stats.unusable == {f"{c.scope}#{c.variant}": "fidelity"}
    (m,) = fid.mismatches
    assert (m.field, m.level, m.live) == ("retained", "sampled", "not all kept")
    assert m.members == tuple(f"blocks.{i}" for i in range(BLOCKS))
    assert m.captured == f"retain_bytes={BLOCKS * CALL + CALL // 2}"
    assert (fid.calls, fid.by_value) == (BLOCKS * ROUNDS, BLOCKS)
    # each member's early samples at least, every one counted once
    assert fid.not_retained >= BLOCKS * SAMPLED
    assert report.retained is not None
    assert fid.not_retained == report.retained["not_retained"]
    assert f"{BLOCKS} of {BLOCKS * ROUNDS} calls checked by value, " \
        f"{fid.not_retained} not kept" in c.verdict


def test_the_control_every_sampled_call_kept_is_ok_and_dispatched() -> None:
    model, inputs, report = _session(1 << 30, switch_after=None)
    assert report.ok, report.summary
    (c,) = report.captures
    fid = c.fidelity
    assert fid.ok and fid.not_retained == 0 and fid.calls == BLOCKS * ROUNDS
    assert fid.by_value > BLOCKS * SAMPLED
    stats = _installed(model, inputs, report, switch_after=None)
    assert stats.total_hits == BLOCKS * ROUNDS and stats.reasons == {}


def test_at_values_a_budget_that_drops_calls_between_is_not_ok() -> None:
    # ``values`` keeps each member's first, last and a sample between: a
    # budget of four calls keeps the first and last of two members only
    torch.manual_seed(0)
    model = Stack().eval()
    with ctxreplay.capture_with(model, targets="repeated", backend="export", verify="values",
                                retain_bytes=4 * CALL) as session:
        _forward(model, [torch.randn(2, DIM) for _ in range(6)], None)
    report = session.finalize()
    (c,) = report.captures
    assert not c.fidelity.ok and c.fidelity.not_retained > 0
    assert {m.field for m in c.fidelity.mismatches} == {"retained"}
    assert not report.ok


def test_the_counts_are_in_the_report_manifest_sidecar_and_explain(tmp_path: Path) -> None:
    model, _, report = _session(BLOCKS * CALL + CALL // 2, switch_after=None)
    (c,) = report.captures
    doc = report.to_json()["captures"][0]["fidelity"]
    assert (doc["calls"], doc["by_value"], doc["not_retained"]) == \
        (c.fidelity.calls, c.fidelity.by_value, c.fidelity.not_retained)
    saved = report.save_all(tmp_path)
    (entry,) = saved.saved
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    (mc,) = manifest["captures"]
    assert mc["capture"]["fidelity"]["not_retained"] == c.fidelity.not_retained
    side = json.loads(entry.sidecar.read_text())
    assert side["fidelity"]["calls"] == BLOCKS * ROUNDS
    table = report.explain(model).table()
    assert f"{BLOCKS} of {BLOCKS * ROUNDS} calls compared by value" in table
    assert f"{c.fidelity.not_retained} not kept (retain_bytes reached): not ok" in table
    # what ``ctxreplay explain`` reads back from the saved report says the same
    assert Explanation.from_report_json(report.to_json()).table() == table
