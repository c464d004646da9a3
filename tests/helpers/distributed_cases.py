"""Per-rank programs of tests/distributed/test_distributed.py (importable by spawned
processes).  Each rank writes what it saw to ``<out>/<rank>.json``: its
report document (``seconds`` fields dropped: timings differ), what it ran
live, and how many times its backend was called -- or the error it raised."""

from __future__ import annotations

import datetime
import gc
import json
import os
import sys
import time
import traceback
import weakref
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
from torch import nn

import ctxreplay
from ctxreplay.backends import ExportBackend

HERE = Path(__file__).resolve().parent


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x))


class Stack(nn.Module):
    def __init__(self, n: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


class ReduceBlock(nn.Module):
    """Sequence-parallel style: a functional all_reduce inside the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = fc.all_reduce(self.lin(x), "sum", dist.group.WORLD)
        return fc.wait_tensor(y) * 0.5


class Counting(ExportBackend):
    """torch.export, counting its calls."""

    name = "counting"

    def __init__(self, fail: bool = False) -> None:
        super().__init__()
        self.calls = 0
        self.fail = fail

    def capture(self, module: nn.Module, args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> Any:
        self.calls += 1
        if self.fail:
            raise RuntimeError("this rank's backend broke")
        return super().capture(module, args, kwargs)

    def capture_dynamic(self, module: nn.Module, args: tuple[Any, ...],
                        kwargs: dict[str, Any], dynamic_shapes: Any) -> Any:
        self.calls += 1  # a fold's trace
        return super().capture_dynamic(module, args, kwargs, dynamic_shapes)


def _doc(report: ctxreplay.CaptureReport) -> dict[str, Any]:
    doc = report.to_json()
    doc.pop("seconds")
    if doc.get("distributed"):
        doc["distributed"].pop("rank_seconds")
    for c in doc["captures"]:
        c.pop("seconds")
    return doc


def _setup(rank: int, world: int, port: int) -> None:
    sys.path.insert(0, str(HERE))
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)  # the same weights on every rank


def _live(model: Stack, rank: int) -> list[list[Any]]:
    """Overlapping but different input shapes and autocast states per rank;
    returns what ran: (batch, autocast) per model call."""
    ran = []
    for batch in range(1, 2 + rank % 3):
        model(torch.rand(batch, 8))
        ran.append([batch, False])
    if rank % 2:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(torch.rand(1, 8))
            model(torch.rand(1, 8))
        ran += [[1, True], [1, True]]
    return ran


def _teardown() -> None:
    """Every rank done before any leaves: rank 0 hosts the store, and a rank
    whose peer exits mid-teardown aborts in gloo ("terminate called without
    an active exception")."""
    dist.barrier()
    dist.destroy_process_group()


def overlap(rank: int, world: int, port: int, out: str) -> None:
    _setup(rank, world, port)
    model = Stack().eval()
    backend = Counting()
    with ctxreplay.capture_with(model, targets="repeated", backend=backend,
                                verify="execute") as session:
        ran = _live(model, rank)
    report = session.finalize()
    from metadata_check import assert_metadata_only

    assert_metadata_only(report.to_json())
    Path(out, f"{rank}.json").write_text(json.dumps(
        {"report": _doc(report), "ran": ran, "backend_calls": backend.calls}))
    _teardown()


def collective(rank: int, world: int, port: int, out: str) -> None:
    _setup(rank, world, port)
    model = ReduceBlock().eval()
    results = {}
    for label, replay in (("faithful", "embedded"), ("unreplayed", "off")):
        with ctxreplay.capture_with(model, backend="export", verify="execute",
                                    replay=replay) as session, \
                torch.autocast("cpu", dtype=torch.bfloat16):
            model(torch.rand(2, 8))
        results[label] = _doc(session.finalize())
    Path(out, f"{rank}.json").write_text(json.dumps(results))
    _teardown()


def releases_group(rank: int, world: int, port: int, out: str) -> None:
    """After a finalize, ``destroy_process_group()`` still frees the group:
    nothing keeps the process group object (its gloo threads and sockets)
    alive until the interpreter tears down."""
    _setup(rank, world, port)
    group = weakref.ref(dist.group.WORLD)
    model = Stack().eval()
    with ctxreplay.capture_with(model, targets="repeated", verify="execute") as session:
        model(torch.rand(1 + rank, 8))
    ok = session.finalize().ok
    _teardown()
    gc.collect()
    Path(out, f"{rank}.json").write_text(json.dumps({"ok": ok, "alive": group() is not None}))


def backend_raises(rank: int, world: int, port: int, out: str) -> None:
    _setup(rank, world, port)
    model = Stack().eval()
    backend = Counting(fail=rank == 1)
    with ctxreplay.capture_with(model, targets="repeated", backend=backend) as session:
        model(torch.rand(1, 8))
        model(torch.rand(2 + rank, 8))  # one variant each rank alone sees
    report = session.finalize()
    Path(out, f"{rank}.json").write_text(json.dumps({"report": _doc(report)}))
    _teardown()


def skips_finalize(rank: int, world: int, port: int, out: str) -> None:
    _setup(rank, world, port)
    model = Stack().eval()
    with ctxreplay.capture_with(model, targets="repeated", backend="export",
                                capture_timeout=3.0) as session:
        model(torch.rand(1, 8))
    result: dict[str, Any] = {}
    if rank == 1:
        time.sleep(8)  # never calls finalize(); stays alive past the others' timeout
    else:
        t0 = time.monotonic()
        try:
            session.finalize()
            result["error"] = None
        except ctxreplay.DistributedError as exc:
            result["error"] = str(exc)
            result["ranks"] = list(exc.ranks)
        except Exception:
            result["error"] = traceback.format_exc()
        result["waited"] = time.monotonic() - t0
    Path(out, f"{rank}.json").write_text(json.dumps(result))


def probes_differ(rank: int, world: int, port: int, out: str) -> None:
    _setup(rank, world, port)
    model = Stack().eval()
    probes = ["autocast", "grad_mode"] + (["default_dtype"] if rank == 1 else [])
    with ctxreplay.capture_with(model, targets="repeated", backend="export",
                                probes=probes) as session:
        model(torch.rand(1, 8))
    try:
        session.finalize()
        result: dict[str, Any] = {"error": None}
    except ctxreplay.DistributedError as exc:
        result = {"error": str(exc), "ranks": list(exc.ranks)}
    Path(out, f"{rank}.json").write_text(json.dumps(result))
    _teardown()


def save_all(rank: int, world: int, port: int, out: str) -> None:
    _setup(rank, world, port)
    model = Stack().eval()
    with ctxreplay.capture_with(model, targets="repeated", backend="export",
                                verify="execute") as session:
        _live(model, rank)
    report = session.finalize()
    saved = report.save_all(Path(out, "saved"))
    Path(out, f"{rank}.json").write_text(json.dumps({
        "report": _doc(report), "ok": saved.ok,
        "wrote": sorted(s.path.name for s in saved.saved),
        "elsewhere": [list(e) for e in saved.elsewhere],
        "manifest_there": saved.manifest.is_file()}))
    _teardown()


class SeqBlock(nn.Module):
    """A block over ``(batch, length, 8)``: its graph folds over lengths."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.lin(x), dim=1) * x.shape[1]


class SeqStack(nn.Module):
    def __init__(self, n: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(SeqBlock() for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


#: the lengths each rank runs: some only it sees, some every rank sees
def fold_lengths(rank: int) -> list[int]:
    return [4, 6, 8, 10 + 2 * rank, 13 + 2 * rank]


def folds_lengths(rank: int, world: int, port: int, out: str) -> None:
    """Each rank runs several lengths; every capture this rank holds is run
    again here, by value, at every length it stands for, with the weights
    of every block it covers, against the block itself."""
    _setup(rank, world, port)
    torch.manual_seed(0)
    model = SeqStack().eval()
    backend = Counting()
    with ctxreplay.capture_with(model, targets="repeated", backend=backend,
                                verify="execute") as session, torch.no_grad():
        for n in fold_lengths(rank):
            model(torch.rand(2, n, 8))
    report = session.finalize()
    every = sorted({n for r in range(world) for n in fold_lengths(r)})
    wrong, ran = [], []
    for c in report.captures:
        if c.rank != rank:
            continue  # its program stayed on the rank that made it
        program = c.artifact.module()
        for n in every:
            x = torch.rand(2, n, 8)
            shape = [list(x.shape)]
            if c.folding is None and list(next(c.signature.leaves())[1].shape) != shape[0]:
                continue
            if c.folding is not None and not c.folding.within(shape):
                continue
            for name in c.members:  # each block it stands for, with its own weights
                block = model.get_submodule(name)
                program.load_state_dict(block.state_dict())
                ran.append([c.variant, name, n])
                with torch.no_grad():
                    if not torch.equal(program(x), block(x)):
                        wrong.append([c.variant, name, n])
    Path(out, f"{rank}.json").write_text(json.dumps({
        "report": _doc(report), "backend_calls": backend.calls, "wrong": wrong,
        "ran": ran}))
    _teardown()


def folds_collectives(rank: int, world: int, port: int, out: str) -> None:
    """A block with an all_reduce at three lengths on every rank: its graph
    is not run alone to fold it (that would wait for the other ranks)."""
    _setup(rank, world, port)
    torch.manual_seed(0)
    model = ReduceBlock().eval()
    with ctxreplay.capture_with(model, backend="export", verify="execute") as session, \
            torch.no_grad():
        for n in (4, 6, 8):
            model(torch.rand(2, n, 8))
    Path(out, f"{rank}.json").write_text(json.dumps({"report": _doc(session.finalize())}))
    _teardown()


class ReduceWithList(nn.Module):
    """An all_reduce in a forward that takes a list: reads it, or appends to it."""

    def __init__(self, appends: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.appends = appends

    def forward(self, x: torch.Tensor, extra: list[Any]) -> torch.Tensor:
        y = fc.wait_tensor(fc.all_reduce(self.lin(x) + extra[0], "sum", dist.group.WORLD))
        if self.appends:
            extra.append(1)  # a Python-level change of the argument: no graph op
        return y * 0.5


def collective_arguments(rank: int, world: int, port: int, out: str) -> None:
    """Strict export traces with Dynamo, so only a run of the forward sees
    what it does to its arguments; a graph holding collectives runs only
    with every rank."""
    _setup(rank, world, port)
    results = {}
    for label, appends, verify in (("reads", False, "execute"), ("appends", True, "execute"),
                                   ("appends_signature", True, "signature")):
        torch.manual_seed(0)
        model = ReduceWithList(appends).eval()
        with ctxreplay.capture_with(model, backend=ExportBackend(strict=True),
                                    verify=verify) as session, torch.no_grad():
            model(torch.rand(2, 8), [torch.rand(2, 8)])
        results[label] = _doc(session.finalize())
    Path(out, f"{rank}.json").write_text(json.dumps(results))
    _teardown()


class ReduceKeepsAverage(nn.Module):
    """An all_reduce in a forward that also updates a frozen parameter in place."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.avg = nn.Parameter(torch.zeros(8), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.avg.mul_(0.5).add_(x.mean(0))
        y = fc.wait_tensor(fc.all_reduce(self.lin(x), "sum", dist.group.WORLD))
        return y + self.avg


def collective_weights(rank: int, world: int, port: int, out: str) -> None:
    """The ranks' run together of a graph holding collectives leaves every
    rank's live weights as they were."""
    _setup(rank, world, port)
    torch.manual_seed(0)
    model = ReduceKeepsAverage().eval()
    with ctxreplay.capture_with(model, backend="export", verify="execute") as session, \
            torch.no_grad():
        model(torch.ones(2, 8))
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    report = session.finalize()
    kept = all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    Path(out, f"{rank}.json").write_text(json.dumps({"report": _doc(report), "kept": kept}))
    _teardown()
