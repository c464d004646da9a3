"""Probes for state that frameworks keep outside torch -- diffusers' attention
backend, transformers' attention implementation -- each active in the default
set only once its framework is imported (ctxreplay never imports one), and
the SDPA lowering that writes a framework's kernel choice into a graph."""

from . import diffusers_attention  # noqa: F401  (imported for registration)
from .diffusers_attention import DiffusersAttentionProbe, DiffusersAttentionState

__all__ = ["DiffusersAttentionProbe", "DiffusersAttentionState"]
