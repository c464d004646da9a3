"""Probes for state that frameworks keep outside torch (diffusers' attention
backend, transformers' attention implementation), each active in the default
set only once its framework is imported (ctxreplay never imports one), and
the SDPA lowering that writes a framework's kernel choice into a graph."""

from ..core.probe import FrameworkStateError
from . import diffusers_attention, transformers_attention  # noqa: F401  (registration)
from .diffusers_attention import DiffusersAttentionProbe, DiffusersAttentionState
from .sdpa_lowering import lowering_math_sdpa, math_sdpa
from .transformers_attention import TransformersAttentionProbe, TransformersAttentionState

__all__ = ["DiffusersAttentionProbe", "DiffusersAttentionState", "FrameworkStateError",
           "TransformersAttentionProbe", "TransformersAttentionState", "lowering_math_sdpa",
           "math_sdpa"]
