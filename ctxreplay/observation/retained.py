"""Copies of live calls for the value-checking levels: per member and
variant its first calls, and per variant a reservoir of later ones, as CPU
copies (inputs taken before the forward can change them in place, outputs
when it returns), within one byte budget for the session.

Two policies:

* ``verify="sampled"`` (the default) decides *before* a call runs whether it
  is sampled, so the others stay on the observation's fast path.  Each
  member's first ``SAMPLED`` calls after its first are sampled (a forward
  that alternates computing and reusing shows there), and then a reservoir
  of ``SAMPLED`` calls *per variant*, shared by the members of the variant
  (``Pool``): reservoir sampling with skips (``Schedule``, Li's "Algorithm
  L") over rounds of the variant's calls, each sample taken from a member
  picked at random and replacing a random slot, so the slots stay a uniform
  sample of the later calls of every member.  A session of n calls per
  member copies about ``SAMPLED * (1 + ln(n / SAMPLED))`` of them per
  variant, however many members share it (a stack of identical blocks is
  one variant: per member, the copies would grow with the stack).
* ``verify="values"`` copies every call once (it is the newest "last" until
  the next call) and keeps the first, the last and up to ``BETWEEN`` sampled
  uniformly from those in between.

Both sample with a generator of the session's own (seeded, so runs are
reproducible; the global random state is never touched).  A call that does
not fit the budget is not retained, after sampled calls were given up to
make room for it -- for a variant's first call, those of any variant: every
member's first call is what a value check needs first.  ``summary()``
counts them.

Each member variant counts the calls its policy would have held at
finalize that the budget did not keep (``Kept.missed``): a call due to be
retained that did not fit, and one given up later to make room.  A slot
the sample itself replaces (a reservoir's pick) is no such call.  The value
check reads the count: a capture some of whose calls to compare were not
kept is not proven.
"""

from __future__ import annotations

import math
import random
import threading
from collections.abc import Iterable
from typing import Any

import torch

from ..capture.options import RetainedCall
from ..specs.signature import call_tensors, tensor_values

__all__ = ["BETWEEN", "SAMPLED", "Kept", "Pool", "Retention", "Schedule"]

#: calls sampled between a variant's first and last call, per member
#: (``verify="values"``)
BETWEEN = 6
#: calls after the first sampled per member and variant, and the slots of
#: each variant's reservoir (``verify="sampled"``)
SAMPLED = 4


