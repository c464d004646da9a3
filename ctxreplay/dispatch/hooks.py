"""Module hooks that a dispatched member's graph would skip.

A dispatched call runs the member's graph in place of its forward, so the
hooks of the member's submodules (and torch's global module hooks, which
fire on those submodules) do not run: a recording, calibration or
profiling hook would miss the call, and one that returns a value would no
longer change it -- the graph was traced without any user hook
(``capture.hookfree``).  So a member holding such hooks when it is called
runs eagerly (``hooks``), exactly as it would without ctxreplay; its own
hooks run around the dispatched call as around the eager one and change
nothing here.  Hooks known to change nothing a forward computes
(``hookfree.inert``: transformers' output-capturing hook) block dispatch only
while they record (``hookfree.recording``: while their model's forward
collects the outputs they capture), a check made on each call of the member.

Hooks come and go at any time: torch numbers every hook handle from one
class counter (``RemovableHandle.next_id``), which grows at every
registration anywhere, and a removal shows in the length of the dictionary
it was removed from.  ``HookWatch.forward_changed`` looks once per call of
the model (and on every call of a member called alone), as the
numerics-only flags are looked at, and tells each member what its hooks now
ask (``blocking``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch.nn.modules.module as _module
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..capture.hookfree import GLOBAL_TABLES, OWN_TABLES, computing, inert, recording

__all__ = ["Blocking", "HookWatch", "blocking", "inner_hooks"]

_GLOBAL = tuple(d for d in (getattr(_module, n, None) for n in GLOBAL_TABLES)
                if isinstance(d, dict))

_Hooks = tuple[Any, ...]

#: what a member's inner hooks ask of its calls: ``False`` dispatch, ``True``
#: run eagerly, a callable: run eagerly while it returns True
Blocking = bool | Callable[[], bool]


def _tables(m: nn.Module) -> tuple[dict[Any, Any], ...]:
    return tuple(getattr(m, n) for n in OWN_TABLES)


def inner_hooks(member: nn.Module) -> tuple[_Hooks, list[tuple[dict[Any, Any], int]]]:
    """The hooks that fire inside ``member``'s forward (its submodules' and the
    global ones), as ``(where, table, hooks)``; and each non-empty table with
    its length."""
    found: list[Any] = []
    tables: list[tuple[dict[Any, Any], int]] = []
    for path, m in member.named_modules():
        if m is member:  # its own hooks run around the dispatched call
            continue
        for i, table in enumerate(_tables(m)):
            if table:
                found.append((path, i, tuple(table.values())))
                tables.append((table, len(table)))
    for i, table in enumerate(_GLOBAL):
        if table:
            found.append(("*", i, tuple(table.values())))
            tables.append((table, len(table)))
    return tuple(found), tables


def blocking(hooks: _Hooks) -> Blocking:
    """What ``inner_hooks(member)[0]`` asks of the member's calls."""
    # torch's tensor-parallel hooks were traced into the graph
    # (``hookfree.computing``): the graph does what they do
    every = [h for _, _, held in hooks for h in held if not computing(h)]
    if not every:
        return False
    if all(inert(h) for h in every):
        return recording(every)
    return True


class HookWatch:
    """Whether any member's inner hooks changed: ``forward_changed()`` tells
    each member what its hooks ask now (``changed(member, blocking)``)."""

    __slots__ = ("changed", "members", "seen", "tables")

    def __init__(self, members: Sequence[nn.Module],
                 changed: Callable[[int, Blocking], None]) -> None:
        self.members = members
        self.changed = changed
        self.seen = RemovableHandle.next_id
        self.tables: list[tuple[dict[Any, Any], int]] = []
        for i, module in enumerate(members):
            hooks, tables = inner_hooks(module)
            self.tables += tables
            changed(i, blocking(hooks))

    def forward_changed(self) -> bool:
        """Look (cheaply: one counter and the lengths of the tables that held
        hooks) and, where something changed, look at every member again."""
        if RemovableHandle.next_id == self.seen and \
                all(len(t) == n for t, n in self.tables):
            return False
        self.seen = RemovableHandle.next_id
        self.tables = []
        for i, module in enumerate(self.members):
            hooks, tables = inner_hooks(module)
            self.tables += tables
            self.changed(i, blocking(hooks))
        return True
