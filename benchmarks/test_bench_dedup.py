"""Deduplication (target 4): exactly one backend call per distinct
(structure, input signature, snapshot); 48 identical blocks cost one capture
per variant, not 48."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from benchutil import Stack, report

import ctxreplay
from ctxreplay.backends import ExportBackend


class CountingExport(ExportBackend):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def capture(self, module: torch.nn.Module, args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> Any:
        self.calls += 1
        return super().capture(module, args, kwargs)


def test_one_backend_call_per_distinct_variant(benchmark: Any,
                                               request: pytest.FixtureRequest) -> None:
    model = Stack(48, 16)
    backend = CountingExport()

    def run() -> ctxreplay.CaptureReport:
        backend.calls = 0
        # no_grad: otherwise blocks 2..48 also differ from block 1 by requires_grad
        with ctxreplay.capture_with(model, targets="repeated", backend=backend) as s, \
                torch.no_grad():
            for batch in (2, 4):  # two input signatures ...
                model(torch.rand(batch, 16))
                with torch.autocast("cpu", dtype=torch.bfloat16):  # ... times two contexts
                    model(torch.rand(batch, 16))
        return s.finalize()

    rep = benchmark.pedantic(run, rounds=1, iterations=1)
    # fp32 inputs under fp32 and under bf16 autocast; inside autocast, blocks
    # 2..48 receive bf16 activations: a third signature per batch size.
    distinct = {(c.signature, c.snapshot) for c in rep.captures}
    assert len(rep.captures) == len(distinct) == backend.calls == 6
    assert sum(c.calls for c in rep.captures) == 48 * 4
    report("backend calls per distinct variant", backend.calls / len(distinct), "== 1",
           f"{backend.calls} backend calls for {48 * 4} block calls")
