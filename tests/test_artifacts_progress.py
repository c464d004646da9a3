"""finalize(progress=...): a callback per variant, one logging line per
variant off a terminal, a tqdm bar on one; quiet for a few variants."""

from __future__ import annotations

import io
import logging

import pytest
import torch
from torch import nn

import ctxreplay


def _session(variants: int) -> ctxreplay.CaptureSession:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)).eval()
    model.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
    session = ctxreplay.capture_with(model, targets=["blocks.0"], verify="signature")
    with torch.no_grad():
        for n in range(1, variants + 1):
            model.blocks[0](torch.rand(n, 4))
    return session


def test_the_callback_hears_every_variant() -> None:
    seen: list[tuple[int, int, str]] = []
    report = _session(5).finalize(progress=lambda d, t, label: seen.append((d, t, label)))
    assert report.ok and len(report.captures) == 5
    assert seen == [(i + 1, 5, f"blocks.0#{i}") for i in range(5)]


def test_a_failing_callback_costs_no_capture() -> None:
    def broken(done: int, total: int, label: str) -> None:
        raise RuntimeError("tool bug")

    report = _session(4).finalize(progress=broken)
    assert report.ok and len(report.captures) == 4


def test_one_log_line_per_variant_off_a_terminal(caplog: pytest.LogCaptureFixture,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.stderr", io.StringIO())  # not a terminal
    with caplog.at_level(logging.INFO, logger="ctxreplay"):
        _session(4).finalize()
    lines = [r.getMessage() for r in caplog.records if r.name == "ctxreplay"]
    assert lines == [f"finalize: captured {i}/4 (blocks.0#{i - 1})" for i in range(1, 5)]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ctxreplay"):
        _session(3).finalize()  # a few variants: nothing to say
    assert [r for r in caplog.records if r.name == "ctxreplay"] == []


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_bar_on_a_terminal(caplog: pytest.LogCaptureFixture,
                             monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("tqdm")
    term = _Terminal()
    monkeypatch.setattr("sys.stderr", term)
    with caplog.at_level(logging.INFO, logger="ctxreplay"):
        report = _session(4).finalize()
    assert report.ok
    assert "ctxreplay finalize" in term.getvalue()  # the bar drew itself there
    assert [r for r in caplog.records if r.name == "ctxreplay"] == []  # instead of lines
