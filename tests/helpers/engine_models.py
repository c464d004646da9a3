"""Small models and graph helpers shared by the capture-engine tests."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from ctxreplay import Capture
from ctxreplay.backends import ExportBackend
from ctxreplay.backends.passes import graph_nodes
from ctxreplay.specs.signature import TensorSpec, flatten_spec

BF16 = torch.bfloat16
F32 = torch.float32

_MATMUL_OPS = ("aten.mm.", "aten.matmul.", "aten.bmm.", "aten.addmm.")


class MatmulBlock(nn.Module):
    """A projection, then an explicit matmul: autocast puts both in bfloat16."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        return torch.matmul(h, h.transpose(-1, -2))


class Block(nn.Module):
    """A residual MLP; ``hidden`` changes its structure, not its interface."""

    def __init__(self, dim: int = 16, hidden: int = 32) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Stack(nn.Module):
    """Three blocks of one structure, two of another, between two linears."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList([Block(dim, 32) for _ in range(3)]
                                    + [Block(dim, 64) for _ in range(2)])
        self.head = nn.Linear(dim, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


class CountingExport(ExportBackend):
    """``ExportBackend`` that records every ``capture`` call's input shapes."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[tuple[int, ...], ...]] = []

    def capture(self, module: nn.Module, args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> Any:
        self.calls.append(tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor)))
        return super().capture(module, args, kwargs)


def matmul_dtypes(capture: Capture) -> set[torch.dtype]:
    """Dtypes of the mm/matmul nodes of an exported capture (nested graphs too)."""
    gm = capture.artifact.graph_module
    out = set()
    for n in graph_nodes(gm):
        if n.op == "call_function" and str(n.target).startswith(_MATMUL_OPS):
            out.add(n.meta["val"].dtype)
    assert out, f"no mm/matmul node in the graph of {capture.scope}#{capture.variant}"
    return out


def out_dtypes(spec: Any) -> list[torch.dtype]:
    """Dtypes of the tensor leaves of an output spec, in order."""
    return [s.dtype for s in flatten_spec(spec) if isinstance(s, TensorSpec)]


def bf16() -> torch.autocast:
    return torch.autocast("cpu", dtype=BF16)


@contextmanager
def set_threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
