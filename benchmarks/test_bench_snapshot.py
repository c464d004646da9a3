"""How much a snapshot of the default probes costs next to torch's own
``GlobalStateGuard()`` (DESIGN.md facts 8 and 14: target <= 5x).

Two snapshots are measured: ``ctxreplay.snapshot()``, which re-checks every
watched getter on each call (the per-backend ``fp32_precision`` pairs among
them: nine pybind reads, ~0.1 us each, no bulk getter in torch), and the
cached check an open session makes on every observed call, which leaves the
numerics-only getters to once per call of the whole model.

``make bench`` runs these with pytest-benchmark; under ``--benchmark-disable``
each benchmark runs once, so the suite stays fast.  Speed is printed, never
asserted.
"""

from __future__ import annotations

import statistics
import timeit
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import pytest
import torch
from torch._C._dynamo.guards import GlobalStateGuard

import ctxreplay

AMBIENT: dict[str, Callable[[], AbstractContextManager[Any]]] = {
    "neutral": nullcontext,
    "cpu-bf16-autocast": lambda: torch.autocast("cpu", dtype=torch.bfloat16),
}


@pytest.fixture(params=sorted(AMBIENT))
def ambient(request: pytest.FixtureRequest) -> Iterator[str]:
    with AMBIENT[request.param]():
        yield request.param


def test_bench_snapshot(benchmark: Any, ambient: str) -> None:
    expected = ctxreplay.snapshot(ctxreplay.probes.default_probes())  # fresh, uncached
    snap = benchmark(ctxreplay.snapshot)
    assert snap == expected
    assert bool(snap["autocast"].enabled) == (ambient != "neutral")


def test_bench_snapshot_uncached(benchmark: Any, ambient: str) -> None:
    names = ctxreplay.probes.default_probes()
    snap = benchmark(ctxreplay.snapshot, names)  # a new observer each call: no cache
    assert snap == ctxreplay.snapshot()


def test_bench_global_state_guard(benchmark: Any, ambient: str) -> None:
    guard = benchmark(GlobalStateGuard)
    assert guard.check()


def _median_per_call(timers: dict[str, timeit.Timer], number: int,
                     rounds: int) -> dict[str, float]:
    samples: dict[str, list[float]] = {k: [] for k in timers}
    for _ in range(rounds):  # interleaved, so drift affects both alike
        for k, t in timers.items():
            samples[k].append(t.timeit(number) / number)
    return {k: statistics.median(v) for k, v in samples.items()}


def _session_check(model: torch.nn.Module
                   ) -> tuple[Callable[[], bool], ctxreplay.CaptureSession]:
    """The snapshot check an observed call makes (``observe._Member.forward``):
    the guard and the per-call watched getters against what they returned
    (all of them: a call whose inputs passed a ``TensorGuards`` check skips
    the inference-mode getter too)."""
    session = ctxreplay.capture_with(model)
    observer = session._observer
    model(torch.zeros(2, 4))
    cache = observer.cache
    assert cache is not None
    check = cache.check  # the guard's, then the per-call watched getters'
    assert check()
    return check, session


def test_snapshot_to_guard_ratio(benchmark: Any, ambient: str) -> None:
    """Side by side, interleaved: the ratio is what matters, not either time.
    Runs through ``benchmark.pedantic`` (once) so ``--benchmark-only`` keeps it."""
    ctxreplay.snapshot()  # warm the cached observer
    check, session = _session_check(torch.nn.Linear(4, 4))
    timers = {"snapshot": timeit.Timer(ctxreplay.snapshot),
              "per_call": timeit.Timer(check),
              "guard": timeit.Timer(GlobalStateGuard)}
    medians = benchmark.pedantic(_median_per_call, args=(timers, 2000, 15),
                                 rounds=1, iterations=1)
    assert session.finalize().ok
    ratio = medians["snapshot"] / medians["guard"]
    per_call = medians["per_call"] / medians["guard"]
    benchmark.extra_info["snapshot_to_guard_ratio"] = ratio
    benchmark.extra_info["per_call_snapshot_to_guard_ratio"] = per_call
    print(f"\n[{ambient}] snapshot/GlobalStateGuard ratio: {ratio:.2f} (target <= 5); "
          f"snapshot {medians['snapshot'] * 1e6:.3f} us, "
          f"GlobalStateGuard {medians['guard'] * 1e6:.3f} us; "
          f"a session's per-call check/GlobalStateGuard: {per_call:.2f} "
          f"({medians['per_call'] * 1e6:.3f} us)")
    assert ratio > 0 and per_call > 0  # measured and printed; speed is not asserted
