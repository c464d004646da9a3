"""A distributed finalize: 8 distinct variants observed on every rank of a 2-
and a 4-rank gloo job.  Reported beside the single-process finalize of the
same variants, measured in the same run: total backend calls across ranks
(must equal the number of variants), per-rank finalize time, and the merged
report's size.  Every process warms torch.export up first; on a machine
with fewer cores than ranks the ranks share them, which the times show.
Under ``--benchmark-disable`` (make test) the job is 2 ranks and 2
variants, so the file runs in seconds and cannot rot."""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from benchutil import fast, report
from torch import nn

import ctxreplay
from ctxreplay.backends import ExportBackend

# one worker runs every spawned multi-rank job (tests/distributed/test_distributed.py too),
# so two of them never compete for the cores under pytest-xdist
pytestmark = [pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                 reason="platform limit: torch built without gloo"),
              pytest.mark.xdist_group("spawned_ranks")]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(self.lin(x))


class Counting(ExportBackend):
    name = "counting"

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def capture(self, module: nn.Module, args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> Any:
        self.calls += 1
        return super().capture(module, args, kwargs)


def _warm() -> None:
    """torch.export's first call in a process imports and builds a lot: paid
    once per process, before either side is timed."""
    torch.export.export(Block().eval(), (torch.rand(1, 16),))


def _session(variants: int) -> tuple[ctxreplay.CaptureSession, Counting]:
    torch.manual_seed(0)
    model = Block().eval()
    backend = Counting()
    with ctxreplay.capture_with(model, backend=backend, max_variants=variants) as session:
        for b in range(1, variants + 1):
            model(torch.rand(b, 16))
    return session, backend


def _rank(rank: int, world: int, port: int, variants: int, out: str) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    _warm()
    session, backend = _session(variants)
    t0 = time.perf_counter()
    rep = session.finalize()
    seconds = time.perf_counter() - t0
    size = len(json.dumps(rep.to_json()))
    Path(out, f"{rank}.json").write_text(json.dumps(
        {"seconds": seconds, "calls": backend.calls, "size": size, "ok": rep.ok,
         "captures": len(rep.captures)}))
    dist.barrier()  # every rank done before any leaves (gloo aborts a rank whose peer exits)
    dist.destroy_process_group()


#: how long a job's ranks may take, and how long a rank that reported may
#: take to leave
_JOB_TIMEOUT, _TEARDOWN_GRACE = 300.0, 30.0


def _job(world: int, variants: int, out: Path) -> list[dict[str, Any]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    # a forkserver that imported torch once starts each rank without its imports
    mp.set_forkserver_preload(["torch", "torch.distributed", "ctxreplay"])
    ranks = mp.start_processes(_rank, args=(world, port, variants, str(out)), nprocs=world,
                               join=False, start_method="forkserver")
    files = [out / f"{r}.json" for r in range(world)]
    deadline, reported = time.monotonic() + _JOB_TIMEOUT, None
    # a rank's failure raises from join(); gloo's teardown of a rank whose
    # peers already left can hang in destroy_process_group(), after the rank
    # wrote what it measured: such a rank is stopped after a grace period
    while not ranks.join(timeout=1.0):
        now = time.monotonic()
        if reported is None and all(f.exists() for f in files):
            reported = now
        if now > deadline or (reported is not None and now - reported > _TEARDOWN_GRACE):
            for proc in ranks.processes:
                if proc.is_alive():
                    proc.kill()
            break
    assert all(f.exists() for f in files), f"ranks did not report within {_JOB_TIMEOUT} s"
    return [json.loads(f.read_text()) for f in files]


@pytest.mark.parametrize("world", [2, 4])
def test_distributed_finalize(benchmark: Any, request: pytest.FixtureRequest,
                              tmp_path: Path, world: int) -> None:
    quick = fast(request.config)
    variants = 2 if quick else 8  # fast mode (--benchmark-disable): a smaller job

    def measure() -> tuple[list[dict[str, Any]], float, int]:
        ranks = _job(world, variants, tmp_path)
        _warm()
        session, _ = _session(variants)
        t0 = time.perf_counter()
        single = session.finalize()
        one = time.perf_counter() - t0
        return ranks, one, len(json.dumps(single.to_json()))

    ranks, one, one_size = benchmark.pedantic(measure, rounds=1, iterations=1)
    calls = sum(r["calls"] for r in ranks)
    assert calls == variants and all(r["ok"] and r["captures"] == variants for r in ranks)
    slowest = max(r["seconds"] for r in ranks)
    report(f"[{world} ranks, {variants} variants] backend calls / variants", calls / variants,
           "== 1.0")
    report(f"[{world} ranks] slowest rank's finalize / single-process finalize",
           slowest / one, "informational",
           "per rank: " + ", ".join(f"{r['seconds']:.2f} s" for r in ranks)
           + f"; single process {one:.2f} s")
    report(f"[{world} ranks] merged report size / single-process report size",
           ranks[0]["size"] / one_size, "informational",
           f"{ranks[0]['size']} vs {one_size} bytes")
