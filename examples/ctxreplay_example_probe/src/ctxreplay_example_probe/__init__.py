"""A tiny framework with a vLLM-style forward context, and its ctxreplay probe."""

from .framework import ForwardContext, get_forward_context, set_forward_context
from .probe import probe

__all__ = ["ForwardContext", "get_forward_context", "probe", "set_forward_context"]