def _nbytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _copies(tensors: Iterable[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    with torch.no_grad(), torch.inference_mode(False):
        return tuple(t.detach().to("cpu", copy=True) for t in tensors)


class Kept:
    """One member's retained calls of one variant (under the session lock)."""

    __slots__ = ("between", "first", "last", "missed", "seen")

    def __init__(self) -> None:
        self.first: RetainedCall | None = None
        self.last: RetainedCall | None = None
        self.between: list[RetainedCall] = []
        #: ``verify="values"``: calls that went past ``first`` into the
        #: sample, ``last`` included
        self.seen = 0
        #: calls due to be kept that the budget did not keep (not copied,
        #: or given up to make room for another)
        self.missed = 0

    def calls(self) -> tuple[RetainedCall, ...]:
        """In call order as far as known: the first, the sample, the last."""
        return tuple(c for c in (self.first, *self.between, self.last) if c is not None)


class Schedule:
    """When a member's next call of one variant is due to be sampled
    (``verify="sampled"``): ``due`` is its index (0 is the first call,
    retained as such).  Reservoir sampling with skips (Li, "Reservoir-sampling
    algorithms of time complexity O(n(1 + log(N/n)))", 1994): the first
    ``SAMPLED`` later calls are due one by one, then each sample draws how
    many calls to let pass before the next."""

    __slots__ = ("due", "w")

    def __init__(self) -> None:
        self.due = 1
        self.w = 1.0

    def advance(self, n: int, rng: random.Random) -> None:
        """Call ``n`` was just sampled: the next due."""
        if n < SAMPLED:
            self.due = n + 1
            return
        # (1 - random() lies in (0, 1]: log never sees 0)
        self.w *= math.exp(math.log(1.0 - rng.random()) / SAMPLED)
        w = min(self.w, 1.0 - 1e-12)
        self.due = n + 1 + int(math.log(1.0 - rng.random()) / math.log1p(-w))

    def hits(self, n: int) -> int:
        """Calls from index ``n`` on that are not due."""
        return max(0, self.due - n)


class Pool:
    """The reservoir of one variant's later calls under ``verify="sampled"``,
    shared by its members (under the session lock).  ``schedule`` counts in
    rounds of the variant (a member's own call index: the members of a stack
    are called in turn); ``owner`` is the member whose call is due next, so
    only its memo stops for it (the others' run on); ``slots`` are the
    sampled calls kept, each in its member's ``Kept``."""

    __slots__ = ("members", "owner", "schedule", "slots")

    def __init__(self, rng: random.Random) -> None:
        self.schedule = Schedule()
        # rounds up to SAMPLED are every member's early samples
        self.schedule.advance(SAMPLED, rng)
        self.members: list[Any] = []
        self.owner: Any = None
        self.slots: list[tuple[Kept, RetainedCall]] = []

    def join(self, member: Any) -> None:
        """``member`` completed a call of the variant: a candidate owner."""
        self.members.append(member)
        if self.owner is None:
            self.owner = member

    def hits(self, member: Any, n: int) -> int | None:
        """Calls of ``member`` from its index ``n`` on that are not due
        (``None``: none is)."""
        if n <= SAMPLED:
            return 0
        return self.schedule.hits(n) if member is self.owner else None

    def due(self, member: Any, n: int) -> bool:
        """Whether call ``n`` of ``member`` is to be sampled."""
        return n <= SAMPLED or (member is self.owner and n >= self.schedule.due)

    def evict(self, rng: random.Random) -> int:
        """Make room for a sample in a full reservoir: a random slot given
        up; its bytes (0 where it was already given up for the budget)."""
        if len(self.slots) < SAMPLED:
            return 0
        kept, call = self.slots.pop(rng.randrange(len(self.slots)))
        for i, c in enumerate(kept.between):
            if c is call:
                del kept.between[i]
                return call.nbytes
        return 0


class Retention:
    """The session's byte budget for retained copies (``limit`` ``None``:
    values are not retained); ``held`` bytes are held now, ``peak`` at
    most; ``skipped`` calls were not retained for the budget.  ``sample``:
    the ``verify="sampled"`` policy (calls chosen before they run)."""

    __slots__ = ("held", "kept", "kepts", "limit", "lock", "peak", "rng", "sample", "skipped")

    def __init__(self, limit: int | None, lock: threading.Lock, sample: bool = False) -> None:
        self.limit = limit
        self.lock = lock
        self.sample = sample
        self.held = 0
        self.peak = 0
        self.kept = 0  # calls retained over the session (some given up later)
        self.skipped = 0
        self.rng = random.Random(0)
        self.kepts: list[Kept] = []  # every member variant's, to make room for a first call

    def summary(self) -> dict[str, int] | None:
        """The report's ``retained``: the cap, bytes held at finalize and at
        most, calls retained and calls not retained for the cap (``None``
        where values are not retained)."""
        if self.limit is None:
            return None
        return {"retain_bytes": self.limit, "retained_bytes": self.held,
                "peak_bytes": self.peak, "retained_calls": self.kept,
                "not_retained": self.skipped}

    def new(self) -> Kept:
        """A member variant's retained calls, counted in the budget's care
        (under the lock)."""
        kept = Kept()
        self.kepts.append(kept)
        return kept

    def advance(self, pool: Pool, member: Any, n: int) -> bool:
        """Whether call ``n`` of ``member`` is to be sampled into ``pool`` (an
        early call is, and does not move the schedule); a pooled sample
        moves the schedule on and picks the member that takes the next."""
        with self.lock:
            if n <= SAMPLED:
                return True
            if member is not pool.owner or n < pool.schedule.due:
                return False
            pool.schedule.advance(n, self.rng)
            pool.owner = self.rng.choice(pool.members)
            return True

    def inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any], kept: Kept | None = None,
               pool: Pool | None = None) -> tuple[torch.Tensor, ...] | None:
        """CPU copies of a call's input tensors, or ``None`` past the budget
        (other sampled calls given up first to make room, ``_reserve``).
        ``kept``: where the call is to be retained (``None``: a first call);
        ``pool``: the variant reservoir it is sampled into, a random slot
        of which it replaces when full (each slot stays a uniform pick)."""
        tensors = call_tensors(args, kwargs)
        need = _nbytes(tensors)
        with self.lock:
            if pool is not None:
                self.held -= pool.evict(self.rng)
            if not self._reserve(need, kept):
                self.skipped += 1
                return None
        return _copies(tensors)

    def missed(self, kept: Kept) -> None:
        """A call of ``kept``'s member variant that was due to be retained
        returned without copies of its inputs (``inputs`` gave none)."""
        with self.lock:
            kept.missed += 1

    def release(self, inputs: tuple[torch.Tensor, ...]) -> None:
        """Give back the budget of copies no longer kept."""
        with self.lock:
            self.held -= _nbytes(inputs)

    def keep(self, kept: Kept, inputs: tuple[torch.Tensor, ...], out: Any,
             pool: Pool | None = None) -> None:
        """Retain the call that took ``inputs`` and returned ``out`` in
        ``kept`` (and its slot in ``pool``; the inputs' budget given back
        when its outputs do not fit)."""
        outs = tuple(tensor_values(out))
        need = _nbytes(outs)
        with self.lock:
            ok = self._reserve(need, kept)
            if not ok:
                self.skipped += 1
                kept.missed += 1
                self.held -= _nbytes(inputs)
                return
        call = RetainedCall(inputs, _copies(outs), need + _nbytes(inputs))
        with self.lock:
            self.kept += 1
            self._place(kept, call, pool)

    def _reserve(self, need: int, kept: Kept | None) -> bool:
        """Reserve ``need`` bytes (under the lock).  What is given up to make
        room: for a first call, sampled later calls of any member variant;
        under ``values``, ``kept``'s own sampled calls in between, then its
        last call (the call being retained replaces it).  A later sample
        under ``sampled`` displaces nothing."""
        limit = self.limit or 0
        first = kept is None or kept.first is None
        if first:
            for other in self.kepts:
                while self.held + need > limit and other.between:
                    self.held -= other.between.pop().nbytes
                    other.missed += 1
        elif not self.sample:
            while self.held + need > limit and kept is not None and kept.between:
                self.held -= kept.between.pop().nbytes
                kept.missed += 1
            if self.held + need > limit and kept is not None and kept.last is not None:
                self.held -= kept.last.nbytes
                kept.last = None
                kept.missed += 1
        if self.held + need > limit:
            return False
        self.held += need
        self.peak = max(self.peak, self.held)
        return True

    def _place(self, kept: Kept, call: RetainedCall, pool: Pool | None) -> None:
        if kept.first is None:
            kept.first = call
            return
        if self.sample:  # (``inputs`` made room in the pool)
            kept.between.append(call)
            if pool is not None:
                pool.slots.append((kept, call))
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
