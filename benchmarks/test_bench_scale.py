"""Scale (target 6): attaching to a model with 1,000 hooked blocks takes time
linear in blocks, and per-call cost does not grow with the number of hooked
modules or variants (10 / 100 / 1,000)."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from benchutil import Stack, fast, interleaved_medians, one_thread, report
from torch import nn

import ctxreplay

SIZES = (10, 100, 1000)


def test_attach_time_linear_in_blocks(benchmark: Any, request: pytest.FixtureRequest) -> None:
    repeats = 1 if fast(request.config) else 5

    def measure() -> dict[int, float]:
        ctxreplay.capture_with(Stack(2, 4), targets="repeated").close()  # first-use costs
        per_block = {}
        for n in SIZES:
            model = Stack(n, 4)
            best = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                session = ctxreplay.capture_with(model, targets="repeated")
                best = min(best, time.perf_counter() - t0)
                session.close()
            per_block[n] = best / n
        return per_block

    per_block = benchmark.pedantic(measure, rounds=1, iterations=1)
    ratio = per_block[1000] / per_block[10]
    report("attach time per block, 1000 vs 10 blocks", ratio, "~1 (linear)",
           ", ".join(f"{n}: {t * 1e6:.1f} us/block" for n, t in per_block.items()))


class Wide(nn.Module):
    """One block that is called, beside ``n`` hooked siblings that are not."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(n)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[0](x)


def test_per_call_cost_flat_in_hooked_modules_and_variants(
        benchmark: Any, request: pytest.FixtureRequest) -> None:
    number, rounds = (200, 3) if fast(request.config) else (2000, 15)

    def measure() -> dict[str, float]:
        fns = {}
        sessions = []
        for n in SIZES:
            model = Wide(n)
            sessions.append(ctxreplay.capture_with(model, targets="repeated",
                                                   max_variants=16))
            x = torch.rand(2, 8)
            fns[f"{n} hooked"] = (lambda m=model, x=x: m(x))
        many = Wide(10)
        sessions.append(ctxreplay.capture_with(many, targets="repeated", max_variants=16))
        xs = [torch.rand(b, 8) for b in range(1, 9)]
        for x in xs:  # 8 variants already in the table
            many(x)
        fns["10 hooked, 8 variants"] = lambda: many(xs[3])
        try:
            with one_thread(), torch.no_grad():
                return interleaved_medians(fns, number=number, rounds=rounds)
        finally:
            for s in sessions:
                s.close()

    med = benchmark.pedantic(measure, rounds=1, iterations=1)
    ratio = med["1000 hooked"] / med["10 hooked"]
    report("per-call cost, 1000 vs 10 hooked modules", ratio, "~1 (flat)",
           ", ".join(f"{k}: {v * 1e6:.2f} us" for k, v in med.items()))
    report("per-call cost, 8 variants vs 1", med["10 hooked, 8 variants"] / med["10 hooked"],
           "~1 (flat)")
