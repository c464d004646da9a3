"""The ahead-of-time compiled install's benchmark model, and what each fresh
process of ``test_bench_aot.py`` measures (run as a script: one JSON line).

The model is DiT-like: a 2-block text refiner, then joint blocks over
image and text tokens (adaLN modulation from the timestep, one attention
over both streams, an MLP each), run under CPU bfloat16 autocast.

    python aot_fresh.py MODE SIZE DIR

``MODE``: ``make`` (capture the model, save DIR and compile it: ``ctxreplay
compile``), ``aot`` (load DIR, install, first forward; then steady state of
the installed model beside eager), ``compile`` (``torch.compile`` of the
model, first forward) or ``compile_steady`` (the same, then steady state
of it beside eager and of the installed model).  Times start after imports
and the model's build: what a process does before its first forward.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

#: (dim, image tokens, text tokens, joint blocks, refiner blocks, heads) per size
SIZES = {"full": (384, 256, 32, 8, 2, 6), "small": (64, 24, 8, 2, 1, 2)}
BATCH = 2


class JointBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.mod_x, self.mod_c = nn.Linear(dim, 6 * dim), nn.Linear(dim, 6 * dim)
        self.qkv_x, self.qkv_c = nn.Linear(dim, 3 * dim), nn.Linear(dim, 3 * dim)
        self.out_x, self.out_c = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.mlp_x = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU("tanh"),
                                   nn.Linear(4 * dim, dim))
        self.mlp_c = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU("tanh"),
                                   nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, c: torch.Tensor, t: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        n = x.shape[1]
        sx, bx, gx, sx2, bx2, gx2 = self.mod_x(F.silu(t))[:, None].chunk(6, dim=-1)
        sc, bc, gc, sc2, bc2, gc2 = self.mod_c(F.silu(t))[:, None].chunk(6, dim=-1)
        hx = F.layer_norm(x, x.shape[-1:]) * (1 + sx) + bx
        hc = F.layer_norm(c, c.shape[-1:]) * (1 + sc) + bc
        qkv = torch.cat([self.qkv_x(hx), self.qkv_c(hc)], dim=1)
        b, s, _ = qkv.shape
        q, k, v = qkv.view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, -1)
        x = x + gx * self.out_x(a[:, :n])
        c = c + gc * self.out_c(a[:, n:])
        x = x + gx2 * self.mlp_x(F.layer_norm(x, x.shape[-1:]) * (1 + sx2) + bx2)
        c = c + gc2 * self.mlp_c(F.layer_norm(c, c.shape[-1:]) * (1 + sc2) + bc2)
        return x, c


class RefinerBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.mod = nn.Linear(dim, 4 * dim)
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU("tanh"),
                                 nn.Linear(4 * dim, dim))

    def forward(self, c: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        s1, g1, s2, g2 = self.mod(F.silu(t))[:, None].chunk(4, dim=-1)
        b, s, _ = c.shape
        qkv = self.qkv(F.layer_norm(c, c.shape[-1:]) * (1 + s1))
        q, k, v = qkv.view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, -1)
        c = c + g1 * self.out(a)
        return c + g2 * self.mlp(F.layer_norm(c, c.shape[-1:]) * (1 + s2))


class DiTLike(nn.Module):
    def __init__(self, size: str) -> None:
        super().__init__()
        dim, _, _, joint, refiner, heads = SIZES[size]
        self.t_embed = nn.Sequential(nn.Linear(1, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.refiner = nn.ModuleList(RefinerBlock(dim, heads) for _ in range(refiner))
        self.blocks = nn.ModuleList(JointBlock(dim, heads) for _ in range(joint))
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, c: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        temb = self.t_embed(t[:, None])
        for block in self.refiner:
            c = block(c, temb)
        for joint in self.blocks:
            x, c = joint(x, c, temb)
        out: torch.Tensor = self.proj(x)
        return out


def build(size: str) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """The model (seeded weights) and one call's inputs."""
    torch.manual_seed(0)
    dim, tokens, text, *_ = SIZES[size]
    model = DiTLike(size).eval()
    inputs = (torch.rand(BATCH, tokens, dim), torch.rand(BATCH, text, dim),
              torch.full((BATCH,), 0.5))
    return model, inputs


def run(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.inference_mode():
        out: torch.Tensor = model(*inputs)
    return out


def steady(fns: dict[str, Any], rounds: int) -> dict[str, float]:
    """Interleaved medians, seconds a forward."""
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for f in fns.values():
        f()
    for _ in range(rounds):
        for k, f in fns.items():
            t0 = time.perf_counter()
            f()
            samples[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in samples.items()}


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest difference, relative to the largest magnitude of ``want``."""
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


def _make(model: nn.Module, inputs: tuple[torch.Tensor, ...], directory: str
          ) -> dict[str, Any]:
    import ctxreplay
    from ctxreplay.compiling import compile_dir

    with ctxreplay.capture_with(model, targets="repeated") as session:
        run(model, inputs)
    report = session.finalize()
    assert report.ok, report.summary
    report.save_all(directory)
    done = compile_dir(directory)
    src = ctxreplay.load(directory)
    assert not isinstance(src, ctxreplay.LoadedCapture)
    return {"captures": len(src.captures), "compiled": list(done.compiled),
            "skipped": done.skipped, "failed": done.failed, "seconds": done.seconds,
            "errors": [c.compiled.error for c in src.captures if c.compiled is not None],
            "compile_seconds": [c.compiled.seconds for c in src.captures
                                if c.compiled is not None]}


def main(mode: str, size: str, directory: str, rounds: int) -> dict[str, Any]:
    import copy

    import ctxreplay

    torch.set_num_threads(1)
    model, inputs = build(size)
    if mode == "make":
        return _make(model, inputs, directory)
    eager = copy.deepcopy(model)
    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    if mode == "aot":
        handle = ctxreplay.install(model, ctxreplay.load(directory))
        first = run(model, inputs)
        out["first"] = time.perf_counter() - t0
        stats = handle.stats()
        from torch._dynamo.utils import counters
        cache = Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR", "/nonexistent"))
        out.update(hits=stats.total_hits, misses=stats.total_misses,
                   compiled=len(stats.compiled), uncompiled=stats.uncompiled,
                   frames=sum(counters["frames"].values()),
                   inductor=sum(counters["inductor"].values()),
                   cache_files=sum(1 for p in cache.rglob("*") if p.is_file()),
                   error=relative_error(first, run(eager, inputs)))
        if rounds:
            out["steady"] = steady({"eager": lambda: run(eager, inputs),
                                     "aot": lambda: run(model, inputs)}, rounds)
        return out
    compiled = torch.compile(model)
    first = run(compiled, inputs)
    out["first"] = time.perf_counter() - t0
    out["error"] = relative_error(first, run(eager, inputs))
    if mode == "compile_steady" and rounds:
        installed = copy.deepcopy(eager)
        ctxreplay.install(installed, ctxreplay.load(directory))
        out["steady"] = steady({"eager": lambda: run(eager, inputs),
                                 "compile": lambda: run(compiled, inputs),
                                 "aot": lambda: run(installed, inputs)}, rounds)
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))))
