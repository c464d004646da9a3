"""Per-rank programs of tests/distributed/test_parallel.py (importable by spawned
processes): models sharded, parallelised and sequence-parallel over 2 gloo
ranks, each rank writing what it saw to ``<out>/<rank>.json``.

The oracle is eager on the same rank: the model's own outputs for the same
calls, before ``install`` and after ``remove``."""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
from torch import nn

import ctxreplay

HERE = Path(__file__).resolve().parent
DIM, HEADS = 16, 4


def setup(rank: int, world: int, port: int) -> None:
    sys.path.insert(0, str(HERE))
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)  # the same weights on every rank


def teardown() -> None:
    """Every rank done before any leaves (rank 0 hosts the store)."""
    dist.barrier()
    dist.destroy_process_group()


@contextmanager
def written(out: str, rank: int) -> Iterator[dict[str, Any]]:
    """The dict a rank fills, written to ``<out>/<rank>.json`` -- with the
    traceback, should the rank raise."""
    result: dict[str, Any] = {}
    try:
        yield result
    except Exception:
        result["error"] = traceback.format_exc()
        raise
    finally:
        Path(out, f"{rank}.json").write_text(json.dumps(result))


def summary(report: ctxreplay.CaptureReport) -> dict[str, Any]:
    """What a test asserts of a report, metadata only."""
    return {"ok": report.ok,
            "captures": [{"scope": c.scope, "variant": c.variant, "rank": c.rank,
                          "backend": c.backend, "ok": c.fidelity.ok,
                          "checked": list(c.fidelity.checked), "collective": c.collective,
                          "members": list(c.members),
                          "mismatches": [repr(m) for m in c.fidelity.mismatches]}
                         for c in report.captures],
            "failures": [[f.scope, f.reason, f.exc_type, f.message] for f in report.failures],
            "problems": [p.message for p in report.problems]}


