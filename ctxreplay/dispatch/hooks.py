"""Module hooks that a dispatched member's graph would skip.

A dispatched call runs the member's graph in place of its forward, so the
forward hooks of the member's submodules (and torch's global module hooks,
which fire on those submodules) do not run: the graph holds what those
hooks did when it was traced.  A hook registered or removed after install
would be skipped, or repeated, silently.  So install keeps, per member, the
hooks inside it (``inner_hooks``: by the ids torch gives their handles) and
looks again whenever a hook may have changed: torch numbers every hook
handle from one class counter (``RemovableHandle.next_id``), which grows at
every registration anywhere, and a removal shows in the length of the
dictionary it was removed from.  ``HookWatch.forward_changed`` looks once per
call of the model (and on every call of a member called alone), as the
numerics-only flags are looked at; a member whose inner hooks differ from
those it was installed with runs eagerly (``hooks``) until they agree again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch.nn.modules.module as _module
from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = ["HookWatch", "inner_hooks"]

_GLOBAL = tuple(d for d in (getattr(_module, n, None) for n in (
    "_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks",
    "_global_backward_hooks")) if isinstance(d, dict))

_Hooks = tuple[Any, ...]


def _tables(m: nn.Module) -> tuple[dict[Any, Any], ...]:
    return (m._forward_pre_hooks, m._forward_hooks, m._backward_pre_hooks, m._backward_hooks)


def inner_hooks(member: nn.Module) -> tuple[_Hooks, list[tuple[dict[Any, Any], int]]]:
    """The hooks that fire inside ``member``'s forward (its submodules' and the
    global ones), by handle id; and each non-empty table with its length."""
    found: list[Any] = []
    tables: list[tuple[dict[Any, Any], int]] = []
    for path, m in member.named_modules():
        if m is member:  # its own hooks run around the dispatched call
            continue
        for i, table in enumerate(_tables(m)):
            if table:
                found.append((path, i, tuple(table)))
                tables.append((table, len(table)))
    for i, table in enumerate(_GLOBAL):
        if table:
            found.append(("*", i, tuple(table)))
            tables.append((table, len(table)))
    return tuple(found), tables


class HookWatch:
    """Whether any member's inner hooks changed since install: ``forward_changed()``
    tells each member whose did (``changed(member, differs)``)."""

    __slots__ = ("changed", "members", "seen", "tables")

    def __init__(self, members: Sequence[tuple[nn.Module, _Hooks]],
                 changed: Callable[[int, bool], None]) -> None:
        self.members = members
        self.changed = changed
        self.seen = RemovableHandle.next_id
        self.tables: list[tuple[dict[Any, Any], int]] = []
        for module, _ in members:
            self.tables += inner_hooks(module)[1]

    def forward_changed(self) -> bool:
        """Look (cheaply: one counter and the lengths of the tables that held
        hooks) and, where something changed, compare every member."""
        if RemovableHandle.next_id == self.seen and \
                all(len(t) == n for t, n in self.tables):
            return False
        self.seen = RemovableHandle.next_id
        self.tables = []
        for i, (module, installed) in enumerate(self.members):
            now, tables = inner_hooks(module)
            self.tables += tables
            self.changed(i, now != installed)
        return True
