"""finalize(progress=...): a callback per variant, one logging line per
variant off a terminal and a closing line, a tqdm bar on one; quiet for a
few variants (tests/engine/test_engine_progress.py: a long finalize of a
few variants is not)."""

from __future__ import annotations

import io
import logging
from pathlib import Path

import pytest
import torch
from torch import nn

import ctxreplay


def _session(variants: int) -> ctxreplay.CaptureSession:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)).eval()
    model.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
    # one capture per size (fold=False): progress is heard per capture
    session = ctxreplay.capture_with(model, targets=["blocks.0"], verify="signature",
                                     fold=False)
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
    made = ["1 graph"] + [f"{i} graphs" for i in range(2, 5)]
    assert lines[:4] == [f"finalize: {i}/4 variants, {made[i - 1]} made (blocks.0#{i - 1})"
                         for i in range(1, 5)]
    assert lines[4].startswith("finalize: 4 variants -> 4 captures (4 graphs made, 0 served "
                               "by another variant's graph, 0 failed) in ")
    assert len(lines) == 5
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


# -- save_all, load and install ------------------------------------------------------

def _report(variants: int) -> ctxreplay.CaptureReport:
    return _session(variants).finalize()


def test_save_all_hears_every_capture_and_sums_up(tmp_path: Path,
                                                  caplog: pytest.LogCaptureFixture,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    report = _report(4)
    seen: list[tuple[int, int, str]] = []
    monkeypatch.setattr("sys.stderr", io.StringIO())  # not a terminal
    with caplog.at_level(logging.INFO, logger="ctxreplay"):
        written = report.save_all(tmp_path, progress=lambda d, t, label: seen.append((d, t, label)))
    assert written.ok and len(written.saved) == 4
    assert seen == [(i + 1, 4, f"blocks.0#{i}") for i in range(4)]
    lines = [r.getMessage() for r in caplog.records if r.name == "ctxreplay"]
    assert lines[:4] == [f"save_all: saved {i}/4 (blocks.0#{i - 1})" for i in range(1, 5)]
    # finalize() checked the signature only, and each file holds the very
    # program it checked (an nn.Linear's empty no_grad wrapper dropped, not the
    # program lowered): each is vouched for by its graph, none had to run
    assert lines[4].startswith(f"save_all: 4 of 4 captures written to {tmp_path} in ")
    assert lines[4].endswith("(4 checked by their graph, 0 run, 0 unchecked, 0 not ok, "
                             "0 not saved)")
    assert len(lines) == 5


def test_save_all_draws_a_bar_on_a_terminal(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("tqdm")
    report = _report(4)
    term = _Terminal()
    monkeypatch.setattr("sys.stderr", term)
    with caplog.at_level(logging.INFO, logger="ctxreplay"):
        assert report.save_all(tmp_path).ok
    assert "ctxreplay save_all" in term.getvalue()
    lines = [r.getMessage() for r in caplog.records if r.name == "ctxreplay"]
    assert len(lines) == 1 and lines[0].startswith("save_all: 4 of 4 captures written")


def test_load_and_install_say_what_they_bound(tmp_path: Path,
                                              caplog: pytest.LogCaptureFixture) -> None:
    report = _session(2).finalize()
    report.save_all(tmp_path)
    with caplog.at_level(logging.INFO, logger="ctxreplay"):
        loaded = ctxreplay.load(tmp_path)
        one = ctxreplay.load(tmp_path / "000-blocks.0-v0.pt2")
    lines = [r.getMessage() for r in caplog.records if r.name == "ctxreplay"]
    assert lines == [f"load: {tmp_path}: 2 captures (2 ok) for 1 members",
                     f"load: {tmp_path / '000-blocks.0-v0.pt2'}: blocks.0#0 (ok) for blocks.0"]
    assert isinstance(loaded, ctxreplay.LoadedManifest) and len(loaded) == 2
    assert isinstance(one, ctxreplay.LoadedCapture)
    caplog.clear()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)).eval()
    model.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
    with caplog.at_level(logging.INFO, logger="ctxreplay"):
        handle = ctxreplay.install(model, loaded)
    handle.remove()
    lines = [r.getMessage() for r in caplog.records if r.name == "ctxreplay"]
    assert lines == ["install: 2 captures bound to 1 members of Sequential (blocks.0)"]
