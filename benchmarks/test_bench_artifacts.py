"""Per-call cost of using captured artifacts, each beside its baseline in
the same run, interleaved round by round:

* the guard -- a loaded capture's ``guarded()`` call beside a bare call of
  the same program (``cap.module()``), one ``Linear(32)`` block;
* dispatch -- 16 ``Linear(32)`` blocks under ``ctxreplay.install``, beside
  the bare eager model (the program runs in place of the forward), next to
  the observation overhead of an open capture session beside the same.

One thread.  Speed is printed, never asserted.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from benchutil import Stack, fast, interleaved_medians, one_thread, per_block_medians, report
from torch import nn

import ctxreplay

N_BLOCKS = 16
DIM = 32


def _capture(model: nn.Module, x: torch.Tensor) -> ctxreplay.CaptureReport:
    with ctxreplay.capture_with(model, targets="repeated", backend="export") as session, \
            torch.no_grad():
        model(x)
    result = session.finalize()
    assert result.ok and len(result.captures) == 1
    return result


@pytest.fixture
def threads() -> Iterator[None]:
    with one_thread():
        yield


def test_guard_per_call_cost(benchmark: Any, tmp_path: Path, threads: None,
                             request: pytest.FixtureRequest) -> None:
    torch.manual_seed(0)
    model = Stack(n=2, dim=DIM).eval()
    x = torch.rand(4, DIM)
    _capture(model, x).save_all(tmp_path)
    loaded = ctxreplay.load(tmp_path)
    assert isinstance(loaded, ctxreplay.LoadedManifest)
    cap = loaded.captures[0]
    bare, guarded = cap.module(), cap.guarded()
    with torch.no_grad():
        assert torch.equal(bare(x), guarded(x))
        number, rounds = (200, 5) if fast(request.config) else (500, 151)
        med = benchmark.pedantic(
            interleaved_medians,
            args=({"bare": lambda: bare(x), "guarded": lambda: guarded(x)},),
            kwargs={"number": number, "rounds": rounds}, rounds=1, iterations=1)
        assert guarded.mismatches == 0  # every call took the fast path
    ratio = med["guarded"] / med["bare"]
    benchmark.extra_info["guard_ratio"] = ratio
    report("guarded call / bare call of the same program", ratio, "informational",
           f"bare {med['bare'] * 1e6:.2f} us, guard adds "
           f"{(med['guarded'] - med['bare']) * 1e6:.2f} us per call")
    assert ratio > 0


def test_dispatch_overhead_beside_observation(benchmark: Any, threads: None,
                                              request: pytest.FixtureRequest) -> None:
    """16 ``Linear(32)`` blocks installed, beside the bare eager model; an open
    session beside it too: what dispatching costs against what observing costs."""
    torch.manual_seed(0)
    base = Stack(n=N_BLOCKS, dim=DIM).eval()
    x = torch.rand(4, DIM)
    models = {k: copy.deepcopy(base) for k in ("bare", "observed", "installed")}
    captured = _capture(models["installed"], x)
    handle = ctxreplay.install(models["installed"], captured)
    session = ctxreplay.capture_with(models["observed"], targets="repeated", backend="export")
    try:
        with torch.no_grad():
            outs = {k: m(x) for k, m in models.items()}
            assert all(torch.equal(outs["bare"], o) for o in outs.values())
            number, rounds = (10, 3) if fast(request.config) else (20, 151)
            fns = {k: (lambda m=m: m(x)) for k, m in models.items()}
            per_block = per_block_medians(benchmark, fns, N_BLOCKS,
                                          number=number, rounds=rounds)
        stats = handle.stats()
        assert stats.total_misses == 0 and stats.total_hits >= N_BLOCKS
    finally:
        handle.remove()
        session.finalize()
    dispatch = per_block["installed"] - per_block["bare"]
    observe = per_block["observed"] - per_block["bare"]
    benchmark.extra_info.update(dispatch_us=dispatch, observe_us=observe)
    report("installed block call / bare eager block call", per_block["installed"] /
           per_block["bare"], "informational",
           f"dispatch adds {dispatch:+.2f} us to a bare block call "
           f"({per_block['bare']:.2f} us: the program runs in place of the forward); "
           f"observation adds {observe:.2f} us")
