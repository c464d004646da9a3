"""Per-call cost of an open capture session on the live forward.

A stack of 16 ``Linear(32)`` blocks, one thread, three configurations built
from the same weights and measured in the same run:

* ``bare``     -- nothing attached;
* ``hooks``    -- a no-op forward pre-hook + forward hook pair (with kwargs)
  on every block: the cheapest thing a profiling tool could do instead;
* ``session``  -- ``capture_with(stack, targets="repeated")`` with the
  default probes, left open.

The overhead per block call is ``(t - t_bare) / 16``.  Speed is printed,
never asserted: these numbers depend on the machine.
Run with ``pytest benchmarks --benchmark-only`` (or ``--benchmark-disable``
for a quick smoke run).
"""

from __future__ import annotations

import copy
import statistics
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from benchutil import add_hook_pair, interleaved_samples, paired_overheads
from torch import nn

import ctxreplay

N_BLOCKS = 16
DIM = 32
BATCH = 4
CONFIGS = ("bare", "hooks", "session")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class BlockStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(N_BLOCKS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


class Setup:
    """The three configurations, attached; ``close()`` detaches them."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        base = BlockStack().eval()
        self.models = {name: copy.deepcopy(base) for name in CONFIGS}
        self.handles = []
        for b in self.models["hooks"].blocks:
            self.handles.extend(add_hook_pair(b))
        self.session = ctxreplay.capture_with(self.models["session"], targets="repeated",
                                              backend="export")
        self.x = torch.rand(BATCH, DIM)

    def call(self, name: str) -> Callable[[], torch.Tensor]:
        model, x = self.models[name], self.x
        return lambda: model(x)

    def close(self) -> ctxreplay.CaptureReport:
        for h in self.handles:
            h.remove()
        return self.session.finalize()


@pytest.fixture
def setup() -> Iterator[Setup]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    s = Setup()
    try:
        with torch.no_grad():
            yield s
    finally:
        report = s.close()
        torch.set_num_threads(threads)
    # whatever the session saw was one variant, captured faithfully (a test
    # that ran only the other configurations observed nothing)
    assert len(report.captures) <= 1, report.failures
    assert report.ok or [p.reason for p in report.problems] == ["nothing_observed"]
    assert all(c.calls % N_BLOCKS == 0 for c in report.captures)


def test_outputs_agree(setup: Setup) -> None:
    outs = [setup.call(name)() for name in CONFIGS]
    assert all(torch.equal(outs[0], o) for o in outs[1:])


@pytest.mark.parametrize("config", CONFIGS)
def test_forward(benchmark: Any, setup: Setup, config: str) -> None:
    benchmark.group = f"{N_BLOCKS} x Linear({DIM}), one thread"
    benchmark.extra_info["blocks"] = N_BLOCKS
    benchmark(setup.call(config))


def test_overhead_ratio_interleaved(benchmark: Any, setup: Setup,
                                    request: pytest.FixtureRequest) -> None:
    """Through ``benchmark.pedantic`` (once) so ``make bench`` (--benchmark-only)
    runs and prints it too.  The ratio is of per-round overheads (each
    configuration minus the bare forward timed beside it), medians over
    rounds; the ratio of the separate medians is printed beside it."""
    quick = bool(request.config.getoption("benchmark_disable", default=False))
    number, rounds = (50, 7) if quick else (300, 61)
    calls = {name: setup.call(name) for name in CONFIGS}
    samples = benchmark.pedantic(interleaved_samples, args=(calls,),
                                 kwargs={"number": number, "rounds": rounds, "warm": 20},
                                 rounds=1, iterations=1)
    med = {name: statistics.median(v) for name, v in samples.items()}
    over = paired_overheads(samples, "bare")
    per_block = {name: over[name] / N_BLOCKS * 1e6 for name in CONFIGS}
    ratio = per_block["session"] / per_block["hooks"] if per_block["hooks"] > 0 else float("nan")
    apart = ((med["session"] - med["bare"]) / (med["hooks"] - med["bare"])
             if med["hooks"] > med["bare"] else float("nan"))
    print()
    print(f"bare forward: {med['bare'] * 1e6:.1f} us ({med['bare'] / N_BLOCKS * 1e6:.2f} us "
          f"per block); overhead per block call: hook pair {per_block['hooks']:.2f} us, "
          f"session {per_block['session']:.2f} us")
    print(f"per-call overhead ratio session/hook-pair: {ratio:.2f} (target <= 0.8; "
          f"ratio of the separate medians {apart:.2f})")
