"""Any ``contextvars.ContextVar``."""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Hashable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

from .forward_context import LiveValueProbe

__all__ = ["ContextVarProbe"]

_MISSING = object()


class ContextVarProbe(LiveValueProbe):
    """``ContextVarProbe(var)``: observes ``var.get()``, replays with
    ``var.set()`` / ``var.reset()``.  An unset variable (or one holding
    ``None``) is the unset state.

    Args:
        var: the variable to observe.
        name: the registry key (default ``contextvar_<var.name>``).
        key: maps a value to the hashable identity used in variant keys
            (default: the object's identity), as for ``ForwardContextProbe``.
        traceable: enter the replay inside the traced callable.
        max_held: values kept for replay at most.
    """

    description = "the value of a contextvars.ContextVar"

    def __init__(self, var: contextvars.ContextVar[Any], *, name: str | None = None,
                 key: Callable[[Any], Hashable] | None = None,
                 traceable: bool = False, max_held: int = 64) -> None:
        super().__init__(key=key, traceable=traceable, max_held=max_held)
        self.var = var
        """The ``ContextVar`` observed."""
        self.name = name or f"contextvar_{var.name}"

    def read(self) -> Any:
        value = self.var.get(_MISSING)
        return None if value is _MISSING else value

    def enter(self, value: Any) -> AbstractContextManager[None]:
        return _set_var(self.var, value)


@contextmanager
def _set_var(var: contextvars.ContextVar[Any], value: Any) -> Iterator[None]:
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)
