"""Watching, per observed call, the state a member's forward reads beside
its arguments and weights.

A graph bakes in what its trace read -- a dict entry, a module global, a
field of a plain object, a tensor or ``None`` the block holds -- as one
value.  A pipeline that flips such state on a few calls, or a forward
that stores a tensor on one call and reads it on the next, makes those
calls compute something no program reproduces, and a sample of calls
compared by value may miss them.

``PlaceWatch(member)`` finds the places the member's code reads
(``capture.baked.static_places``: from its bytecode, no run) and writes
one function that says whether each still holds what it held at the
last look: a tensor by identity and version counter, a value by
equality.  Called on every observed call of a member that reads such a
place (nothing is added for one that reads none), a failed check looks
again, counts the places that changed (``moved``) and writes the function
anew.  At ``finalize`` a capture whose trace read a place that changed
between its member's calls is not ok.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch import nn

from ..capture.baked import argument_attributes, static_places
from ..specs.baked import Source, lookup, place_check, same_state, state_of

__all__ = ["PlaceWatch", "places_of"]

_GONE = object()


class PlaceWatch:
    """``check()``: whether every place the member reads holds what it did at
    the last look; ``look()``: look again, counting what changed (``moved``:
    the place -> times it was seen changed)."""

    __slots__ = ("arguments", "check", "last", "member", "moved", "sources", "state")

    def __init__(self, sources: tuple[Source, ...], member: nn.Module,
                 arguments: tuple[tuple[int, str, str], ...] = ()) -> None:
        self.sources, self.member = sources, member
        self.moved: Counter[Source] = Counter()
        #: ``(position, argument, attribute)``: Python attributes the forward
        #: reads off its tensor arguments, and what the last call's held
        self.arguments = arguments
        self.last: tuple[Any, ...] | None = None
        values = self._values()
        self.state = state_of(values)
        self.check: Any = place_check(sources, values, member)

    def _values(self) -> list[Any]:
        out = []
        for s in self.sources:
            try:
                out.append(lookup(s, self.member))
            except Exception:  # a place gone (an attribute deleted): it holds nothing
                out.append(_GONE)
        return out

    def look(self, count: bool = True) -> None:
        """Look again; ``count``: count the places that changed (not after a
        variant's first call, which may fill a lazy cache once)."""
        values = self._values()
        state = state_of(values)
        for s, before, now in zip(self.sources, self.state, state):
            if count and not same_state((before,), (now,)):
                self.moved[s] += 1
        self.state = state
        self.check = place_check(self.sources, values, self.member)


    def tagged(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Note the Python attributes this call's tensor arguments hold where
        the forward reads them; a change from the last call is counted."""
        now = tuple(_attribute(args[i] if i < len(args) else kwargs.get(name, _GONE), attr)
                    for i, name, attr in self.arguments)
        last, self.last = self.last, now
        if last is not None:
            for (_, name, attr), a, b in zip(self.arguments, last, now):
                if not same_state((a,), (b,)):
                    self.moved[Source(name, (("attr", attr),), "value", "")] += 1

    def same_tags(self, args: tuple[Any, ...]) -> bool:
        """Whether positional ``args`` hold the last call's attributes."""
        now = tuple(_attribute(args[i] if i < len(args) else _GONE, attr)
                    for i, _, attr in self.arguments)
        return self.last is not None and same_state(now, self.last)


def _attribute(value: Any, attr: str) -> Any:
    """A tensor's Python attribute ``attr`` (``_GONE``: none; not a tensor)."""
    if not isinstance(value, torch.Tensor):
        return _GONE
    return value.__dict__.get(attr, _GONE)


def places_of(member: nn.Module, ignore: tuple[str, ...] = ()) -> PlaceWatch | None:
    """The watch over what ``member``'s code reads (``None``: it reads no
    such place, or its code cannot be read); ``ignore``: attribute names
    the user said its result does not depend on (``ignore_attributes``)."""
    try:
        sources = tuple(s for s in static_places(member)
                        if not any(step == "attr" and key in ignore for step, key in s.steps))
        arguments = tuple(a for a in argument_attributes(member) if a[2] not in ignore)
        return PlaceWatch(sources, member, arguments) if sources or arguments else None
    except Exception:  # code that cannot be looked at: watched by the value check only
        return None
