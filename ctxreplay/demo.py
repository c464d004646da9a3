"""The main job: a small DiT-style transformer, run live under CPU bfloat16
autocast and inference mode, captured afterwards with and without replay."""

from __future__ import annotations

import shutil
import warnings
from typing import Any

import torch
from torch import nn

from .engine.session import capture_with
from .fidelity.verify import flat_tensor_spec
from .report.capture_report import CaptureReport

__all__ = ["DiTBlock", "TinyDiT", "run_demo"]


class DiTBlock(nn.Module):
    """Attention + MLP with adaptive layer-norm modulation from a condition."""

    def __init__(self, dim: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"),
                                 nn.Linear(4 * dim, dim))
        self.ada = nn.Linear(dim, 6 * dim)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        s1, b1, g1, s2, b2, g2 = self.ada(nn.functional.silu(c)).unsqueeze(1).chunk(6, dim=-1)
        h = self.norm1(x) * (1 + s1) + b1
        q, k, v = self.qkv(h).reshape(b, n, 3, self.heads, d // self.heads).permute(
            2, 0, 3, 1, 4)
        a = nn.functional.scaled_dot_product_attention(q, k, v)
        x = x + g1 * self.proj(a.transpose(1, 2).reshape(b, n, d))
        h = self.norm2(x) * (1 + s2) + b2
        out: torch.Tensor = x + g2 * self.mlp(h)
        return out


class TinyDiT(nn.Module):
    def __init__(self, dim: int = 64, depth: int = 6, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(dim, dim)
        self.t_embed = nn.Sequential(nn.Linear(1, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.blocks = nn.ModuleList([DiTBlock(dim, heads) for _ in range(depth)])
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        c = self.t_embed(t.unsqueeze(-1) / 1000.0)
        x = self.embed(x)
        for block in self.blocks:
            x = block(x, c)
        out: torch.Tensor = self.out(x)
        return out


def _dtype(spec: Any) -> str:
    if spec is None:
        return "-"
    leaves = flat_tensor_spec(spec).items
    return str(leaves[0].dtype).removeprefix("torch.") if leaves else "-"  # type: ignore[union-attr]


def run_demo(*, depth: int = 6, dim: int = 64, shapes: tuple[tuple[int, int], ...] = (
        (1, 16), (2, 32)), verbose: bool = True,
        explain: bool = True) -> tuple[CaptureReport, CaptureReport, bool]:
    """Run the demo; returns (ctxreplay report, no-replay baseline report, ok).

    ``ok`` is false when any capture failed or disagrees with its live call
    (``ctxreplay demo`` then exits non-zero).  ``explain`` also works out
    which probes changed each graph (``report.explain(model)``); the result
    is kept in the report."""
    # torch's own export internals warn about a deprecated pytree spelling
    warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
    torch.manual_seed(0)
    model = TinyDiT(dim, depth).eval()
    faithful = capture_with(model, targets="repeated", verify="execute")
    baseline = capture_with(model, targets="repeated", replay="off", verify="signature")
    live: list[str] = []
    with faithful, baseline, torch.autocast("cpu", dtype=torch.bfloat16), \
            torch.inference_mode():
        for batch, tokens in shapes:
            x = torch.rand(batch, tokens, dim)
            t = torch.full((batch,), 500.0)
            live.append(str(model(x, t).dtype).removeprefix("torch."))
    base = baseline.finalize()
    report = faithful.finalize()
    explanation = report.explain(model) if explain else None
    by_key = {(c.scope, c.variant): c for c in base.captures}
    rows = []
    ok = report.ok and bool(report.captures)
    for c in report.captures:
        b = by_key.get((c.scope, c.variant))
        shape = "x".join(str(d) for d in c.signature.args[0].shape)  # type: ignore[union-attr]
        rows.append((f"{c.scope}#{c.variant}", shape, str(c.calls), _dtype(c.outputs),
                     _dtype(None if b is None else b.graph_outputs),
                     _dtype(c.graph_outputs),
                     "ok" if c.fidelity.ok else "MISMATCH", f"{c.seconds * 1000:.0f} ms"))
    for f in report.failures:
        rows.append((f"{f.scope}#{f.variant}", "-", "-", "-", "-", f"failed: {f.reason}",
                     "FAILED", "-"))
    if verbose:
        head = ("variant", "input", "calls", "live", "no replay", "ctxreplay", "fidelity",
                "capture")
        widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
        line = "  ".join(h.ljust(w) for h, w in zip(head, widths))
        print(f"TinyDiT: {depth} blocks, live forward under CPU bfloat16 autocast + "
              f"inference_mode; model output dtypes {', '.join(live)}")
        print(line)
        print("-" * len(line))
        for r in rows:
            print("  ".join(v.ljust(w) for v, w in zip(r, widths)))
        n_blocks = sum(c.calls for c in report.captures)
        print(f"{len(report.captures)} captures for {n_blocks} block calls; "
              f"finalize {report.seconds:.2f} s; "
              + ("every capture matches its live call" if ok else
                 "SOME CAPTURES DISAGREE WITH THE LIVE CALL"))
        if explanation is not None:
            print("\nwhich probes changed the captured graphs (each left out in turn):")
            # the terminal's width (88 when stdout is not a terminal)
            print(explanation.table(width=shutil.get_terminal_size((88, 24)).columns))
    return report, base, ok
