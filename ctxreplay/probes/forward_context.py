"""A framework's forward context: the vLLM / FastVideo ``get_forward_context()``
/ ``set_forward_context(...)`` pattern, built from a getter and a setter."""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import attrs

from ..core.probe import ContextProbe, NotPortableError

__all__ = ["ForwardContextProbe", "LiveState", "LiveValueProbe"]


@attrs.frozen(cache_hash=True)
class LiveState:
    """A live value, identified by its key.

    Two calls whose values share a key are the same variant; the first value
    seen for a key is the one replayed.  The value itself lives in the probe
    (``slot``), never in the state, so ``clear()`` really lets it go.
    """

    key: Hashable
    type_name: str = attrs.field(eq=False)
    slot: int = attrs.field(eq=False, repr=False)


UNSET = LiveState(("unset",), "unset", -1)
NOT_RETAINED = LiveState(("not_retained",), "not retained", -1)


class LiveValueProbe(ContextProbe[LiveState]):
    """Base of probes whose state is a live Python object read by a getter.

    ``key(value)`` maps a value to the hashable identity used in variant
    keys (default: the object's identity; pass a structural summary, e.g. the
    batch descriptor, when a framework builds a new context every step).
    ``max_held`` bounds how many distinct values are kept alive.
    """

    portable = False

    def __init__(self, *, key: Callable[[Any], Hashable] | None = None,
                 traceable: bool = False, max_held: int = 64) -> None:
        self._key = key
        self._traceable = traceable
        self._max_held = max_held
        self._lock = threading.Lock()
        self._held: dict[int, Any] = {}
        self._by_key: dict[Hashable, LiveState] = {}
        self._next = 0
        self.dropped = 0

    @property
    def traceable(self) -> bool:  # type: ignore[override]
        return self._traceable

    def read(self) -> Any:
        """The current value, or ``None`` when unset."""
        raise NotImplementedError

    def enter(self, value: Any) -> AbstractContextManager[Any]:
        """A context that makes ``value`` current."""
        raise NotImplementedError

    def observe(self) -> LiveState:
        value = self.read()
        if value is None:
            return UNSET
        key = self._key(value) if self._key is not None else ("id", id(value))
        state = self._by_key.get(key)
        if state is not None:
            return state
        with self._lock:
            state = self._by_key.get(key)
            if state is None:
                if len(self._held) >= self._max_held:
                    # Past max_held nothing is stored: a framework that makes a
                    # new context every step must not grow this table without
                    # bound.  Every value not retained is one state, which
                    # replay refuses (one variant, not one per step).
                    self.dropped += 1
                    return NOT_RETAINED
                slot = self._next
                self._next += 1
                self._held[slot] = value
                state = LiveState(key, type(value).__name__, slot)
                self._by_key[key] = state
            return state

    def replay(self, state: LiveState) -> AbstractContextManager[None]:
        if state.slot < 0 and state is not UNSET and state != UNSET:
            raise LookupError(f"probe {self.name!r}: the value was not retained "
                              f"(max_held={self._max_held})")
        if state == UNSET:
            return nullcontext()
        try:
            value = self._held[state.slot]
        except KeyError:
            raise LookupError(f"probe {self.name!r}: the value was cleared; "
                              "replay must happen before clear()") from None
        return self._enter(value)

    @contextmanager
    def _enter(self, value: Any) -> Iterator[None]:
        with self.enter(value):
            yield

    def clear(self) -> None:
        with self._lock:
            self._held.clear()
            self._by_key.clear()

    def encode(self, state: LiveState) -> Any:
        raise NotPortableError(f"probe {self.name!r} holds live objects")

    def describe(self, state: LiveState) -> str:
        return state.type_name


class ForwardContextProbe(LiveValueProbe):
    """``ForwardContextProbe(get_forward_context, set_forward_context)``.

    A framework's forward context (the vLLM / FastVideo pattern).  Not in the
    default set: instantiate it with your functions and pass it in ``probes=``
    or register it.  The state is a key, never the object; the first object
    seen for a key is kept for replay and dropped by ``clear()``.

    Args:
        getter: returns the current context (``None``, or raising
            ``AssertionError``, ``LookupError``, ``RuntimeError`` or
            ``AttributeError``, means unset).
        setter: ``setter(ctx)`` returns a context manager making ``ctx``
            current; adapt a setter that takes several arguments with a
            lambda.
        name: the registry key (and the entry-point name, when packaged).
        key: maps a context to the hashable identity used in variant keys
            (default: the object's identity).  Pass the fields the traced
            graph depends on when the framework builds a new context every
            step, or every step becomes a new variant.
        traceable: enter the replay inside the traced callable (only when a
            tracer records it; most forwards *read* the context, and tracing
            bakes what they read into the graph).
        max_held: context objects kept for replay at most.
    """

    description = "a framework's forward context, via a getter and a setter"

    def __init__(self, getter: Callable[[], Any],
                 setter: Callable[[Any], AbstractContextManager[Any]], *,
                 name: str = "forward_context",
                 key: Callable[[Any], Hashable] | None = None,
                 traceable: bool = False, max_held: int = 64) -> None:
        super().__init__(key=key, traceable=traceable, max_held=max_held)
        self.name = name
        self._getter = getter
        self._setter = setter

    def read(self) -> Any:
        try:
            return self._getter()
        except (AssertionError, LookupError, RuntimeError, AttributeError):
            # frameworks assert or raise when no context is set
            return None

    def enter(self, value: Any) -> AbstractContextManager[Any]:
        return self._setter(value)
