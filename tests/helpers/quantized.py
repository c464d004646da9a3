"""Models whose Linear weights are wrapper tensor subclasses (quantized weights).

``Int8Weight`` is a hand-written weight-only int8 wrapper, the shape of
torchao's ``Int8Tensor``: an int8 ``qdata`` and a per-row float ``scale``
behind a ``_make_wrapper_subclass`` tensor of the float dtype, traceable
by ``torch.export`` through ``__tensor_flatten__`` / ``__tensor_unflatten__``.
Every other operator sees the dequantized weight.  It lives here, importable
by name, because a saved program pickles the class by its import path and a
fresh process must find it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

aten = torch.ops.aten

#: operators that keep the weight quantized: they act on the inner tensors
_KEEP = (aten.detach.default, aten.alias.default, aten.clone.default)


class Int8Weight(torch.Tensor):
    qdata: torch.Tensor
    scale: torch.Tensor

    @staticmethod
    def __new__(cls, qdata: torch.Tensor, scale: torch.Tensor,
                dtype: torch.dtype = torch.float32) -> Int8Weight:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined,no-any-return]
            cls, qdata.shape, dtype=dtype, device=qdata.device, requires_grad=False)

    def __init__(self, qdata: torch.Tensor, scale: torch.Tensor,
                 dtype: torch.dtype = torch.float32) -> None:
        self.qdata = qdata
        self.scale = scale

    def __repr__(self) -> str:
        return f"Int8Weight(shape={tuple(self.shape)}, dtype={self.dtype})"

    def __tensor_flatten__(self) -> tuple[list[str], torch.dtype]:
        return ["qdata", "scale"], self.dtype

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], dtype: torch.dtype,
                             outer_size: Any, outer_stride: Any) -> Int8Weight:
        return Int8Weight(inner["qdata"], inner["scale"], dtype)

    @classmethod
    def quantize(cls, w: torch.Tensor) -> Int8Weight:
        scale = w.detach().abs().amax(dim=1).clamp(min=1e-8) / 127
        qdata = torch.round(w.detach() / scale[:, None]).to(torch.int8)
        return cls(qdata, scale, w.dtype)

    def dequantize(self) -> torch.Tensor:
        return self.qdata.to(self.dtype) * self.scale[:, None].to(self.dtype)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _KEEP:
            w = args[0]
            return Int8Weight(func(w.qdata), func(w.scale), w.dtype)

        def plain(t: Any) -> Any:
            return t.dequantize() if isinstance(t, Int8Weight) else t

        return func(*pytree.tree_map(plain, args), **pytree.tree_map(plain, kwargs))


def quantize_linears(model: nn.Module) -> nn.Module:
    """Every ``nn.Linear`` weight of ``model`` made an ``Int8Weight``, in place."""
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.weight = nn.Parameter(Int8Weight.quantize(m.weight), requires_grad=False)
    return model


class QBlock(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class QStack(nn.Module):
    def __init__(self, depth: int = 3, dim: int = 16) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(QBlock(dim) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def quantized_stack(kind: str, *, depth: int = 3, dim: int = 16, seed: int = 0) -> QStack:
    """A ``QStack`` in eval mode, its Linear weights quantized by ``kind``:
    ``"int8"`` (``Int8Weight``) or ``"torchao"`` (``Int8WeightOnlyConfig``;
    needs torchao)."""
    torch.manual_seed(seed)
    model = QStack(depth, dim).eval()
    if kind == "int8":
        return quantize_linears(model)  # type: ignore[return-value]
    if kind == "torchao":
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

        # torchao's default also sets inductor options and the process's float32
        # matmul precision to "high" (set_inductor_config): not the weights' business
        quantize_(model, Int8WeightOnlyConfig(set_inductor_config=False))
        return model
    raise ValueError(f"quantized_stack: kind must be 'int8' or 'torchao', got {kind!r}")


def torchao_or_skip() -> Any:
    """``torchao.quantization``, or the test is skipped naming why: torchao
    is missing, or this torch cannot import it (a release built for
    another torch raises more than ``ImportError``)."""
    import pytest

    try:
        import torchao.quantization as quantization
    except Exception as exc:
        pytest.skip(f"torchao is not importable here: {type(exc).__name__}: {exc}")
    return quantization


KINDS = ("int8", "torchao")


def stack_or_skip(kind: str, **kwargs: Any) -> QStack:
    """``quantized_stack(kind)``, the test skipped where torchao is needed and missing."""
    if kind == "torchao":
        torchao_or_skip()
    return quantized_stack(kind, **kwargs)
