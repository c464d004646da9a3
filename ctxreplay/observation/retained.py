"""Copies of live calls for ``verify="values"``: per member and variant a
reservoir spanning the session -- its first call, its last call and up to
``BETWEEN`` calls sampled uniformly from those in between -- as CPU copies
(inputs taken before the forward can change them in place, outputs when it
returns), within one byte budget for the session.

Every call of a retaining session is copied once (it is the newest "last"
until the next call): the cost of ``verify="values"``, which a session pays
only when it asks for it.  The calls in between are sampled with a
generator of the session's own (seeded, so runs are reproducible; the
global random state is never touched).  A call that does not fit the
budget is not retained, after the variant's sampled calls in between and
its previous last call were given up to make room for it; ``summary()``
counts them.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterable
from typing import Any

import torch

from ..capture.options import RetainedCall
from ..specs.signature import call_tensors, tensor_values

__all__ = ["BETWEEN", "Kept", "Retention"]

#: calls sampled between a variant's first and last call, per member
BETWEEN = 6


def _nbytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _copies(tensors: Iterable[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    with torch.no_grad(), torch.inference_mode(False):
        return tuple(t.detach().to("cpu", copy=True) for t in tensors)


class Kept:
    """One member's retained calls of one variant (under the session lock)."""

    __slots__ = ("between", "first", "last", "seen")

    def __init__(self) -> None:
        self.first: RetainedCall | None = None
        self.last: RetainedCall | None = None
        self.between: list[RetainedCall] = []
        self.seen = 0  # calls that went past ``first`` into the sample, ``last`` included

    def calls(self) -> tuple[RetainedCall, ...]:
        """In call order as far as known: the first, the sample, the last."""
        return tuple(c for c in (self.first, *self.between, self.last) if c is not None)


class Retention:
    """The session's byte budget for retained copies (``limit`` ``None``:
    values are not retained); ``held`` bytes are held now, ``peak`` at
    most; ``skipped`` calls were not retained for the budget."""

    __slots__ = ("held", "kept", "limit", "lock", "peak", "rng", "skipped")

    def __init__(self, limit: int | None, lock: threading.Lock) -> None:
        self.limit = limit
        self.lock = lock
        self.held = 0
        self.peak = 0
        self.kept = 0  # calls retained over the session (some given up later)
        self.skipped = 0
        self.rng = random.Random(0)

    def summary(self) -> dict[str, int] | None:
        """The report's ``retained``: the cap, bytes held at finalize and at
        most, calls retained and calls not retained for the cap (``None``
        without ``verify="values"``)."""
        if self.limit is None:
            return None
        return {"retain_bytes": self.limit, "retained_bytes": self.held,
                "peak_bytes": self.peak, "retained_calls": self.kept,
                "not_retained": self.skipped}

    def inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any], kept: Kept | None = None
               ) -> tuple[torch.Tensor, ...] | None:
        """CPU copies of a call's input tensors, or ``None`` past the budget
        (``kept``'s sampled calls and last call given up first to make room:
        this call is its newest)."""
        tensors = call_tensors(args, kwargs)
        need = _nbytes(tensors)
        with self.lock:
            if not self._reserve(need, kept):
                self.skipped += 1
                return None
        return _copies(tensors)

    def release(self, inputs: tuple[torch.Tensor, ...]) -> None:
        """Give back the budget of copies no longer kept."""
        with self.lock:
            self.held -= _nbytes(inputs)

    def keep(self, kept: Kept, inputs: tuple[torch.Tensor, ...], out: Any) -> None:
        """Retain the call that took ``inputs`` and returned ``out`` in
        ``kept`` (the inputs' budget given back when its outputs do not fit)."""
        outs = tuple(tensor_values(out))
        need = _nbytes(outs)
        with self.lock:
            ok = self._reserve(need, kept)
            if not ok:
                self.skipped += 1
                self.held -= _nbytes(inputs)
                return
        call = RetainedCall(inputs, _copies(outs), need + _nbytes(inputs))
        with self.lock:
            self.kept += 1
            self._place(kept, call)

    def _reserve(self, need: int, kept: Kept | None) -> bool:
        """Reserve ``need`` bytes (under the lock), giving up ``kept``'s
        sampled calls in between, then its last call (the call being retained
        replaces it), when they are in the way."""
        limit = self.limit or 0
        while self.held + need > limit and kept is not None and kept.between:
            self.held -= kept.between.pop().nbytes
        if self.held + need > limit and kept is not None and kept.last is not None:
            self.held -= kept.last.nbytes
            kept.last = None
        if self.held + need > limit:
            return False
        self.held += need
        self.peak = max(self.peak, self.held)
        return True

    def _place(self, kept: Kept, call: RetainedCall) -> None:
        if kept.first is None:
            kept.first = call
            return
        old, kept.last = kept.last, call
        if old is None:
            return
        # ``old`` is no longer the last: one more candidate for the sample
        # between (reservoir sampling: each candidate kept with BETWEEN/seen)
        kept.seen += 1
        if len(kept.between) < BETWEEN:
            kept.between.append(old)
            return
        slot = self.rng.randrange(kept.seen)
        if slot < BETWEEN:
            self.held -= kept.between[slot].nbytes
            kept.between[slot] = old
        else:
            self.held -= old.nbytes
