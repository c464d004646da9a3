"""Noticing that an observed module's attributes changed, off the hot path.

A member's identity (``targets.identity_of``: ``training`` and the plain
attributes of it and its submodules, callables included) decides which
graph its calls run, but recomputing it on every call would cost more than
the whole observation.  So while a session is open, the classes of the
observed modules (and of the config objects and processors they hold as
attributes) get a ``__setattr__`` that, after doing what the class's
own did, tells the members holding that module: their memo is dropped and
their next call rechecks the identity (``_Member.changed``).  ``train()``,
``eval()``, ``set_processor()`` and peft's ``enable_adapters`` all assign
attributes, so they are seen; a call where nothing was assigned pays
nothing.  Changes made without an assignment on such an object (an item
of a dict the module holds, a field of a built-in ``SimpleNamespace``
attribute, a module-level global the forward reads) are not seen here:
``verify="values"`` checks retained calls by value instead.  FSDP2's swap
of a managed parameter between its shard and the gathered whole, around
every call, is not a change of identity (``_fsdp_swap``): it tells no one.

The patch is counted per class and taken off when the last session
watching that class detaches; a ``__setattr__`` another tool installed on
top later is left alone (ours then stays in its chain and tells no one).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["AssignmentWatch"]

_lock = threading.Lock()
#: id(module) -> callbacks of the members whose subtree holds it
_watchers: dict[int, list[Callable[[], None]]] = {}
#: patched class -> (the ``__setattr__`` in its own ``__dict__`` before, or
#: ``None``; our function; sessions using it)
_patched: dict[type, tuple[Any, Any, int]] = {}


def _patch(cls: type) -> None:
    entry = _patched.get(cls)
    if entry is not None:
        _patched[cls] = (entry[0], entry[1], entry[2] + 1)
        return
    own = cls.__dict__.get("__setattr__")
    orig: Callable[[Any, str, Any], None] = cls.__setattr__  # type: ignore[assignment]

    # FSDP2 assigns a parameter through the module's ``__setattr__`` only
    # where it is not ``nn.Module``'s; with it, it writes ``_parameters``
    plain = orig is torch.nn.Module.__setattr__

    def __setattr__(self: Any, name: str, value: Any) -> None:
        if _fsdp_swap(self, name, value):  # no change of identity: tells no one
            if plain:  # what FSDP does where no class patch is in its way
                self._parameters[name] = value
            else:
                orig(self, name, value)
            return
        orig(self, name, value)
        tell = _watchers.get(id(self))
        if tell:
            for callback in tuple(tell):
                callback()

    __setattr__.__qualname__ = f"{cls.__qualname__}.__setattr__"
    __setattr__.__wrapped__ = orig  # type: ignore[attr-defined]
    try:
        cls.__setattr__ = __setattr__  # type: ignore[method-assign,assignment]
    except TypeError:  # a built-in type (SimpleNamespace): its changes stay unseen
        return
    _patched[cls] = (own, __setattr__, 1)


def _fsdp_swap(module: Any, name: str, value: Any) -> bool:
    """Whether assigning ``value`` is FSDP2 swapping a parameter of a module
    it manages between its shard and the gathered whole (around every call;
    torch's FSDP takes this assignment path once a class's ``__setattr__``
    is not ``nn.Module``'s).  Both forms have the whole shape, and a
    managed parameter's identity is that shape, so nothing changes."""
    d = getattr(module, "__dict__", None)
    if not d or d.get("_is_fsdp_managed_module") is not True:
        return False
    old = (d.get("_parameters") or {}).get(name)
    # (FSDP swaps parameters for parameters; a plain tensor assigned there
    # takes nn.Module's own path, which refuses it as eager does)
    return isinstance(value, torch.nn.Parameter) and isinstance(old, torch.Tensor) \
        and value.shape == old.shape


def _unpatch(cls: type) -> None:
    if cls not in _patched:
        return  # never patched (a built-in type)
    own, ours, count = _patched[cls]
    if count > 1:
        _patched[cls] = (own, ours, count - 1)
        return
    del _patched[cls]
    if cls.__dict__.get("__setattr__") is not ours:
        return  # another tool patched on top: ours stays in its chain, inert
    if own is None:
        delattr(cls, "__setattr__")
    else:
        cls.__setattr__ = own  # type: ignore[method-assign]


class AssignmentWatch:
    """One session's watch over the modules of its members."""

    def __init__(self) -> None:
        self.entries: list[tuple[int, Callable[[], None]]] = []
        self.classes: list[type] = []

    def add(self, modules: Iterable[object], callback: Callable[[], None]) -> None:
        """Call ``callback`` whenever an attribute of one of ``modules`` (or
        of a config object or processor they hold) is assigned (until
        ``remove``)."""
        with _lock:
            for m in modules:
                _watchers.setdefault(id(m), []).append(callback)
                self.entries.append((id(m), callback))
                cls = type(m)
                if cls not in self.classes:
                    self.classes.append(cls)
                    _patch(cls)

    def remove(self) -> None:
        """Stop telling this session's members; take the patches off."""
        with _lock:
            for key, callback in self.entries:
                tell = _watchers.get(key)
                if tell is None:
                    continue
                with contextlib.suppress(ValueError):
                    tell.remove(callback)
                if not tell:
                    del _watchers[key]
            self.entries = []
            for cls in reversed(self.classes):
                _unpatch(cls)
            self.classes = []
