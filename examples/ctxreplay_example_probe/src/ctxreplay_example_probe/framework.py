"""Stand-in for a framework's forward context (vLLM / FastVideo style)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

_current: ForwardContext | None = None


@dataclass(frozen=True)
class ForwardContext:
    """What a framework makes ambient for one forward: here, an attention
    backend name and a scale that the model's forward reads."""

    attn_backend: str
    scale: float = 1.0


def get_forward_context() -> ForwardContext:
    assert _current is not None, "forward context is not set"
    return _current


@contextmanager
def set_forward_context(ctx: ForwardContext) -> Iterator[None]:
    global _current
    prev, _current = _current, ctx
    try:
        yield
    finally:
        _current = prev
