"""Finalize overhead (target 3): total finalize time for N variants vs calling
``torch.export.export`` directly on the same N (module, inputs) pairs under
the same contexts, from the same caller.  Target <= 1.05x.

finalize() traces in a worker thread with a shallow stack (torch walks the
whole Python stack at every traced node), so a direct export made from a
deep stack (this test runner's) pays for frames finalize() does not.  The
second figure printed holds finalize() to direct exports made on a fresh
thread too, the same shallow stack: what ctxreplay itself adds."""

from __future__ import annotations

import statistics
import threading
import time
import warnings
from typing import Any

import pytest
import torch
from benchutil import fast, report

import ctxreplay
from ctxreplay.demo import TinyDiT

SHAPES = ((1, 16), (2, 32), (1, 8))


def _live(model: torch.nn.Module, dim: int, **kw: Any) -> ctxreplay.CaptureSession:
    session = ctxreplay.capture_with(model, targets="repeated", backend="export", **kw)
    with session, torch.autocast("cpu", dtype=torch.bfloat16), torch.inference_mode():
        for b, t in SHAPES:
            model(torch.rand(b, t, dim), torch.full((b,), 500.0))
    return session


def _direct(model: TinyDiT, dim: int) -> float:
    """What a user would do by hand: the same block, the same inputs, the
    same ambient contexts, one torch.export.export per variant."""
    block = model.blocks[0]
    pairs = [(torch.rand(b, t, dim, dtype=torch.bfloat16),
              torch.rand(b, dim, dtype=torch.bfloat16)) for b, t in SHAPES]
    t0 = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.inference_mode():
        for x, c in pairs:
            torch.export.export(block, (x, c))
    return time.perf_counter() - t0


def _direct_shallow(model: TinyDiT, dim: int) -> float:
    """The same, on a fresh thread: a stack as shallow as finalize()'s trace."""
    box: list[float] = []
    worker = threading.Thread(target=lambda: box.append(_direct(model, dim)))
    worker.start()
    worker.join()
    return box[0]


@pytest.mark.parametrize("replay", ["embedded", "ambient"])
def test_finalize_vs_direct_export(benchmark: Any, request: pytest.FixtureRequest,
                                   replay: str) -> None:
    warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
    dim = 64
    torch.manual_seed(0)
    model = TinyDiT(dim, depth=4).eval()
    rounds = 1 if fast(request.config) else 7

    def measure() -> tuple[float, float, float, int]:
        ours, theirs, shallow = [], [], []
        n = 0
        for _ in range(rounds):
            session = _live(model, dim, replay=replay, verify="signature")
            t0 = time.perf_counter()
            rep = session.finalize()
            ours.append(time.perf_counter() - t0)
            theirs.append(_direct(model, dim))
            shallow.append(_direct_shallow(model, dim))
            assert rep.ok and len(rep.captures) == len(SHAPES)
            n = len(rep.captures)
        return (statistics.median(ours), statistics.median(theirs),
                statistics.median(shallow), n)

    ours, theirs, shallow, n = benchmark.pedantic(measure, rounds=1, iterations=1)
    ratio = ours / theirs
    benchmark.extra_info["finalize_to_export_ratio"] = ratio
    benchmark.extra_info["finalize_to_shallow_export_ratio"] = ours / shallow
    report(f"finalize/direct torch.export ratio [{replay}, {n} variants]", ratio, "<= 1.05",
           f"finalize {ours * 1e3:.0f} ms, direct export {theirs * 1e3:.0f} ms")
    report(f"finalize/direct torch.export on a fresh thread [{replay}, {n} variants]",
           ours / shallow, "none, a reference", f"direct export {shallow * 1e3:.0f} ms")
