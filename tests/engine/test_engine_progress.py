"""Progress of finalize: a finalize that runs longer than a couple of seconds
shows itself however few its variants, its bar moving with each graph and
with each member's check; log lines count the graphs made, and a closing
line the captures the variants became.

``SHOW_AFTER`` set to 0 stands for a finalize that ran long (a Wan
transformer's one variant checked on 30 blocks takes seconds)."""

from __future__ import annotations

import io
import logging
from typing import Any

import pytest
import torch
from torch import nn

import ctxreplay
from ctxreplay._base import progress

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

DEPTH = 5


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class Layer(nn.Module):
    def __init__(self, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx  # read by no forward: one graph serves every layer
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(x)


def _finalize(blocks: list[nn.Module], **options: Any) -> ctxreplay.CaptureReport:
    torch.manual_seed(0)
    model = nn.Module()
    model.blocks = nn.ModuleList(blocks)
    with ctxreplay.capture_with(model, targets="repeated", **options) as session, \
            torch.no_grad():
        x = torch.rand(2, 8)
        for b in model.blocks:
            x = b(x)
    return session.finalize()


@pytest.fixture
def bars(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every tqdm bar made, with the count after each of its updates."""
    tqdm = pytest.importorskip("tqdm")
    made: list[Any] = []

    class Recording(tqdm.tqdm):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.counts: list[int] = []
            made.append(self)

        def update(self, n: float | None = 1) -> bool | None:
            out = super().update(n)
            self.counts.append(int(self.n))
            return out

    monkeypatch.setattr(tqdm, "tqdm", Recording)
    return made


def test_a_long_finalize_of_one_variant_draws_a_bar_counting_each_check(
        monkeypatch: pytest.MonkeyPatch, bars: list[Any]) -> None:
    monkeypatch.setattr(progress, "SHOW_AFTER", 0.0)
    term = _Terminal()
    monkeypatch.setattr("sys.stderr", term)
    report = _finalize([nn.Linear(8, 8) for _ in range(DEPTH)], verify="execute")
    assert report.ok and len(report.captures) == 1
    (bar,) = bars
    # one variant: its graph and a check per member, each a step of its own
    assert bar.total == 1 + DEPTH
    assert bar.counts == list(range(1, DEPTH + 2))
    assert "ctxreplay finalize" in term.getvalue()


def test_a_short_finalize_of_few_variants_draws_nothing(bars: list[Any],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    term = _Terminal()
    monkeypatch.setattr("sys.stderr", term)
    assert _finalize([nn.Linear(8, 8) for _ in range(DEPTH)], verify="execute").ok
    (bar,) = bars
    assert bar.delay == progress.SHOW_AFTER > 0  # the bar waits that long to show
    assert "ctxreplay finalize" not in term.getvalue()


def test_a_long_finalize_off_a_terminal_logs_its_checks_and_what_it_made(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(progress, "SHOW_AFTER", 0.0)
    monkeypatch.setattr("sys.stderr", io.StringIO())
    with caplog.at_level(logging.INFO, logger="ctxreplay"):
        assert _finalize([nn.Linear(8, 8) for _ in range(3)], verify="execute").ok
    lines = [r.getMessage() for r in caplog.records if r.name == "ctxreplay"]
    assert lines[:-2] == [f"finalize: 0/1 variants, checking blocks.0#0 blocks.{i} "
                          f"({i + 1} of 3 members)" for i in range(3)]
    assert lines[-2] == "finalize: 1/1 variants, 1 graph made (blocks.0#0)"
    assert lines[-1].startswith("finalize: 1 variant -> 1 capture (1 graph made, 0 served by "
                                "another variant's graph, 0 failed) in ")


def test_log_lines_count_graphs_not_layers(monkeypatch: pytest.MonkeyPatch,
                                           caplog: pytest.LogCaptureFixture) -> None:
    """Layers differing only in an unread index: one graph for the six
    variants, and the lines say so (they said ``captured 6/6`` before)."""
    monkeypatch.setattr("sys.stderr", io.StringIO())
    with caplog.at_level(logging.INFO, logger="ctxreplay"):
        report = _finalize([Layer(i) for i in range(6)], backend="export")
    assert report.ok and len(report.captures) == 1
    lines = [r.getMessage() for r in caplog.records if r.name == "ctxreplay"]
    assert lines[:6] == [f"finalize: {i + 1}/6 variants, 1 graph made (blocks.0#{i})"
                         for i in range(6)]
    assert lines[6].startswith("finalize: 6 variants -> 1 capture (1 graph made, 5 served by "
                               "another variant's graph, 0 failed) in ")
    assert len(lines) == 7
