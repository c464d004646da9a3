"""Small blocks whose forwards use their input sizes in the ways a folded
capture must get right (tests/capture/test_fold.py), importable by a fresh process.

Every block holds a ``lin`` whose calls a test counts with its own hooks:
a block call that ran eagerly calls it, a dispatched one (the captured
graph runs instead of the forward) does not.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

DIM = 8

#: ``(args, kwargs)`` of a stack call at one sequence length
Make = Callable[[int], tuple[tuple[Any, ...], dict[str, Any]]]


class Branch(nn.Module):
    """Takes one side or the other of a size threshold."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] > 8:
            return self.lin(x) * 2
        return self.lin(x) + 1


class EagerOnlyBranch(nn.Module):
    """Branches on a size only when not exported: the graph computes the
    small side at every size, with no guard saying so."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_exporting() and x.shape[1] > 8:
            return self.lin(x) * 2
        return self.lin(x) + 1


class Masked(nn.Module):
    """A mask whose last dim must equal the sequence length, a slice one
    shorter, and a ``torch.arange`` and ``view`` of the length as an int."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        y = self.lin(x) * mask[:, :, None]
        pos = torch.arange(x.shape[1], dtype=y.dtype)
        y = y + pos[None, :, None]
        y = y.view(-1, x.shape[1] * 2, DIM // 2).reshape(x.shape)
        head, last = y[:, :-1], y[:, -1:]
        return torch.cat([head, last * 2], 1)


class Shifted(nn.Module):
    """Takes a tensor and its slice one shorter as two inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return torch.cat([y[:, :1], y[:, 1:] + prev], 1)


class Parity(nn.Module):
    """Branches on ``%``: export records it as a guard of the graph."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] % 2:
            return self.lin(x) * 3
        return self.lin(x)


class Special(nn.Module):
    """One size, never observed, takes another path."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] == 7:
            return self.lin(x) * 3
        return self.lin(x)


class Pair(nn.Module):
    """Two independent sizes, and a branch on how they compare."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if x.shape[1] > y.shape[1]:
            return self.lin(x) + y.sum(1, keepdim=True)
        return self.lin(x) - y.sum(1, keepdim=True)


class SizeTable(nn.Module):
    """Reads a Python dict keyed by the size (filled before any call)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.table = {n: torch.full((n,), float(n)) for n in range(1, 20)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + self.table[x.shape[1]][None, :, None]


class SizeMemo(nn.Module):
    """Fills a Python dict keyed by the size on first use of each size."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.memo: dict[int, torch.Tensor] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        if n not in self.memo:
            self.memo[n] = torch.full((n,), float(n))
        return self.lin(x) + self.memo[n][None, :, None]


class KeywordOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, *, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + bias


class Transposed(nn.Module):
    """Takes ``(batch, DIM, length)``, a transposed view for the first block."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x.transpose(1, 2)).transpose(1, 2).contiguous()


class Softmax(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).softmax(1)


class Indexed(nn.Module):
    """A block whose plain attribute ``layer_idx`` enters its graph."""

    def __init__(self, layer_idx: int) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.layer_idx = layer_idx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * (self.layer_idx + 1) / (self.layer_idx + 2)


class Scaled(nn.Module):
    """Takes a Python float: each value is another graph."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        return self.lin(x) * scale


class Stack(nn.Module):
    """``blocks`` called in a row; the first positional argument (or the
    keyword ``x``) is threaded through, the others passed to every block."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        for b in self.blocks:
            if args:
                args = (b(*args, **kwargs), *args[1:])
            else:
                kwargs = {**kwargs, "x": b(**kwargs)}
        return args[0] if args else kwargs["x"]


def stack(cls: Callable[[], nn.Module], n: int = 2) -> Stack:
    """``n`` blocks of ``cls``, seeded: every process builds the same weights."""
    torch.manual_seed(0)
    return Stack([cls() for _ in range(n)]).eval()


def inputs(length: int, *shape: int) -> torch.Tensor:
    """A seeded random tensor (the same per length in every process)."""
    g = torch.Generator().manual_seed(1000 + length)
    return torch.rand(*shape, generator=g)


def sequence(length: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (inputs(length, 2, length, DIM),), {}
