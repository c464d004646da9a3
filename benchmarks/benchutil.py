"""Shared pieces of the benchmarks: interleaved medians and the fast mode.

Every ratio is measured side by side in one run, interleaved round by
round, so machine drift hits both sides alike (these machines are noisy).
Under ``--benchmark-disable`` (what ``make test`` and CI use) the workloads
shrink so the files run in seconds and cannot rot.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn


def fast(config: pytest.Config) -> bool:
    return bool(config.getoption("benchmark_disable", False))


def interleaved_samples(fns: dict[str, Callable[[], Any]], *, number: int,
                        rounds: int, warm: int = 1) -> dict[str, list[float]]:
    """Seconds per call of each function in every round, the functions
    measured in alternation (round ``i`` of each is timed back to back)."""
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for f in fns.values():
        for _ in range(warm):
            f()
    for _ in range(rounds):
        for k, f in fns.items():
            t0 = time.perf_counter()
            for _ in range(number):
                f()
            samples[k].append((time.perf_counter() - t0) / number)
    return samples


def interleaved_medians(fns: dict[str, Callable[[], Any]], *, number: int,
                        rounds: int) -> dict[str, float]:
    """Median seconds per call of each function, measured in alternation."""
    samples = interleaved_samples(fns, number=number, rounds=rounds)
    return {k: statistics.median(v) for k, v in samples.items()}


def paired_overheads(samples: dict[str, list[float]], base: str) -> dict[str, float]:
    """The median over rounds of each function's time minus ``base``'s in the
    same round: what drift shared by one round (another job on the host, the
    clock) adds to both sides cancels there, as it cannot between medians
    taken separately."""
    return {k: statistics.median(t - b for t, b in zip(v, samples[base]))
            for k, v in samples.items()}


def _noop_pre(module: nn.Module, args: Any, kwargs: Any) -> None:
    return None


def _noop_post(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
    return None


def add_hook_pair(module: nn.Module) -> list[Any]:
    """A no-op forward pre + post hook pair (with kwargs) on ``module``: the
    yardstick every per-call cost is reported against.  Returns the handles."""
    return [module.register_forward_pre_hook(_noop_pre, with_kwargs=True),
            module.register_forward_hook(_noop_post, with_kwargs=True)]


def per_block_medians(benchmark: Any, fns: dict[str, Callable[[], Any]], n_blocks: int, *,
                      number: int, rounds: int) -> dict[str, float]:
    """Interleaved medians of ``fns`` under pytest-benchmark, in microseconds
    per block call (each function runs ``n_blocks`` block calls)."""
    med = benchmark.pedantic(interleaved_medians, args=(fns,),
                             kwargs={"number": number, "rounds": rounds},
                             rounds=1, iterations=1)
    return {k: v / n_blocks * 1e6 for k, v in med.items()}


def report(name: str, ratio: float, target: str, detail: str = "") -> None:
    print(f"\n{name}: {ratio:.2f} (target {target}){'; ' + detail if detail else ''}")


class Stack(nn.Module):
    """``n`` small identical blocks in a ModuleList."""

    def __init__(self, n: int = 16, dim: int = 32) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(dim, dim) for _ in range(n)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


class one_thread:
    """torch.set_num_threads(1) for the block, restored after."""

    def __enter__(self) -> None:
        self.before = torch.get_num_threads()
        torch.set_num_threads(1)

    def __exit__(self, *exc: object) -> None:
        torch.set_num_threads(self.before)
