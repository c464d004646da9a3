"""The default floating-point dtype (``torch.set_default_dtype``)."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch

from .._base.jsonread import dtype_name, read_dtype
from ..core.probe import ContextProbe, restoring
from ..core.registry import register_probe

__all__ = ["DefaultDtypeProbe"]

# what torch.set_default_dtype accepts (torch 2.13: "only floating-point types";
# the float8 types have no storage type and are refused too)
_DEFAULT_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


@register_probe
class DefaultDtypeProbe(ContextProbe[torch.dtype]):
    """Not traceable: export records factory ops (``torch.ones(3)``) without a
    dtype, so a program exported under a float64 default later runs as
    float32; the capture engine pins them from the replayed value instead."""

    name = "default_dtype"
    description = "torch.get_default_dtype()"
    default = True
    pinnable = True
    guarded = True  # fully covered by the guard

    def observe(self) -> torch.dtype:
        return torch.get_default_dtype()

    def replay(self, state: torch.dtype) -> AbstractContextManager[None]:
        return restoring(torch.get_default_dtype, torch.set_default_dtype, state)

    def neutral_state(self) -> torch.dtype:
        return torch.float32

    def neutral(self, state: torch.dtype) -> bool:
        return state == torch.float32

    def encode(self, state: torch.dtype) -> str:
        return dtype_name(state)

    def decode(self, data: Any, path: str) -> torch.dtype:
        dtype = read_dtype(data, path)
        if dtype not in _DEFAULT_DTYPES:
            raise ValueError(f"{path}: {dtype_name(dtype)} cannot be a default dtype; "
                             f"torch accepts {sorted(dtype_name(d) for d in _DEFAULT_DTYPES)}")
        return dtype

    def describe(self, state: torch.dtype) -> str:
        return dtype_name(state)
