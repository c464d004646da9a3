"""Guarding, per call, the state a program baked in (``specs.baked``).

``BakedGuard(baked, member)`` holds one member to what its program read
when traced.  ``holds()`` is its per-call question.  The first time, and
after any failure, it looks every place up again and compares digests of
what each holds with those of the trace; when all agree it writes one
function that answers the next calls cheaply, as Dynamo guards its
sources: for a tensor its identity and version counter (a new tensor
assigned, or the same one written in place: ``copy_``, ``load_state_dict``),
for a small Python value an equality with a copy taken then (a dict entry
flipped in place, a global or class attribute reassigned).  A call it
refuses runs eagerly; ``failed`` names the place that differed.  A state
that differs but was seen differing on the last look costs no new digest.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..specs.baked import Baked, Source, digest, lookup, place_check, same_state, state_of

__all__ = ["BakedGuard"]


def _never() -> bool:
    return False


class BakedGuard:
    """``holds()``: whether the places ``baked`` lists hold, for ``member``, what
    the program baked in; ``failed``: the last place that did not."""

    __slots__ = ("_bad", "_check", "failed", "member", "sources")

    def __init__(self, baked: Baked, member: nn.Module) -> None:
        self.sources, self.member = baked.sources, member
        self._check: Any = _never
        self._bad: Any = None
        self.failed: Source | None = None

    def holds(self) -> bool:
        return bool(self._check()) or self._look()

    def _look(self) -> bool:
        """Every place looked up and digested again; the fast check made anew
        where all agree."""
        values: list[Any] = []
        for s in self.sources:
            try:
                values.append(lookup(s, self.member))
            except Exception:  # a place gone (an attribute deleted): it differs
                self.failed = s
                return False
        state = state_of(values)
        if self._bad is not None and same_state(state, self._bad):
            return False
        for s, v in zip(self.sources, values):
            if _kind(v) != s.kind or digest(v) != s.digest:
                self._bad, self.failed = state, s
                self._check = _never
                return False
        self._bad = self.failed = None
        self._check = place_check(self.sources, values, self.member)
        return True


def _kind(value: Any) -> str:
    return "tensor" if isinstance(value, torch.Tensor) else "value"
