"""The variant table: each member's calls by variant, and the scopes that
group members of one structure."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable
from typing import Any, Protocol

import attrs
import torch
from torch import nn

from ..core.snapshots import ContextSnapshot
from ..specs.baked import Source
from ..specs.signature import CallSpec, Spec
from .retained import Kept, Pool


class _MemberLike(Protocol):
    """What a scope reads of its members (``wrapper._Member``)."""

    name: str
    module: nn.Module
    tables: dict[int, dict[Any, Any]]

    def all_variants(self) -> Any: ...


__all__ = ["MAX_DROPPED", "MAX_SIZES", "MemberVariant", "Scope", "VariantView"]

#: distinct dropped variants counted exactly per scope; bookkeeping stays bounded
MAX_DROPPED = 256
#: variants of one family (members and sizes of one graph, when variants
#: fold) recorded per scope; more are dropped (``variant_limit``)
MAX_SIZES = 1024


@attrs.define(eq=False, slots=True)
class MemberVariant:
    """One member's calls of one variant."""

    index: int
    identity: int
    snapshot: ContextSnapshot
    inputs: CallSpec
    outputs: Spec | None = None
    completed: bool = False
    counter: Any = attrs.field(factory=itertools.count)
    #: the calls retained for a value check (the first and a sample of the others)
    retained: Kept | None = None
    #: ``verify="sampled"``: the variant's reservoir, shared with the members
    #: of the variant, which says when a call is due to be sampled
    pool: Pool | None = None
    #: copies of the inputs of the call in progress that is to be retained
    retained_inputs: tuple[torch.Tensor, ...] | None = None
    #: calls counted that raised in the user's forward (the caller handled
    #: it): never calls to reproduce, so ``calls`` leaves them out
    raised: int = 0
    #: what the places its member's code reads held at its first call, and
    #: the places later calls found holding something else, per calls
    #: (``places.PlaceWatch.against``)
    places: tuple[Any, ...] | None = None
    moved: Counter[Source] = attrs.field(factory=Counter)

    @property
    def calls(self) -> int:
        # itertools.count increments atomically under the GIL (a plain
        # ``+= 1`` loses updates between threads); its repr, "count(N)",
        # gives the next value without consuming it.
        return int(repr(self.counter)[6:-1]) - self.raised

    @property
    def empty(self) -> bool:
        """No call of it returned: every one raised (or is still running)."""
        return not self.completed and self.calls == 0


@attrs.frozen(eq=False)
class VariantView:
    """A variant of a scope, all members together (read-only)."""

    index: int
    snapshot: ContextSnapshot
    inputs: CallSpec
    outputs: Spec | None
    calls: int
    members: tuple[str, ...]
    #: the first member that ran it (``None`` once the session let go)
    module: nn.Module | None = None


@attrs.define(eq=False)
class Scope:
    """Members sharing one structure (class and parameter shapes): they are
    reported together; members of one identity share captures."""

    name: str
    key: tuple[Any, ...]
    members: list[str]
    identities: list[Any] = attrs.field(factory=list)
    #: per identity, ``targets.state_of`` when it was first seen
    states: list[Any] = attrs.field(factory=list, repr=False)
    index: dict[Any, int] = attrs.field(factory=dict)  # (identity, snap, sig) -> variant
    #: hashes of the keys of variants past max_variants (exact up to MAX_DROPPED)
    dropped: set[int] = attrs.field(factory=set)
    #: calls of those variants, exact
    dropped_calls: int = 0
    #: more distinct variants were dropped than ``dropped`` holds
    dropped_overflow: bool = False
    #: snapshots of the first few dropped variants (for notices)
    dropped_first: list[ContextSnapshot] = attrs.field(factory=list)
    member_states: list[_MemberLike] = attrs.field(factory=list, repr=False)
    #: family -> variants recorded of it: what ``max_variants`` counts.  A
    #: family is a context and a signature with sizes left out when variants
    #: fold (members that differ in plain attributes and calls that differ in
    #: sizes may share one graph), else one variant of one identity
    families: dict[Any, int] = attrs.field(factory=dict, repr=False)
    #: calls dropped, by why: ``"graphs"`` (a family past max_variants) or
    #: ``"sizes"`` (a variant past ``MAX_SIZES`` in its family)
    dropped_why: dict[str, int] = attrs.field(factory=dict)
    #: variant -> its reservoir of sampled calls (``verify="sampled"``)
    pools: dict[int, Pool] = attrs.field(factory=dict, repr=False)

    def room(self, family: Any, max_variants: int) -> str | None:
        """Why a new variant of ``family`` cannot be recorded, or ``None``."""
        n = self.families.get(family)
        if n is None:
            return "graphs" if len(self.families) >= max_variants else None
        return "sizes" if n >= MAX_SIZES else None

    def add(self, full: Any, family: Any) -> int:
        """Record the variant ``full`` of ``family`` (room was checked):
        its number."""
        index = len(self.index)
        self.index[full] = index
        self.families[family] = self.families.get(family, 0) + 1
        return index

    def drop(self, key: Any, snap: ContextSnapshot, why: str = "graphs") -> None:
        """Count one call of a variant past max_variants (under the lock)."""
        self.dropped_why[why] = self.dropped_why.get(why, 0) + 1
        self.dropped_calls += 1
        h = hash(key)
        if h in self.dropped:
            return
        if len(self.dropped) < MAX_DROPPED:
            self.dropped.add(h)
            if len(self.dropped_first) < 16:
                self.dropped_first.append(snap)
        else:  # bookkeeping stays bounded whatever a caller sends
            self.dropped_overflow = True

    @property
    def variants(self) -> dict[Any, VariantView]:
        """Every recorded variant with its calls summed over members."""
        out: dict[Any, list[tuple[str, MemberVariant]]] = {}
        for m in self.member_states:
            for key, mv in m.all_variants():
                if not mv.empty:
                    out.setdefault(key, []).append((m.name, mv))
        views = {}
        for key, pairs in sorted(out.items(), key=lambda kv: kv[1][0][1].index):
            first = pairs[0][1]
            outputs = next((mv.outputs for _, mv in pairs if mv.completed), None)
            holder = next(m for m in self.member_states if m.name == pairs[0][0])
            views[key] = VariantView(first.index, first.snapshot, first.inputs, outputs,
                                     sum(mv.calls for _, mv in pairs),
                                     tuple(n for n, _ in pairs), holder.module)
        return views

    def identity_id(self, identity: Any, state: Callable[[], Any] = tuple) -> int:
        """The number of ``identity`` in this scope; a new one is recorded
        with ``state()`` (``targets.state_of``: its attribute values, which
        capture puts back on a view of a member that changed since)."""
        for i, known in enumerate(self.identities):
            try:
                if known == identity:
                    return i
            except Exception:  # a config object whose __eq__ fails: not equal
                continue
        self.identities.append(identity)
        try:
            self.states.append(state())
        except Exception:  # not restorable: capture then finds no values to put back
            self.states.append(())
        return len(self.identities) - 1
