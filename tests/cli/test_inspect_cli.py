"""``ctxreplay inspect`` of a saved capture says what the artifact carries and
what must be re-established where it runs, each probe once in words."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import ctxreplay
from ctxreplay.cli import main


def test_a_state_carried_in_part_is_named_in_part(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU()).eval()
    with ctxreplay.capture_with(model, verify="execute") as session, \
            torch.autocast("cpu", dtype=torch.bfloat16), torch.inference_mode():
        model(torch.rand(2, 8))
    report = session.finalize()
    (capture,) = report.captures
    # grad mode's grad-enabled flag is traced, inference mode is replayed around
    assert {"autocast", "grad_mode"} <= set(capture.embedded)
    assert capture.ambient_only == ("grad_mode",)
    capture.save(tmp_path / "lin.pt2")
    assert main(["inspect", str(tmp_path / "lin.pt2")]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    carried, _, needed = last.partition("; ")
    assert carried.startswith("carried by the artifact: ")
    assert "grad_mode (in part)" in carried.split(": ", 1)[1].split(", ")
    assert "autocast" in carried.split(": ", 1)[1].split(", ")
    assert needed == "to re-establish where it runs: grad_mode=inference_mode"
