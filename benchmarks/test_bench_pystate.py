"""What guarding the Python state a forward reaches costs per trace or check
run: ``pystate.reach`` (a walk that records every slot) plus ``restore`` on
a Wan 1.3B-shape transformer block (dim 1536, 12 heads, ffn 8960), against
the copy every run already makes (``isolate.isolated``'s view).  Target
<= 1x: the guard costs no more than the copy, itself small beside a trace
of the block (seconds).  Measured on the 2-core host: 0.55 ms (60 slots)
against 0.8 ms for the copy; 5.9 ms before torch's own tables of each
module (a dozen hook tables, mostly empty) were left out of the walk."""

from __future__ import annotations

from typing import Any

import pytest
from benchutil import fast, interleaved_medians, report

from ctxreplay.capture import isolate
from ctxreplay.capture.pystate import reach


def _wan_block() -> Any:
    wan = pytest.importorskip("diffusers.models.transformers.transformer_wan")
    return wan.WanTransformerBlock(dim=1536, ffn_dim=8960, num_heads=12,
                                   qk_norm="rms_norm_across_heads", cross_attn_norm=True,
                                   eps=1e-6)


def _copy(block: Any) -> None:
    isolate._copy(block)  # the view alone, without the guard isolated() adds


def test_reach_and_restore_vs_the_isolated_copy(benchmark: Any,
                                                request: pytest.FixtureRequest) -> None:
    block = _wan_block()
    rounds = 3 if fast(request.config) else 15
    med = interleaved_medians({"guard": lambda: reach(block).restore(),
                               "copy": lambda: _copy(block)}, number=3, rounds=rounds)
    slots = len(reach(block).slots)
    benchmark.extra_info.update({"guard_ms": med["guard"] * 1e3, "copy_ms": med["copy"] * 1e3,
                                 "slots": slots})
    benchmark.pedantic(lambda: reach(block).restore(), rounds=1, iterations=1)
    ratio = med["guard"] / med["copy"]
    report("python-state guard / isolated copy (Wan 1.3B block)", ratio, "<= 1",
           f"guard {med['guard'] * 1e3:.2f} ms ({slots} slots), copy {med['copy'] * 1e3:.1f} ms")
    assert ratio <= 1.0
