"""Memory (target 5): an open session retains no tensor storage, and its
bookkeeping grows with variants, not calls (tracemalloc over 1,000,000 calls
of one variant under ``make bench``; 20,000 in fast mode)."""

from __future__ import annotations

import gc
import tracemalloc
import weakref
from typing import Any

import pytest
import torch
from benchutil import fast, report
from torch import nn

import ctxreplay


class Tiny(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1


class Holder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Tiny(), Tiny()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def test_no_tensor_retained_and_constant_bookkeeping(benchmark: Any,
                                                     request: pytest.FixtureRequest) -> None:
    calls = 20_000 if fast(request.config) else 1_000_000
    model = Holder()
    x = torch.zeros(2)
    session = ctxreplay.capture_with(model, targets="repeated")
    try:
        probe_in, probe_out = torch.rand(3), None
        out = model(probe_in)
        refs = [weakref.ref(probe_in), weakref.ref(out)]
        del probe_in, out, probe_out
        gc.collect()
        assert all(r() is None for r in refs), "the session kept a live tensor"

        def run() -> tuple[int, int]:
            with torch.no_grad():
                for _ in range(1_000):
                    model(x)
            gc.collect()
            tracemalloc.start()
            try:
                before = tracemalloc.take_snapshot()
                with torch.no_grad():
                    for _ in range(calls):
                        model(x)
                gc.collect()
                after = tracemalloc.take_snapshot()
            finally:
                tracemalloc.stop()
            growth = sum(s.size_diff for s in after.compare_to(before, "filename"))
            return growth, calls

        growth, n = benchmark.pedantic(run, rounds=1, iterations=1)
    finally:
        session.close()
    rep = session.finalize()
    # two blocks per model call: the warm-up, the measured calls and the probe call
    assert sum(c.calls for c in rep.captures) == 2 * (n + 1_000 + 1)
    assert growth < 64 * 1024, f"session bookkeeping grew by {growth} bytes over {n} calls"
    report(f"session memory growth over {n} calls of one variant (bytes)", float(growth),
           "constant (< 64 KiB)")