def stats(handle: Any) -> dict[str, Any]:
    s = handle.stats()
    return {"hits": sum(s.hits.values()), "misses": sum(s.misses.values()),
            "reasons": dict(s.reasons), "unusable": dict(s.unusable)}


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Bit-identical, dtype included."""
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y)
                                    for x, y in zip(a, b))


# -- sequence parallel: DeepSpeed-Ulysses attention ---------------------------

class UlyssesAttention(nn.Module):
    """Each rank holds ``length / world`` tokens of every head; an
    ``all_to_all_single`` gives it every token of ``HEADS / world`` heads
    for attention, and a second one puts the tokens back."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.out = nn.Linear(DIM, DIM)

    def _scatter_heads(self, t: torch.Tensor, world: int) -> torch.Tensor:
        b, s, h, d = t.shape  # s local tokens, h heads -> world * s tokens, h / world heads
        t = t.reshape(b, s, world, h // world, d).permute(2, 0, 1, 3, 4).contiguous()
        t = fc.wait_tensor(fc.all_to_all_single(t, None, None, dist.group.WORLD))
        return t.permute(1, 0, 2, 3, 4).reshape(b, world * s, h // world, d)

    def _gather_heads(self, t: torch.Tensor, world: int) -> torch.Tensor:
        b, n, hl, d = t.shape  # all tokens of hl heads -> n / world tokens, hl * world heads
        t = t.reshape(b, world, n // world, hl, d).permute(1, 0, 2, 3, 4).contiguous()
        t = fc.wait_tensor(fc.all_to_all_single(t, None, None, dist.group.WORLD))
        return t.permute(1, 2, 0, 3, 4).reshape(b, n // world, hl * world * d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        world = dist.get_world_size()
        b, s, _ = x.shape
        q, k, v = self.qkv(x).reshape(b, s, 3, HEADS, DIM // HEADS).unbind(2)
        q, k, v = (self._scatter_heads(t, world).transpose(1, 2) for t in (q, k, v))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(self._gather_heads(a.transpose(1, 2), world))


class SPStack(nn.Module):
    def __init__(self, n: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(UlyssesAttention() for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def _sp_calls(model: nn.Module, rank: int) -> list[torch.Tensor]:
    """bf16 autocast, two sequence lengths; each rank its own tokens."""
    g = torch.Generator().manual_seed(rank)
    outs = []
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        for local in (4, 6):
            outs.append(model(torch.rand(2, local, DIM, generator=g)))
    return outs


def sequence_parallel(rank: int, world: int, port: int, out: str) -> None:
    """Install from the merged in-process report, right after ``finalize()``."""
    setup(rank, world, port)
    with written(out, rank) as result:
        model = SPStack().eval()
        with ctxreplay.capture_with(model, targets="repeated", verify="execute") as session:
            eager = _sp_calls(model, rank)
        report = session.finalize()
        result["report"] = summary(report)
        with ctxreplay.install(model, report) as handle:
            installed = _sp_calls(model, rank)
        result["install"] = stats(handle)
        result["same"] = same(eager, installed)
        result["eager_again"] = same(eager, _sp_calls(model, rank))
    teardown()


# -- spawning ------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(case: Callable[..., None], world: int, out: Path, *, start_method: str,
              limit: float = 150.0) -> list[dict[str, Any]]:
    """``case`` on ``world`` ranks; each rank's JSON, in rank order.  A rank
    that does not finish within ``limit`` seconds is killed, and says so."""
    import torch.multiprocessing as mp

    ctx = mp.start_processes(case, args=(world, free_port(), str(out)), nprocs=world,
                             join=False, start_method=start_method)
    deadline = time.monotonic() + limit
    while True:
        try:
            if ctx.join(timeout=1.0):
                break
        except Exception as exc:  # a rank raised: its JSON holds the traceback
            docs = [Path(out, f"{r}.json") for r in range(world)]
            raise AssertionError("\n".join(d.read_text()[-3000:] for d in docs if d.is_file())
                                 or str(exc)) from None
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            raise AssertionError(f"{case.__name__} on {world} ranks did not finish "
                                 f"in {limit:g} s")
    return [json.loads(Path(out, f"{r}.json").read_text()) for r in range(world)]


# -- tensor parallel: DTensor, parallelize_module ------------------------------

class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, 4 * DIM)
        self.down = nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class MLPStack(nn.Module):
    def __init__(self, n: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MLP() for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def tp_model(world: int) -> MLPStack:
    """Each block's ``up`` column-wise and ``down`` row-wise parallel: the
    block's input and output are whole, an all_reduce inside ``down``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (world,))
    model = MLPStack().eval()
    for block in model.blocks:
        parallelize_module(block, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return model


class NormMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 4 * DIM)
        self.down = nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class NormMLPStack(MLPStack):
    def __init__(self, n: int = 3) -> None:
        super().__init__(n)
        self.blocks = nn.ModuleList(NormMLP() for _ in range(n))


def sp_model(world: int) -> MLPStack:
    """Sequence parallel norms: each block's ``norm`` runs on the rank's own
    shard of the sequence (``SequenceParallel``), ``up`` gathers the
    sequence and is column-wise parallel, ``down`` row-wise parallel and
    scatters the sequence again: the block's input and output are the
    rank's sequence shard."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (world,))
    model = NormMLPStack().eval()
    plan = {"norm": SequenceParallel(), "up": ColwiseParallel(input_layouts=Shard(1)),
            "down": RowwiseParallel(output_layouts=Shard(1))}
    for block in model.blocks:
        parallelize_module(block, mesh, plan)
    return model


def _tp_calls(model: nn.Module, seed: int = 7) -> list[torch.Tensor]:
    """The same input on every rank (tensor parallelism replicates it),
    unless ``seed`` differs by rank (a rank's own sequence shard)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(2, 5, DIM, generator=g)
    outs = []
    with torch.no_grad():
        outs.append(model(x))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        outs.append(model(x))
    return outs


def tensor_parallel(rank: int, world: int, port: int, out: str) -> None:
    setup(rank, world, port)
    with written(out, rank) as result:
        for plan, model, seed in (("tp", tp_model(world), 7), ("sp", sp_model(world), 7 + rank)):
            for verify in ("signature", "execute"):
                with ctxreplay.capture_with(model, targets="repeated", verify=verify) as session:
                    eager = _tp_calls(model, seed)
                report = session.finalize()
                doc = result[f"{plan}/{verify}"] = summary(report)
                with ctxreplay.install(model, report) as handle:
                    installed = _tp_calls(model, seed)
                doc["install"] = stats(handle)
                doc["same"] = same(eager, installed)
    teardown()


# -- FSDP2: fully_shard, with and without a mixed-precision policy -------------

class TransformerBlock(nn.Module):
    """Pre-norm attention and MLP: every parameter a block's own, so that
    ``fully_shard(block)`` holds them all."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.norm2 = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 4 * DIM)
        self.down = nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).reshape(b, s, 3, HEADS, DIM // HEADS) \
            .permute(2, 0, 3, 1, 4).unbind(0)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, DIM))
        return x + self.down(torch.relu(self.up(self.norm2(x))))


class Transformer(nn.Module):
    def __init__(self, n: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(TransformerBlock() for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def fsdp_model(world: int, bf16: bool) -> Transformer:
    """Each block ``fully_shard``-ed, then the root (the usual FSDP2 layout);
    ``bf16``: ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)``, FSDP
    gathering bf16 parameters and casting the block inputs to bf16."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (world,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None)
    model = Transformer().eval()
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def sharding(model: nn.Module, world: int) -> bool:
    """Every parameter is the DTensor shard FSDP holds between calls (the
    local shard a ``world``-th of the first dimension)."""
    from torch.distributed.tensor import DTensor

    return all(isinstance(p, DTensor) and p.to_local().shape[0] * world == p.shape[0]
               for p in model.parameters())


def _fsdp_calls(model: nn.Module, rank: int, world: int, shards: list[bool]
                ) -> list[torch.Tensor]:
    """Two sizes, each rank its own batch (data parallel); ``shards`` gets,
    after each call, whether every parameter is sharded again."""
    g = torch.Generator().manual_seed(100 + rank)
    outs = []
    with torch.no_grad():
        for shape in ((2, 5, DIM), (3, 4, DIM)):
            outs.append(model(torch.rand(*shape, generator=g)))
            shards.append(sharding(model, world))
    return outs


def _program_dtypes(report: ctxreplay.CaptureReport) -> list[str]:
    """The dtypes of the weights in the programs this rank traced."""
    return sorted({str(t.dtype) for c in report.captures if c.artifact is not None
                   for t in c.artifact.state_dict.values()})


def _fsdp_round(model: nn.Module, rank: int, world: int, targets: Any, **kw: Any
                ) -> tuple[dict[str, Any], ctxreplay.CaptureReport, list[torch.Tensor]]:
    """Observe, finalize and install once: the report's summary, install's
    counts, eager's outputs and the sharding after finalize and after every
    call, eager and installed."""
    shards: list[bool] = []
    with ctxreplay.capture_with(model, targets=targets, **kw) as session:
        eager = _fsdp_calls(model, rank, world, shards)
    report = session.finalize()
    doc = summary(report)
    doc["sharded_after_finalize"] = sharding(model, world)
    doc["program_dtypes"] = _program_dtypes(report)
    doc["calls"] = sum(c.calls for c in report.captures)
    with ctxreplay.install(model, report) as handle:
        installed = _fsdp_calls(model, rank, world, shards)
    doc["install"] = stats(handle)
    doc["sharded_after_calls"] = shards
    doc["same"] = same(eager, installed)
    doc["dtypes"] = [str(t.dtype) for t in installed]
    doc["eager_again"] = same(eager, _fsdp_calls(model, rank, world, []))
    return doc, report, eager


def _fsdp_training(rank: int, world: int) -> dict[str, Any]:
    """A training step, eager and installed: outputs and the gradient shards
    FSDP reduce-scatters after backward."""
    model = fsdp_model(world, False).train()
    x = torch.rand(2, 5, DIM, generator=torch.Generator().manual_seed(rank))

    def step() -> tuple[torch.Tensor, list[torch.Tensor]]:
        y = model(x)
        y.sum().backward()
        grads = [p.grad.to_local().clone() for p in model.parameters()]  # type: ignore[union-attr]
        model.zero_grad()
        return y.detach(), grads

    with ctxreplay.capture_with(model, targets="repeated") as session:
        eager, eager_grads = step()
    report = session.finalize()
    with ctxreplay.install(model, report) as handle:
        out, grads = step()
    return {"ok": report.ok, "install": stats(handle), "same": same([eager], [out]),
            "same_grads": same(eager_grads, grads), "sharded": sharding(model, world)}


def _fsdp_renamed(rank: int, world: int) -> dict[str, Any]:
    """Rank 1 observes the model under another root (``nn.Sequential(model)``):
    the blocks rank 0 gathers by name are not there under that name."""
    model = fsdp_model(world, False)
    root = model if rank == 0 else nn.Sequential(model)
    with ctxreplay.capture_with(root, targets="repeated") as session:
        _fsdp_calls(root, rank, world, [])
    doc = summary(session.finalize())
    doc["sharded_after_finalize"] = sharding(model, world)
    return doc


def fully_sharded(rank: int, world: int, port: int, out: str) -> None:
    """FSDP2 blocks with and without the bf16 policy, at the default level
    and at "execute"; the Linear layers inside the blocks targeted by name;
    and the bf16 captures saved, loaded and installed."""
    setup(rank, world, port)
    with written(out, rank) as result:
        for bf16 in (False, True):
            model = fsdp_model(world, bf16)
            for verify in (None, "execute"):
                kw = {} if verify is None else {"verify": verify}
                doc, report, eager = _fsdp_round(model, rank, world, "repeated", **kw)
                result[f"{'bf16' if bf16 else 'fp32'}/{verify or 'default'}"] = doc
        # FSDP's groups are the blocks': a Linear inside is gathered through them
        linears = [f"blocks.{i}.{n}" for i in range(3) for n in ("qkv", "up")]
        result["bf16/linears"] = _fsdp_round(fsdp_model(world, True), rank, world, linears)[0]
        result["fp32/train"] = _fsdp_training(rank, world)
        result["fp32/renamed"] = _fsdp_renamed(rank, world)
        # the whole model as one member: FSDP's hooks on the blocks run inside it
        result["fp32/whole"] = _fsdp_round(fsdp_model(world, False), rank, world, None)[0]
        report.save_all(Path(out, "captures"))  # every rank: a collective
        shards: list[bool] = []
        with ctxreplay.install(model, ctxreplay.load(Path(out, "captures"))) as handle:
            loaded = _fsdp_calls(model, rank, world, shards)
        result["loaded"] = {"install": stats(handle), "same": same(eager, loaded),
                            "sharded_after_calls": shards}
    teardown()


@contextmanager
def one_rank_group(store: Path) -> Iterator[None]:
    """A gloo group of this process alone (FSDP2 over a one-rank mesh runs
    its hooks and gathers as on many ranks), destroyed after."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        yield
    finally:
        dist.destroy_process_group()
