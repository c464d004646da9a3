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

Under autocast the lowering does what autocast does for the SDPA entry point
(it has an autocast kernel on CPU and CUDA: ``scaled_dot_product_attention``
is on their lower-precision lists, the math op on none): the floating-point
inputs that autocast casts (on the autocast device, not float64) are cast to
the autocast dtype, and the math op runs with autocast off, as the entry
point's kernel runs below autocast.  Without that the math op took the
inputs as they came (float32 after a norm autocast keeps in float32) and its
inner matmuls were autocast again: a bfloat16 block computed up to 0.016
away from the live call, in whichever process ran the program.
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
_has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key


def _autocast_dtype(query: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast casts the SDPA entry point's inputs to on ``query``'s
    device now (``None``: autocast is off there, or has no kernel for it)."""
    device = query.device.type
    if not torch.is_autocast_enabled(device):
        return None
    key = "AutocastPrivateUse1" if device == "privateuseone" else f"Autocast{device.upper()}"
    try:
        if not _has_kernel("aten::scaled_dot_product_attention", key):
            return None
    except Exception:  # a device type without an autocast dispatch key
        return None
    return torch.get_autocast_dtype(device)


def _cast(t: Any, dtype: torch.dtype, device: str) -> Any:
    """What autocast's cast does to one argument: a floating-point tensor on its
    device (float64 left alone) in ``dtype``."""
    if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64 \
            and t.device.type == device:
        return t.to(dtype)
    return t


def math_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
              is_causal: bool = False, scale: float | None = None,
              enable_gqa: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` with the math kernel, as an explicit op."""
    assert _math is not None
    dtype = _autocast_dtype(query)
    if dtype is not None:
        device = query.device.type
        query, key, value, attn_mask = (_cast(t, dtype, device)
                                        for t in (query, key, value, attn_mask))
        with torch.autocast(device, enabled=False):
            return math_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale,
                             enable_gqa)
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
