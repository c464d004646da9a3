"""Attaching to a model and detaching exactly: one wrapper per targeted
module, one ``Root`` on the module given to ``capture_with``, a counter on
each compiled entry point; and reading the variant table out as capture
requests."""

from __future__ import annotations

import sys
import threading
import types
from collections.abc import Callable
from typing import Any

from torch import nn

from ..capture.fold import folds
from ..capture.isolating import unwatch, watch
from ..capture.options import NO_ATTRIBUTE, CaptureOptions, MemberCall, Unrestorable, VariantRequest
from ..capture.stephooks import step_hooks
from ..core.observer import Observer
from ..fidelity.levels import level
from .copies import Entries, path_modules
from .modules import NO_FORWARD, CompiledEntry, before_ctxreplay
from .targets import (
    Memo,
    changed_attributes,
    describe_identity_change,
    held_objects,
    identity_digest,
    identity_of,
    structure_key,
    training_of,
)
from .variants import MemberVariant, Scope
from .watch import AssignmentWatch
from .wrapper import _Member, _Shared
from .wrapping import ForwardWatch, Root, Wrapper, let_go, reaches, unwrap, wrap

__all__ = ["Observation"]


def _compiled_entry_points(root: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """Compiled regions over or around observed blocks: ``(qualified name,
    owner, attribute)``."""
    out: list[tuple[str, nn.Module, str]] = []
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    optimized = getattr(eval_frame, "OptimizedModule", None)
    for name, m in root.named_modules():
        if optimized is not None and isinstance(m, optimized) and "forward" in m.__dict__:
            out.append((name, m, "forward"))
        elif m.__dict__.get("_compiled_call_impl") is not None:
            out.append((name, m, "_compiled_call_impl"))
    return out


def _unrecorded(name: str) -> Unrestorable:
    """Why an attribute the calls saw cannot be put back for their capture."""
    if name == "forward":  # its function is keyed by name only, never kept
        return Unrestorable("forward_replaced")
    return Unrestorable("not recorded")


class Observation:
    """Every member of one session, attached; ``detach()`` restores exactly."""

    def __init__(self, root: nn.Module, targets: list[tuple[str, nn.Module]], *,
                 observer: Observer, options: CaptureOptions,
                 step_cache_inside: tuple[str, ...] = ()) -> None:
        checks = level(options.verify)
        #: targets replaced by the step-cache-hooked submodules below them
        #: (``targets.beneath_step_caches``)
        self.step_cache_inside = step_cache_inside
        # calls are kept only at a level that checks values (sampled: chosen before each call)
        self.shared = _Shared(observer, max_variants=options.max_variants,
                              profile=options.profile_ranges,
                              retain_bytes=options.retain_bytes if checks.retains else None,
                              fold=folds(options), sample=checks.samples)
        ignore, max_scopes = options.ignore_attributes, options.max_scopes
        self.scopes: list[Scope] = []
        self.dropped_scopes: list[str] = []
        self.members: list[_Member] = []
        self.root: Root | None = None
        self.left: list[Wrapper] = []  # wrappers detach left in another tool's chain
        by_key: dict[tuple[Any, ...], Scope] = {}
        dropped: set[tuple[Any, ...]] = set()
        # compiled entry points that exist now run uncompiled while observed;
        # blocks compiled later are only marked (``wrapper._Tally``)
        self.compiled: list[CompiledEntry] = []
        for name, owner, attr in _compiled_entry_points(root):
            entry = CompiledEntry(owner, attr, name)
            owner.__dict__[attr] = entry
            self.compiled.append(entry)
        for name, mod in targets:
            key = structure_key(mod)
            scope = by_key.get(key)
            if scope is None:
                if len(by_key) >= max_scopes:
                    if key not in dropped:
                        dropped.add(key)
                    self.dropped_scopes.append(name or type(mod).__name__)
                    continue
                scope = Scope(name or type(mod).__name__, key, [])
                by_key[key] = scope
                self.scopes.append(scope)
            scope.members.append(name)
            member = _Member(mod, name, scope, self.shared, ignore)
            scope.member_states.append(member)
            wrap(member)
            self.members.append(member)
        #: members observed beneath a diffusers step cache's hooks, as
        #: ``"name (hook class, ...)"``
        self.beneath = [f"{m.name or m.scope.name} ({', '.join(step_hooks(m.module))})"
                        for m in self.members if m.beneath]
        # assignments to attributes of the members' trees drop their memos
        self.setattr_watch = AssignmentWatch()
        for member in self.members:
            self.setattr_watch.add([*member.module.modules(),
                            *held_objects(member.module, member.ignore)], member.changed)
        self.root = Root(root, (observer,), self.shared, self.shared.error)
        wrap(self.root)
        self.rewatching = threading.Lock()
        self.closed = False  # detach began
        self.replaced: list[_Member] = []  # members another tool's forward went round
        #: (member, calls) recorded under a forward another tool then replaced
        self.lost: list[tuple[str, int]] = []
        self.root.watch = ForwardWatch([m.module for m in self.members], self.rewatch)
        # a forward set anew is an assignment: the root looks only after one
        self.setattr_watch.add([m.module for m in self.members], self.root.watch.touched)
        watch(self)  # calls made by a capture or check elsewhere are not counted
        self.dropped_structures = len(dropped)
        # copies and torch.jit.script see a plain model (``observation.copies``)
        self.entries = [Entries(m) for m in path_modules(root, [m.name for m in self.members])]
        for e in self.entries:
            e.install()

    # -- another tool setting a member's forward anew -------------------------
    def rewatch(self, during: bool = False, *, final: bool = False) -> None:
        """Members whose ``forward`` another tool set anew, so that calls no
        longer go through their wrapper, are wrapped again around what is
        there now (``final``: at detach, only counted).  The calls recorded
        before ran another forward than the one capture will trace, unless
        the tool put back the same one: those are ``lost``; so is a member
        whose forward was set anew ``during`` a model call (the rest of its
        calls in that model call went unobserved)."""
        with self.rewatching:  # two threads' model calls may both find it
            self._rewatch(final, during)

    def _rewatch(self, final: bool, during: bool) -> None:
        if self.closed and not final:
            return  # a model call that began before detach: never wrap again
        root = self.root
        if final and root is not None and \
                not reaches(root.module.__dict__.get("forward", NO_FORWARD), root):
            # the root's own forward was set anew too: model calls since went
            # unchecked, so a member's calls may have gone unobserved
            during = True
        for i, m in enumerate(list(self.members)):
            if m.reached():
                continue
            current = m.current()
            calls = sum(mv.calls for _, mv in m.all_variants())
            if _same_forward(m.module, m.user_forward(), current):
                calls = 0  # what they ran is what capture traces
            if calls or during:
                self.lost.append((m.name or m.scope.name, calls))
            if final:
                continue
            new = _successor(m)
            self.members[i] = new
            states = m.scope.member_states
            states[states.index(m)] = new
            self.replaced.append(m)
            wrap(new)
        if self.root is not None and self.root.watch is not None:
            self.root.watch.update(m.module for m in self.members)

    def quiet(self) -> None:
        """A capture or check starts (``isolating.isolating()``): drop the
        members' memos, whose hits count without asking."""
        for m in self.members:
            m.memo = None

    # -- reading ------------------------------------------------------------
    def dropped(self) -> dict[str, int]:
        """What bookkeeping left out: variants past ``max_variants`` (and
        their calls), structures past ``max_scopes``."""
        return {"variants": sum(len(s.dropped) for s in self.scopes),
                "variant_calls": sum(s.dropped_calls for s in self.scopes),
                "scopes": self.dropped_structures}

    def member_modules(self) -> dict[str, nn.Module]:
        return {m.name: m.module for m in self.members}

    def requests(self) -> list[VariantRequest]:
        """One request per variant, members in attach order."""
        out = []
        # each member's identity now, read once: a member runs several variants;
        # the members read one after the other, what they share walked once
        now: dict[int, tuple[Any, ...] | None] = {}
        memo: Memo = {}
        for scope in self.scopes:
            per_index: dict[int, list[tuple[_Member, MemberVariant]]] = {}
            for m in self._of(scope):
                for _, mv in m.all_variants():
                    if not mv.empty:  # every call raised: nothing to reproduce
                        per_index.setdefault(mv.index, []).append((m, mv))
            for index in sorted(per_index):
                # members that still have the identity the variant ran under
                # first: the first completed one is traced (one whose forward
                # another tool set anew since traces another function)
                pairs = sorted(per_index[index], key=lambda p: p[0].identity != p[1].identity)
                first = pairs[0][1]
                recorded = next((mv for _, mv in pairs if mv.completed), first)
                identity = scope.identities[first.identity] if first.identity >= 0 else ()
                out.append(VariantRequest(
                    scope.name, index, first.snapshot, recorded.inputs,
                    tuple(MemberCall(m.name, mv.calls, mv.outputs, mv.completed,
                                     mv.retained.calls() if mv.retained else (),
                                     tuple(sorted(m.writes)),
                                     mv.retained.missed if mv.retained else 0,
                                     tuple(sorted(mv.moved.items(),
                                                  key=lambda p: p[0].where())))
                          for m, mv in pairs),
                    training_of(identity), identity_digest(identity) if identity else "",
                    self._state_back(scope, identity, [m for m, _ in pairs],
                                     first.identity, now, memo), first.identity))
        return out

    def _state_back(self, scope: Scope, identity: Any, members: list[_Member],
                    number: int, current: dict[int, tuple[Any, ...] | None], memo: Memo
                    ) -> tuple[tuple[str, str, Any], ...]:
        """The recorded attribute values a capture of ``identity``'s variant
        must put back on the views of ``members``: those that differ now (an
        attribute toggled after the variant ran).  A member whose structure
        changed gets an ``Unrestorable`` marker (capture then fails).
        ``current``: each member's identity now, by ``id`` of the member,
        filled as read; ``memo``: the readings' shared walk (``identity_of``)."""
        if number < 0 or not identity:
            return ()
        wanted: set[tuple[str, str]] = set()
        for m in members:
            if id(m) not in current:
                try:
                    current[id(m)] = identity_of(m.module, m.ignore, memo)
                except Exception:  # a user attribute may refuse reading: no identity
                    current[id(m)] = None
            now = current[id(m)]
            diff = None if now is None else changed_attributes(identity, now)
            if diff is None:
                return (("", "<structure>", Unrestorable("submodules or shapes")),)
            wanted |= diff
        if not wanted:
            return ()
        recorded = scope.states[number]
        out = tuple(e for e in recorded if (e[0], e[1]) in wanted)
        missing = wanted - {(e[0], e[1]) for e in out}
        held = {(entry[0], k) for entry in identity for k, _ in entry[5]}
        # an attribute the identity did not hold was added since: taken off
        # the view; one it held but could not record cannot be put back
        return out + tuple((path, name, _unrecorded(name) if (path, name) in held
                            else NO_ATTRIBUTE) for path, name in sorted(missing))

    def changed_members(self) -> list[tuple[Scope, _Member, str]]:
        """Members whose identity now differs from the one their calls were
        recorded under, changed in a way no assignment showed (an item of a
        dict it holds, changed in place): calls may have been keyed under a
        state they did not run in.  A change by assignment (``watch``) made
        the next call recheck its identity, and one after the last call ran
        with no call, so neither is a problem: every call was keyed as it ran."""
        out = []
        lost = {name for name, _ in self.lost}  # their forward changed: said there
        memo: Memo = {}  # the members read one after the other: what they share walked once
        for scope in self.scopes:
            for m in self._of(scope):
                if m.identity_value is None or not m.tables or m.dirty or \
                        (m.name or scope.name) in lost:
                    continue
                try:
                    now = identity_of(m.module, m.ignore, memo)
                except Exception:  # a user attribute may refuse reading: not compared
                    continue
                if m.module.training is m.training and now != m.identity_value:
                    out.append((scope, m, describe_identity_change(m.identity_value, now)))
        return out

    def stateful_members(self) -> list[tuple[Scope, str, tuple[str, ...]]]:
        """Members whose forward wrote Python state they hold."""
        return [(m.scope, m.name or m.scope.name, tuple(sorted(m.stateful)))
                for m in self.members if m.stateful]

    def raised_members(self) -> list[tuple[Scope, str, int]]:
        """Members whose forward raised in some calls (the caller handled it),
        with how many: those calls are left out of every variant."""
        out = []
        for m in self.members:
            n = m.raised()
            if n:
                out.append((m.scope, m.name or m.scope.name, n))
        return out

    def transformed_calls(self) -> dict[str, int]:
        """Member -> live calls made under a ``torch.func`` transform, which
        observation could not key (not observed)."""
        return dict(self.shared.transformed)

    def compiled_calls(self) -> tuple[dict[str, int], dict[str | None, list[str]]]:
        """The runs of each compiled entry point, observed uncompiled (by
        name), and the members Dynamo traced, which ran unobserved (how often
        is not countable), by the control-flow operator whose branch they
        ran in (``None``: code compiled after the session attached)."""
        eager = {c.name or type(c.owner).__name__: c.calls for c in self.compiled if c.calls}
        traced: dict[str | None, list[str]] = {}
        for m in self.members:
            if m.compiled.seen:
                traced.setdefault(m.compiled.branch, []).append(m.name or m.scope.name)
        return eager, traced

    def identity_value(self, request: VariantRequest) -> Any:
        """The identity of the members that ran ``request``'s variant."""
        return self.identity_values()(request)

    def identity_values(self) -> Callable[[VariantRequest], Any]:
        """``identity_value`` for many requests: the members' variants are
        walked once, here, not once per request."""
        first: dict[tuple[str, int], tuple[Scope, MemberVariant]] = {}
        for scope in self.scopes:
            for m in self._of(scope):
                for _, mv in m.all_variants():
                    first.setdefault((scope.name, mv.index), (scope, mv))

        def value(request: VariantRequest) -> Any:
            found = first.get((request.scope, request.variant))
            return None if found is None else found[0].identities[found[1].identity]

        return value

    def _of(self, scope: Scope) -> list[_Member]:
        return [m for m in self.members if m.scope is scope]

    # -- detaching ----------------------------------------------------------
    def _wrappers(self) -> list[Wrapper]:
        """Every wrapper, in the order ``__init__`` set them."""
        return [*self.members, *([self.root] if self.root else [])]

    def detach(self) -> None:
        """Stop observing and put back what each wrapped attribute held
        (``wrapping.unwrap``).  A wrapper another tool wrapped on top of
        stays in its chain as a pass-through holding no session state."""
        unwatch(self)
        self.closed = True
        self.rewatch(final=True)
        if self.root is not None:
            self.root.watch = None  # it holds the members' __dict__
        for e in reversed(self.entries):
            e.remove()
        self.setattr_watch.remove()
        self.left = unwrap(self._wrappers())
        # the entries went on before the wrappers (one may be what the root
        # wrapped: an ``OptimizedModule``'s forward), so they come off after
        for c in reversed(self.compiled):  # (their counts stay, for the report)
            if c.owner.__dict__.get(c.attr) is c:
                c.owner.__dict__[c.attr] = c.orig

    def release(self) -> None:
        """Drop every module reference (after detach and capture)."""
        self.entries = []
        for c in self.compiled:
            c.owner = None  # type: ignore[assignment]
            c.orig = c.eager = None  # type: ignore[assignment]
        let_go(self._wrappers(), self.left)
        let_go(self.replaced, self.replaced)  # they may still be in another tool's chain
        self.left, self.replaced = [], []
        self.shared.retention.kepts.clear()  # the copies go with their variants
        for m in self.members:
            m.memo = None
            m.scope.pools.clear()  # (a pool holds its members, and their modules)
            for table in m.tables.values():
                for mv in table.values():
                    mv.retained = None
                    mv.retained_inputs = None
                    mv.pool = None


def _successor(old: _Member) -> _Member:
    """A wrapper around what ``old``'s module holds in ``forward`` now,
    carrying on ``old``'s variants and state; ``old`` only passes calls
    through from now on (it may still be in another tool's chain)."""
    new = _Member(old.module, old.name, old.scope, old.shared, old.ignore)
    # its own: the wrapper's, and the identity (the forward is part of it),
    # so the calls from now on are variants of their own
    keep = {"module", "orig", "prev", "off", "key", "memo", "seat", "__weakref__", "identity",
            "identity_value", "table", "training", "lazy"}
    for cls in type(old).__mro__:
        for slot in getattr(cls, "__slots__", ()):
            if slot not in keep and hasattr(old, slot):
                setattr(new, slot, getattr(old, slot))
    new.table = new.tables.setdefault(new.identity, {})
    old.stop()
    return new


def _same_forward(module: nn.Module, before: Any, now: Any) -> bool:
    """Whether ``now`` (what ``forward`` holds, ctxreplay's wrappers skipped)
    is the forward ``before`` was (``None``: the class's)."""
    now = before_ctxreplay(now)

    def plain(fn: Any) -> Any:
        if isinstance(fn, types.MethodType) and fn.__self__ is module and \
                fn.__func__ is getattr(type(module).forward, "__func__", type(module).forward):
            return None
        return fn

    a, b = plain(before), plain(now)
    return a is b or (a is not None and b is not None and _equal(a, b))


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # a user value's == may raise anything: not equal
        return False


def _inside(member: str, qualified: str) -> bool:
    """Whether ``member`` is at or below the module ``qualified`` names."""
    return qualified == "" or member == qualified or member.startswith(qualified + ".")

