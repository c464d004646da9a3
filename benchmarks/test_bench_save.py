"""Artifact work at the cost of the capture: ``report.save_all(dir)`` of N
captures beside the ``finalize()`` that made them, in the same run, round by
round.  Target <= 1.0x, at each verification level.  The files hold the
programs finalize() checked, so each is written (``torch.export.save``),
read back (``Pt2Format.reload``: torch's archive reader and deserialiser)
and compared with the checked program by its graph and weights; none is
run.  The collector is held off while each is written and read
(``saving.collector_paused``).

N = 8 variants of a TinyDiT block, live under CPU bfloat16 autocast and
inference mode, replay embedded (the programs hold ``wrap_with_autocast``).
Speed is printed, never asserted.
"""

from __future__ import annotations

import statistics
import tempfile
import time
import warnings
from typing import Any

import pytest
import torch
from benchutil import fast, report

import ctxreplay
from ctxreplay.demo import TinyDiT

DIM = 32
SHAPES = tuple((1, n) for n in (4, 6, 8, 10, 12, 14, 16, 18))


def _session(model: TinyDiT, shapes: tuple[tuple[int, int], ...],
             verify: str) -> ctxreplay.CaptureSession:
    # one capture per size (fold=False): save_all's cost per capture
    session = ctxreplay.capture_with(model, targets="repeated", backend="export",
                                     verify=verify, max_variants=len(shapes), fold=False)
    with session, torch.autocast("cpu", dtype=torch.bfloat16), torch.inference_mode():
        for b, t in shapes:
            model(torch.rand(b, t, DIM), torch.full((b,), 500.0))
    return session


@pytest.mark.parametrize("verify", ["signature", "execute"])
def test_save_all_vs_finalize(benchmark: Any, request: pytest.FixtureRequest,
                              verify: str) -> None:
    warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
    torch.manual_seed(0)
    model = TinyDiT(DIM, depth=2).eval()
    shapes = SHAPES[:2] if fast(request.config) else SHAPES
    rounds = 1 if fast(request.config) else 3

    def measure() -> tuple[float, float, int]:
        finals, saves = [], []
        n = 0
        for _ in range(rounds):
            session = _session(model, shapes, verify)
            t0 = time.perf_counter()
            rep = session.finalize()
            finals.append(time.perf_counter() - t0)
            assert rep.ok and len(rep.captures) == len(shapes), rep.problems
            with tempfile.TemporaryDirectory() as tmp:
                t0 = time.perf_counter()
                written = rep.save_all(tmp)
                saves.append(time.perf_counter() - t0)
            assert written.ok and len(written.saved) == len(shapes)
            # the files hold the programs finalize() checked: compared graph
            # to graph, at whichever level that check ran
            assert all(s.fidelity.checked == ("graph",) and not s.lowered
                       for s in written.saved)
            n = len(rep.captures)
        return statistics.median(saves), statistics.median(finals), n

    saves, finals, n = benchmark.pedantic(measure, rounds=1, iterations=1)
    ratio = saves / finals
    benchmark.extra_info["save_all_to_finalize_ratio"] = ratio
    report(f"save_all/finalize ratio [verify={verify}, {n} captures]", ratio, "<= 1.0",
           f"save_all {saves * 1e3:.0f} ms, finalize {finals * 1e3:.0f} ms")
    assert ratio > 0
