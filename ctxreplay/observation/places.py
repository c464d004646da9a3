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

from typing import Any

import torch
from torch import nn

from ..capture.baked import argument_attributes, static_places
from ..specs.baked import Source, lookup, place_check, plain, same_state, state_of
from .variants import MemberVariant

__all__ = ["PlaceWatch", "places_of"]

_GONE = object()


class PlaceWatch:
    """``check()``: whether every place the member reads holds what it did at
    the last look (``look()``: look again).  ``against(variant, ...)`` holds
    each call to its variant's first: what held something else then is
    counted in the variant's ``moved`` (the place -> calls) once the call
    returned."""

    __slots__ = ("arguments", "check", "last", "member", "sources", "state", "watched")

    def __init__(self, sources: tuple[Source, ...], member: nn.Module,
                 arguments: tuple[tuple[int, str, str], ...] = ()) -> None:
        self.sources, self.member = sources, member
        #: ``(position, argument, attribute)``: Python attributes the forward
        #: reads off its tensor arguments, and what the last call's held
        self.arguments = arguments
        self.last: tuple[Any, ...] = ()
        self.state: tuple[Any, ...] = ()
        self.watched: tuple[bool, ...] = ()
        self.check: Any = None
        self.look()

    def look(self) -> None:
        """The places looked up again, and the check made anew: of those
        that hold a tensor or a small Python value now (one holding objects
        -- a framework's context stack while a call is in it -- is what a
        probe observes, not a constant of a graph: left out until it holds
        such a value again)."""
        values = []
        for s in self.sources:
            try:
                values.append(lookup(s, self.member))
            except Exception:  # a place gone (an attribute deleted): it holds nothing
                values.append(_GONE)
        self.state = state_of(values)
        self.watched = tuple(_watchable(v) for v in values)
        pairs = [(s, v) for s, v, w in zip(self.sources, values, self.watched) if w]
        self.check = place_check(tuple(s for s, _ in pairs), [v for _, v in pairs],
                                 self.member)

    def against(self, variant: MemberVariant, args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> list[Source]:
        """The places and argument attributes of this call that hold
        something else than at ``variant``'s first call (the first call: they
        become its own), for the caller to count once the call returned."""
        tags = self.last = self._tags(args, kwargs)
        now = (self.state, self.watched, tags)
        first = variant.places
        if first is None:
            variant.places = now
            return []
        out = [s for s, a, b, w, v in zip(self.sources, first[0], now[0], first[1], now[1])
               if w and v and not same_state((a,), (b,))]
        out += [Source(name, (("attr", attr),), "value", "")
                for (_, name, attr), a, b in zip(self.arguments, first[2], tags)
                if not same_state((a,), (b,))]
        return out

    def _tags(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        return tuple(_attribute(args[i] if i < len(args) else kwargs.get(name, _GONE), attr)
                     for i, name, attr in self.arguments)

    def same_tags(self, args: tuple[Any, ...]) -> bool:
        """Whether positional ``args`` hold the last call's attributes."""
        return same_state(self._tags(args, {}), self.last)


def _watchable(value: Any) -> bool:
    return value is _GONE or isinstance(value, torch.Tensor) or plain(value)


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
