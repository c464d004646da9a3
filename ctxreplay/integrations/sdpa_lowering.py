"""Scaled-dot-product attention whose kernel a framework chose inside its own
attention function, written into a traced graph.

diffusers' ``_native_math`` backend calls ``F.scaled_dot_product_attention``
inside ``sdpa_kernel(SDPBackend.MATH)``.  Neither ``torch.export`` (non-strict)
nor Dynamo records that context: the program holds the plain
``aten.scaled_dot_product_attention`` node, which later runs the default
kernel -- on CPU the flash kernel, 2e-7 to 0.016 away from math (measured,
torch 2.13).  ``lowering_math_sdpa()``, entered inside the traced callable,
turns every SDPA call made while the flags select math alone into
``aten._scaled_dot_product_attention_math``, the op the math selection itself
calls, so the program runs the math kernel wherever it runs (measured
bit-identical to the live call in float32, bfloat16, float16 and float64,
with no mask, a boolean or an additive mask, causal, and grouped-query
attention; export, a saved ``.pt2`` and Dynamo alike).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["lowering_math_sdpa", "math_sdpa"]

_math = getattr(torch.ops.aten, "_scaled_dot_product_attention_math", None)
_flash_enabled = torch._C._get_flash_sdp_enabled
_math_enabled = torch._C._get_math_sdp_enabled


def math_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
              is_causal: bool = False, scale: float | None = None,
              enable_gqa: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` with the math kernel, as an explicit op."""
    assert _math is not None
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        # what the SDPA entry point does before it selects a kernel: a
        # boolean mask becomes an additive one (-inf where False)
        attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill_(
            attn_mask.logical_not(), float("-inf"))
    out: torch.Tensor = _math(query, key, value, attn_mask, dropout_p, is_causal,
                              scale=scale, enable_gqa=enable_gqa)[0]
    return out


def _selects_math_alone(query: object) -> bool:
    # The CPU selection tries flash, then math; a CUDA one is lowered only
    # when every other kernel is off as well (what sdpa_kernel(MATH) sets).
    if not _math_enabled() or _flash_enabled():
        return False
    if not isinstance(query, torch.Tensor) or query.device.type == "mps":
        return False  # MPS runs its own math kernel
    if query.device.type == "cpu":
        return True
    others = ("_get_mem_efficient_sdp_enabled", "_get_cudnn_sdp_enabled")
    return not any(getattr(torch._C, name, lambda: False)() for name in others)


class _LowerMathSdpa(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            # diffusers passes every argument by keyword
            query = args[0] if args else kwargs.get("query")
            dropout = args[4] if len(args) > 4 else kwargs.get("dropout_p", 0.0)
            if not dropout and _selects_math_alone(query):
                return math_sdpa(*args, **kwargs)
        return func(*args, **kwargs)


def lowering_math_sdpa() -> TorchFunctionMode | None:
    """A mode that writes math-selected SDPA calls into a traced graph as the
    math op (``None`` on a torch without that op).  Dropout keeps the plain
    call: its random mask is drawn by the kernel either way."""
    return _LowerMathSdpa() if _math is not None else None
