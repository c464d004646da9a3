"""Dispatching captured graphs back into a live model: ``install``.

Each member a capture stands for gets a thin ``forward`` wrapper (the
module's instance attribute, as observation uses; ``remove()`` puts back
exactly what was there).  A call runs a capture's program when its key
matches: the member (the capture lists it, and its weights fit the
program: names, shapes, dtypes, devices), its input signature (equal to the
recorded one, constants included; for a folded capture, equal but for the
dynamic sizes, each within the range it was verified over) and its context (the probes' states
equal those of the live call the capture was made from); and when the
capture's static needs hold (torch, device, autocast policy, fidelity).
Every other call runs eagerly and is counted as a miss with a reason.

The program runs with the member's own weights, which are read from its
modules on every call (``dispatch.bound``): one flat function written once
per capture from its graph (``dispatch.flat``) takes them, then the call's
tensors.  With ``compile``, ``program.module()`` with the member's tensors
assigned is compiled once per member on its first hit.  Per call: the
cached snapshot check (``observer.Observer``), a check of the call's tensors
against the last hit's (``TensorGuards``; for keyword or object arguments a
generated re-match, ``specs.rematch``), the tensors' metadata check, and
the program.  A member whose weights hooks put in place (offloading) has
its hooks run around the program; one whose submodules hold module hooks
(or while torch's global ones exist) runs eagerly (``dispatch.hooks``).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable
from typing import Any

import attrs
import torch
from torch import nn

from .._base.torchcaps import dynamo_compiling as _dynamo_compiling
from .._base.torchcaps import tensor_guard
from ..capture.results import Capture
from ..core.observer import Observer
from ..core.probe import ContextProbe
from ..core.snapshots import UnknownProbe, UnknownState
from ..loading.load import LoadedCapture, LoadedManifest
from ..observation.copies import Entries, path_modules
from ..observation.targets import held_objects
from ..observation.watch import AssignmentWatch
from ..observation.wrapping import Root, Wrapper, unwrap, wrap
from ..report.capture_report import CaptureReport
from ..specs.rematch import Rematcher, rematcher
from ..specs.signature import NotRealError, TransformedError, call_key, call_spec
from .hooks import Blocking, HookWatch
from .programs import REFUSED, STALE, UNFIT, Call, Compiler, Entry, Programs, Target, entry, sources

_log = logging.getLogger("ctxreplay")

__all__ = ["MISS_REASONS", "OBJECT_POLICIES", "DispatchStats", "InstallHandle", "install"]

#: ``object_args``: calls whose arguments hold Python objects (a KV cache, a
#: dataclass) run eagerly -- a forward may change such an object in Python,
#: which no graph records -- unless ``"dispatch"`` says they do not
OBJECT_POLICIES = ("eager", "dispatch")

#: every key of ``DispatchStats.reasons``: why a call ran eagerly
MISS_REASONS = ("signature", "context", "training", "identity", "object_arguments",
                "mutates_argument", "environment", "fidelity", "unknown_probe", "live_state",
                "structure", "not_rebuildable", "backend_not_dispatchable", "compile_failed",
                "observe_error", "size_guard", "weights", "hooked_weights", "hooks",
                "not_on_this_rank", "transformed", "baked_state")

_is_tracing = torch._C._is_tracing
_MEMO_LIMIT = 4096


@attrs.frozen
class DispatchStats:
    """Counts of an installed model's calls since ``install``.

    ``hits``: ``scope#variant`` -> calls that ran that capture's program;
    ``misses``: member -> calls that ran eagerly; ``reasons``: why, per
    reason code (``signature``: no capture of this member has the call's
    input signature; ``context``: one has, but under another context;
    ``training``: the member's ``training`` flag changed since install;
    ``mutates_argument``: the matching capture's forward changes an
    argument object in Python (a ``DynamicCache`` growing), which no run of
    its graph repeats, so it is never dispatched; ``identity``: the
    member's class, shapes, training flags or plain attributes differ from
    those it had when it ran the variant;
    ``object_arguments``, ``environment``, ``fidelity``, ``unknown_probe``,
    ``live_state``, ``structure``, ``not_rebuildable``,
    ``backend_not_dispatchable``, ``compile_failed``, ``observe_error``,
    ``transformed`` (a call under a ``torch.func`` transform: its tensors are
    functorch's wrappers, which no capture's signature takes),
    ``not_on_this_rank`` (a distributed report's capture whose program
    stayed on the rank that made it):
    the matching capture cannot be used here -- ``unusable`` says which
    capture, and why; ``size_guard``: a folded capture's ranges take the
    call's sizes but its graph's own guard refused them, e.g. a size the
    trace found had to be even; ``weights``: a tensor of the member no longer
    has the shape, dtype or device its program takes -- converted in place
    since install, ``module.to(torch.float64)`` -- or, for a program that
    holds the member's tensors (compiled), was replaced in its module
    without an assignment); ``hooked_weights``: the member's weights are put
    in place by hooks ctxreplay cannot follow (an offloading hook beside one
    that changes what the forward computes); ``hooks``: one of the member's
    submodules holds a module hook (or torch's global tables do) when it is
    called -- the graph, traced without user hooks, would skip it (the
    member's own hooks run around the graph as around its forward).
    ``compiled``: ``label@member`` compiled so far by ``compile=``, or
    bound to the capture's ahead-of-time compiled program (``ctxreplay
    compile``); ``uncompiled``: labels whose compiled program is not used,
    so the uncompiled one runs (a reason code of ``COMPILED_REASONS``:
    ``compiled_environment`` -- compiled for another torch, CPU ISA or
    accelerator --, ``compiled_failed``, ``compiled_missing``,
    ``compiled_load_failed``, ``compiled_mismatch``, ``compiled_overridden``,
    and ``compiled_autograd`` where calls autograd records ran uncompiled);
    ``unflattened``: labels whose program runs as torch's ``program.module()``
    (correct, but a dispatched call then costs ~10x more), and why;
    ``baked_state``: a place the capture's program read state from when
    traced -- a plain tensor attribute, a dict entry, a module global, a
    class attribute, a module the member only refers to -- holds something
    else now (``stale`` names it)."""

    hits: dict[str, int]
    """``scope#variant`` -> calls that ran that capture's program."""
    misses: dict[str, int]
    """Member -> calls that ran eagerly."""
    reasons: dict[str, int]
    """Reason code (one of ``MISS_REASONS``) -> eager calls for that reason."""
    unusable: dict[str, str]
    """``scope#variant`` -> why that capture cannot be used here (a reason code)."""
    compiled: tuple[str, ...] = ()
    """``label@member`` of the programs compiled so far by ``compile=``, or bound
    to their ahead-of-time compiled program."""
    unflattened: dict[str, str] = attrs.field(factory=dict)
    """``scope#variant`` -> why its program runs as ``program.module()``, not flattened."""
    uncompiled: dict[str, str] = attrs.field(factory=dict)
    """``scope#variant`` -> why its ahead-of-time compiled program is not used (a code
    of ``loading.compiled.COMPILED_REASONS``): its uncompiled program runs instead."""
    stale: dict[str, str] = attrs.field(factory=dict)
    """``scope#variant@member`` -> the place (``cfg['mode']``, ``global knobs.MODE``)
    whose state differs from what that capture's program baked in, at the last
    call refused for it (``baked_state``)."""

    @property
    def total_hits(self) -> int:
        """All hits."""
        return sum(self.hits.values())

    @property
    def total_misses(self) -> int:
        """All misses."""
        return sum(self.misses.values())


class _Route:
    """What the calls of one key run: a capture's program (``target``), or
    ``None`` and why they run eagerly (``reason``, a code of ``MISS_REASONS``)."""

    __slots__ = ("reason", "target")

    def __init__(self, target: Target | None, reason: str = "") -> None:
        self.target, self.reason = target, reason


#: the routes a call takes without a look-up (one object each: no allocation per call)
_EAGER = {r: _Route(None, r) for r in MISS_REASONS}


def _eager(reason: str) -> _Route:
    """The route of calls that run eagerly for ``reason``."""
    route = _EAGER.get(reason)
    return route if route is not None else _Route(None, reason)


class _Last:
    """A member's last call of positional plain tensors: the context it was
    read under, its argument count, the C-level check of its tensors
    (``TensorGuards.check``) and its route."""

    __slots__ = ("check", "count", "route", "snaps")

    def __init__(self, snaps: Any, count: int, check: Any, route: _Route) -> None:
        self.snaps, self.count, self.check, self.route = snaps, count, check, route


class _Rematch:
    """The generated rematch of one call key (``specs.rematch``), and what
    the calls it finds equal but for their tensors' sizes and strides run,
    by those sizes and strides."""

    __slots__ = ("by_sizes", "fn")

    def __init__(self, fn: Rematcher) -> None:
        self.fn = fn
        self.by_sizes: dict[Any, _Route] = {}


class _Near:
    """A member's last call of any other kind (keywords, objects): the
    context it was read under, its key's rematch and its route."""

    __slots__ = ("by_sizes", "fn", "route", "snaps")

    def __init__(self, snaps: Any, rematch: _Rematch, route: _Route) -> None:
        self.snaps, self.fn, self.by_sizes, self.route = \
            snaps, rematch.fn, rematch.by_sizes, route


class _Slot(Wrapper):
    """The dispatch state of one member; ``forward`` is its wrapper."""

    __slots__ = (*Wrapper.FIELDS, "entries", "groups", "handle", "hooked", "last", "memo",
                 "misses", "name", "near", "observers", "programs", "reasons", "rematch", "routes",
                 "training")

    def __init__(self, handle: InstallHandle, name: str, module: nn.Module,
                 programs: Programs) -> None:
        super().__init__(module, beneath=True)  # a step cache decides whether it runs
        self.handle, self.name = handle, name
        #: the programs of the handle's captures, bound per member
        self.programs = programs
        #: every observer of the handle (``InstallHandle._attach``): a call
        #: made outside the model checks their numerics-only flags itself
        self.observers: tuple[Observer | HookWatch, ...] = ()
        self.training = module.training
        self.entries: list[Entry] = []
        self.groups: list[tuple[Observer, list[Entry]]] = []
        self.memo: dict[Any, _Route] = {}
        self.last: _Last | None = None
        self.near: _Near | None = None
        #: call key -> the rematch made for it (``None``: it cannot have one)
        self.rematch: dict[Any, _Rematch | None] = {}
        #: id of an entry -> the route to its program for this member
        self.routes: dict[int, _Route] = {}
        self.misses = 0
        self.reasons: Counter[str] = Counter()
        #: what the user hooks inside the member (a submodule's, a global one) ask
        #: of its calls (``hooks.blocking``): the graph would skip them
        self.hooked: Blocking = False

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.off or _dynamo_compiling() or _is_tracing():
            if not self.off and _dynamo_compiling():
                return self.traced(args, kwargs)
            return self.orig(*args, **kwargs)
        if self.module.training is not self.training:
            self.misses += 1
            self.reasons["training"] += 1
            return self.orig(*args, **kwargs)
        route: _Route
        leaves: Any = None
        try:
            groups = self.groups
            if not self.handle.active:  # called outside the model: check those flags here
                for obs in self.observers:
                    obs.forward_changed()
            if len(groups) == 1:
                snaps: Any = groups[0][0]()
            else:
                snaps = tuple(g[0]() for g in groups)
            last, near = self.last, self.near
            # (a truth test first: a member without inner hooks pays what it did)
            if self.hooked and (self.hooked is True or self.hooked()):
                route = _EAGER["hooks"]  # a hook inside it would not run: the graph skips it
            elif last is not None and last.snaps is snaps and not kwargs \
                    and len(args) == last.count and last.check(*args):
                route = last.route
            elif near is not None and near.snaps is snaps and \
                    (leaves := near.fn(args, kwargs)) is not None:
                if type(leaves) is list:
                    route = near.route
                else:  # (a ``Resized``: the same call but for sizes)
                    route, leaves = self._resized(near, snaps, leaves[0], args, kwargs)
            else:
                route = self._keyed(snaps, args, kwargs)
        except TransformedError:  # a live call under vmap / grad: no graph takes it
            route = _EAGER["transformed"]
        except NotRealError:  # a tracer's stand-ins: not a live call
            return self.orig(*args, **kwargs)
        except Exception:  # dispatch must never break the forward
            _log.debug("dispatch: observing a call failed: observe_error", exc_info=True)
            route = _EAGER["observe_error"]
        skip: set[int] | None = None
        while (target := route.target) is not None:
            if target.failed:
                route = _EAGER["compile_failed"]
                break
            out = target.run(args, kwargs, leaves)
            if out is UNFIT:
                route = _EAGER["weights"]
                break
            if out is STALE:  # what its program baked in changed: see ``stale``
                route = _EAGER["baked_state"]
                assert target.guard is not None and target.guard.failed is not None
                self.handle.stale[f"{target.entry.label}@{self.name}"] = \
                    target.guard.failed.where()
                break
            if out is REFUSED:  # its graph's own guard: another capture may take it
                skip = {id(target.entry)} if skip is None else skip | {id(target.entry)}
                route = self._refused(args, kwargs, skip)
                leaves = None
                continue
            if target.failed:
                route = _EAGER["compile_failed"]
                break
            target.entry.hits += 1
            return out
        self.misses += 1
        self.reasons[route.reason] += 1
        return self.orig(*args, **kwargs)

    def _keyed(self, snaps: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Route:
        """What a call runs (its route), by its full key.
        The next call of the same key is answered without it: for positional
        plain tensors by a check of those tensors (``last``), for any other
        call by a generated rematch (``near``: keywords, objects) -- a miss
        as cheaply as a hit."""
        key = (snaps, call_key(args, kwargs))
        route = self.memo.get(key)
        if route is None:
            route = self._resolve(snaps, key, args, kwargs)
        check = tensor_guard(args) if args and not kwargs else None
        if check is not None:
            self.last = _Last(snaps, len(args), check.check, route)
            return route
        if key not in self.rematch:
            fn = rematcher(args, kwargs)
            self.rematch[key] = None if fn is None else _Rematch(fn)
        again = self.rematch[key]
        self.near = None if again is None else _Near(snaps, again, route)
        return route

    def _resized(self, near: _Near, snaps: Any,
                 leaves: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
                 ) -> tuple[_Route, Any]:
        """What a call runs (its route) that ``near``'s rematch finds equal to its call
        but for its tensors' sizes and strides (a cache one token longer):
        its key is that of any earlier such call with those sizes and
        strides, so it is looked up by them, and keyed in full only the
        first time (no walk of the cache object, no new rematch).  With
        ``leaves``, the call's tensors, as the caller takes them back."""
        sizes = tuple([(t.shape, t.stride()) for t in leaves])
        by_sizes = near.by_sizes
        route = by_sizes.get(sizes)
        if route is None:
            key = (snaps, call_key(args, kwargs))
            route = self.memo.get(key)
            if route is None:
                route = self._resolve(snaps, key, args, kwargs)
            if len(by_sizes) >= _MEMO_LIMIT:
                by_sizes.clear()
            by_sizes[sizes] = route
        return route, leaves

    def _resolve(self, snaps: Any, key: Any, args: tuple[Any, ...],
                 kwargs: dict[str, Any], skip: set[int] | frozenset[int] = frozenset()
                 ) -> _Route:
        """What calls of ``key`` run: a capture's program, or why they run
        eagerly (``skip``: captures whose graph refused these sizes)."""
        call = Call(call_spec(args, kwargs))
        per_group = (snaps,) if len(self.groups) == 1 else snaps
        # the most telling reason wins: a capture that matches but cannot be
        # used here, then one of another context, then none of this signature
        reason = "signature"
        found: _Route | None = None
        for (_obs, entries), snap in zip(self.groups, per_group):
            for e in entries:
                if id(e) in skip:
                    continue
                if not e.comparable or e.unusable is not None:
                    if not e.comparable or e.matches(call):
                        reason = e.unusable or "not_rebuildable"
                    continue
                if not e.matches(call):
                    continue
                if e.match != snap:
                    if reason == "signature":
                        reason = "context"
                    continue
                route = self._target(e)
                if route.target is not None:
                    found = route
                    break
                reason = route.reason
            if found is not None:
                break
        result = found if found is not None else _eager(reason)
        if len(self.memo) >= _MEMO_LIMIT:
            self.memo.clear()
            self.rematch.clear()
        self.memo[key] = result
        return result

    def _refused(self, args: tuple[Any, ...], kwargs: dict[str, Any],
                 skip: set[int]) -> _Route:
        """A folded graph's guard refused this call's sizes: the next capture
        that takes them (a fold of the other side of a branch), remembered
        for calls of these sizes; else ``size_guard`` (the call runs eagerly)."""
        self.last = self.near = None
        try:
            snaps = self.groups[0][0]() if len(self.groups) == 1 \
                else tuple(g[0]() for g in self.groups)
            key = (snaps, call_key(args, kwargs))
            found = self._resolve(snaps, key, args, kwargs, skip)
        except Exception:  # only a second look: the call runs eagerly
            return _EAGER["size_guard"]
        if found.target is None:
            found = _EAGER["size_guard"]
            self.memo[key] = found
        return found

    def stop(self) -> None:
        super().stop()
        self.memo.clear()
        self.rematch.clear()
        self.last = self.near = None
        self.routes.clear()

    def invalidate(self) -> None:
        """The member's tensors, submodules or attributes were replaced: bind
        again (checking its identity again).  The rematches stay: each reads
        only a call's arguments, never the member (what they found runs
        goes: it is bound to what the member held)."""
        self.last = self.near = None
        self.memo.clear()
        for again in self.rematch.values():
            if again is not None:
                again.by_sizes.clear()
        self.routes.clear()
        self.programs.forget(self.name)

    def _target(self, e: Entry) -> _Route:
        """The route to ``e``'s program for this member, made once; or why
        the member cannot run it."""
        route = self.routes.get(id(e))
        if route is None:
            reason = self.programs.fits(e, self.name, self.module)
            if reason is not None:
                return _eager(reason)
            route = self.routes[id(e)] = _Route(Target(e, self.programs, self.name,
                                                       self.module))
        return route


class InstallHandle:
    """What :func:`ctxreplay.install` returns: ``stats()`` counts hits and
    misses, ``remove()`` restores the model exactly (also on ``with``
    exit)."""

    def __init__(self, model: nn.Module, entries: list[Entry],
                 compile: Compiler | None) -> None:
        self.model = model
        """The model whose members dispatch to captures."""
        self._entries = entries
        self._slots: list[_Slot] = []
        self._programs = Programs(compile)
        self._owners: dict[int, _Slot] = {}
        self._hooks: list[Any] = []
        self._attributes = AssignmentWatch()
        #: what the slots read the context with (and the hook watch)
        self._observers: tuple[Observer | HookWatch, ...] = ()
        self._root: Root | None = None
        self._copies: list[Entries] = []
        self.active = 0  # calls of the model in progress
        """Calls of the model in progress."""
        self.removed = False
        """Whether ``remove()`` has run."""
        self.stale: dict[str, str] = {}
        """``label@member`` -> the last place whose state differed from what
        that capture's program baked in (``DispatchStats.stale``)."""

    def _attach(self, modules: dict[str, nn.Module]) -> None:
        """A slot per member, wrapped around its forward, with what watches
        the members: replaced tensors and assigned attributes, hooks added,
        the numerics-only flags per model call, copies of the model."""
        observers = self._add_slots(modules)
        self._watch()
        # after ``_watch``, whose registration hooks count as hooks registered
        watch = HookWatch([s.module for s in self._slots], self._hooks_changed)
        self._observers = (*observers.values(), watch)
        for slot in self._slots:
            slot.observers = self._observers
            wrap(slot)
        if all(s.module is not self.model for s in self._slots):
            # the members read the numerics-only flags only while no model
            # call is in progress
            self._root = Root(self.model, self._observers, self)
            wrap(self._root)
        # copies, pickles and torch.jit.script of the model are plain
        # (``observation.copies``)
        self._copies = [Entries(m) for m in path_modules(self.model, list(modules))]
        for c in self._copies:
            c.install()

    def _add_slots(self, modules: dict[str, nn.Module]) -> dict[tuple[Any, ...], Observer]:
        """A slot per member, its captures grouped by the probes their contexts
        name, one observer per group (shared by the slots); returns the observers."""
        observers: dict[tuple[Any, ...], Observer] = {}
        bound: dict[int, ContextProbe[Any]] = {}  # a probe of per-model state reads model's
        for name, module in modules.items():
            slot = _Slot(self, name, module, self._programs)
            slot.entries = [e for e in self._entries if name in e.members]
            by_probes: dict[tuple[Any, ...], list[Entry]] = {}
            for e in slot.entries:
                probes = tuple(p for p, s in zip(e.match.probes, e.match.states)
                               if not isinstance(p, UnknownProbe)
                               and not isinstance(s, UnknownState))
                key = tuple((p.name, id(p)) for p in probes)
                if key not in observers:
                    # the numerics-only flags (watch_forward) are checked once per
                    # call of ``model``, as observation does: too many to read on
                    # every block call
                    observers[key] = Observer(
                        tuple(bound.setdefault(id(p), p.bind(self.model)) for p in probes),
                        per_call=False)
                by_probes.setdefault(key, []).append(e)
            slot.groups = [(observers[k], v) for k, v in by_probes.items()]
            self._slots.append(slot)
        return observers

    @property
    def compile(self) -> Compiler | None:
        """The compiler applied to each member's program on its first hit (``None``: run the
        programs as they are)."""
        return self._programs.compile

    def _watch(self) -> None:
        """Re-bind a member whose parameter, buffer or submodule is replaced
        (``block.lin.weight = nn.Parameter(...)``, ``load_state_dict(...,
        assign=True)``): torch's global registration hooks fire then, so no
        call pays for noticing.  In-place updates need nothing: the program
        runs with the member's own tensors."""
        self._owners = {id(m): s for s in self._slots for m in s.module.modules()}
        if self._hooks:
            return
        # an attribute assigned on a member's tree (``block.use_gate = False``,
        # ``set_processor``) may select another graph: the member's identity is
        # checked again before its next dispatch (changes made without an
        # assignment, an item of a dict it holds, are not seen)
        for slot in self._slots:
            ignore = {a for e in slot.entries for a in e.ignore_attributes}
            self._attributes.add([*slot.module.modules(), *held_objects(slot.module, ignore)],
                                 slot.invalidate)
        mod = torch.nn.modules.module
        for name in ("register_module_parameter_registration_hook",
                     "register_module_buffer_registration_hook",
                     "register_module_module_registration_hook"):
            register = getattr(mod, name, None)
            if register is not None:
                self._hooks.append(register(self._replaced))

    def _hooks_changed(self, index: int, blocks: Blocking) -> None:
        self._slots[index].hooked = blocks

    def _replaced(self, module: nn.Module, name: str, value: Any) -> None:
        slot = self._owners.get(id(module))
        if slot is not None and not self.removed:
            slot.invalidate()
            if isinstance(value, nn.Module):
                self._owners = {id(m): s for s in self._slots for m in s.module.modules()}

    @property
    def members(self) -> tuple[str, ...]:
        """The members whose calls are dispatched."""
        return tuple(s.name for s in self._slots)

    def stats(self) -> DispatchStats:
        """Hits per capture, misses per member and their reasons."""
        reasons: Counter[str] = Counter()
        for s in self._slots:
            reasons.update(s.reasons)
        unusable = {e.label: e.unusable for e in self._entries if e.unusable is not None}
        unusable.update(self._programs.unfit)
        return DispatchStats({e.label: e.hits for e in self._entries},
                             {s.name: s.misses for s in self._slots}, dict(reasons),
                             unusable, tuple(self._programs.compiled),
                             dict(self._programs.unflattened),
                             {e.label: e.uncompiled[0] for e in self._entries
                              if e.uncompiled is not None}, dict(self.stale))

    def remove(self) -> None:
        """Put back every member's ``forward`` as it was; a wrapper another
        tool set on top of ours stays, and ours passes calls straight
        through.  Idempotent."""
        if self.removed:
            return
        self.removed = True
        unwrap([*self._slots, *([self._root] if self._root else [])])
        self._programs.clear()
        self._attributes.remove()
        for c in reversed(self._copies):
            c.remove()
        self._copies.clear()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self._owners.clear()

    def __enter__(self) -> InstallHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def install(model: nn.Module,
            source: CaptureReport | LoadedManifest | Capture | LoadedCapture
            | Iterable[CaptureReport | LoadedManifest | Capture | LoadedCapture], *,
            compile: Compiler | None = None,
            ignore: Iterable[str] = (), object_args: str = "eager") -> InstallHandle:
    """Route each captured member's calls to the capture whose key matches.

    For every member a capture lists, ``model.<member>``'s calls are matched
    by member, input signature and context (the probes' states of the live
    call the capture was made from); a match runs the capture's program with
    that member's own weights, any other call runs eagerly (a miss, counted
    with its reason in ``handle.stats()``).  Without ``compile`` the outputs
    are those of the program (bit-identical to eager for the models tried).

    Args:
        model: the live model the captures were made from.
        source: a ``CaptureReport``, what :func:`ctxreplay.load` returns, a
            ``Capture``, or an iterable of them.
        compile: ``torch.compile`` or any callable ``GraphModule -> callable``
            (a kernel-discovery tool's compiler), applied once per member on
            its first hit; a compiler that fails warns and leaves that member
            eager.
        ignore: probe names left out of the context key (you vouch for them:
            e.g. a framework's forward context this process cannot compare).
        object_args: ``"eager"`` (default) runs calls whose arguments hold
            Python objects (a KV cache) eagerly, since a forward may update
            such an object in Python where no graph records it -- a capture
            found doing so is never dispatched (``mutates_argument``), but
            the walk of the arguments sees only what a forward does when it
            runs, and an object can change in ways it does not follow (state
            in ``__slots__``, past its depth and size bounds);
            ``"dispatch"`` dispatches them too, a loaded capture's included
            (matched through its document: classes by import path,
            constants by key digest).

    Returns:
        An :class:`InstallHandle`: ``stats()`` counts hits and misses,
        ``remove()`` (or the ``with`` exit) restores the model exactly.

    Raises:
        ValueError: a member that is not in ``model``, or an unknown
            ``object_args``.
        TypeError: ``model`` is not an ``nn.Module``, ``source`` is none of
            the above, or ``compile`` is not callable.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"install: expected an nn.Module, got {type(model).__name__}")
    if compile is not None and not callable(compile):
        raise TypeError("install: compile must be None, torch.compile or a callable taking "
                        "a GraphModule")
    if object_args not in OBJECT_POLICIES:
        raise ValueError(f"object_args: {object_args!r} is not one of {list(OBJECT_POLICIES)}")
    ignore = tuple(ignore)
    entries = [entry(s, ignore, object_args, model) for s in sources(source)]
    modules = _members(model, entries)
    handle = InstallHandle(model, entries, compile)
    handle._attach(modules)
    _log.info("install: %d captures bound to %d members of %s (%s)", len(entries), len(modules),
              type(model).__name__, _names(list(modules)))
    for e in entries:
        if e.uncompiled is not None:
            _log.warning("install: %s runs its uncompiled program: %s (%s)", e.label,
                         e.uncompiled[1], e.uncompiled[0])
    return handle


def _members(model: nn.Module, entries: list[Entry]) -> dict[str, nn.Module]:
    """Each member the captures list, by name: a name the model lacks is refused."""
    modules: dict[str, nn.Module] = {}
    for e in entries:
        for m in e.members:
            if m in modules:
                continue
            try:
                modules[m] = model.get_submodule(m)
            except AttributeError:
                raise ValueError(f"install: the model has no submodule {m!r} (a member of "
                                 f"{e.label})") from None
    return modules


def _names(names: list[str], shown: int = 4) -> str:
    """The first few names and how many more."""
    more = len(names) - shown
    return ", ".join(names[:shown]) + (f" and {more} more" if more > 0 else "")
