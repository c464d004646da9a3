"""Observation on the hot path: the wrapper around every targeted module's
forward, which observes each call cheaply and records its variant.

Each targeted module gets one ``_Member``: its bound ``forward`` is set as
the module's instance attribute (``Module.__call__`` finds it like the
class's forward; hooks still run; measured, the wrapper costs about
0.06 us a call, a no-op forward hook pair about 2.3 us); ``attach`` sets and
unsets it.  A
call's key is (snapshot, input signature) inside a table per *identity*
(``targets.identity_of``: class, shapes, ``training`` and plain attributes),
so members share a capture only when nothing but their weights differ.
The hot path reuses a cached snapshot (``observer.Observer``) and a memo of
the member's last variant checked in C by ``TensorGuards``.

The module passed to ``capture_with`` gets a root wrapper too
(``wrapping.Root``, the one ``install`` uses as well): per call of the
whole model it checks the numerics-only flags that probes list
in ``watch_forward`` (too many to read on every block call); a change of
one inside a forward counts from the next model call (``watch="call"``
reads them on every block call instead).

Copies of an observed module (``copy.deepcopy``, ``pickle``, ``torch.save``)
are plain models (``observation.copies``); a copy of a wrapper that another tool holds
calls the copy's own forward and observes nothing (``Detached``).
"""

from __future__ import annotations

import itertools
import os
import re
import sys
import threading
import types
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from .._base.torchcaps import CAPS, tensor_guard
from .._base.torchcaps import dynamo_compiling as _dynamo_compiling
from .._base.torchcaps import dynamo_exporting as _dynamo_exporting
from ..capture.isolating import isolating
from ..capture.pystate import reach
from ..core.observer import Observer, ProbeObservationError
from ..core.snapshots import ContextSnapshot
from ..specs.dims import size_free_key
from ..specs.frozen import freeze_constants
from ..specs.signature import NotRealError, TransformedError, call_key, call_spec, spec_of
from .modules import NO_FORWARD, held_changes, held_state, in_jit_check, uninitialized
from .places import places_of
from .retained import SAMPLED, Kept, Pool, Retention
from .targets import identity_of, state_of
from .variants import MemberVariant, Scope
from .wrapping import Wrapper

__all__ = ["NO_FORWARD"]


_is_tracing = torch._C._is_tracing  # torch.jit.trace records every Python tensor access

#: the attribute steps of a ``pystate`` label (``Memo.last``, ``X.cache['k']``)
_ATTRIBUTE = re.compile(r"\.([A-Za-z_]\w*)")

#: the longest label of a write the report names
_LABEL = 160

#: ``_lookup``: a call retained for the value check, and one sampled into its
#: variant's reservoir
_RETAINED, _POOLED = 1, 2

_MARKS = itertools.count()


#: torch's control-flow operators, by the module torch implements each in
#: (``torch/_higher_order_ops/<name>.py``) or the prefix of the Dynamo
#: variable that traces it (``CondHigherOrderVariable``)
_OPERATORS = {"cond": "torch.cond", "while_loop": "while_loop", "scan": "scan", "map": "map",
              "associative_scan": "associative_scan"}
_HOP_FILE = "_higher_order_ops" + os.sep
_DYNAMO_HOP_FILE = os.path.join("_dynamo", "variables", "higher_order_ops.py")


def control_flow(frame: types.FrameType | None) -> str | None:
    """The control-flow operator (``torch.cond``, ``while_loop``, ...) whose
    branch the code at ``frame`` runs in, read from the stack: torch runs a
    branch through its operator's own module, and Dynamo traces one inside
    compiled code through a ``*HigherOrderVariable``; ``None`` outside any
    (other higher-order operators, a checkpoint's say, are not control
    flow).  Read only where Dynamo traces, never per call."""
    traced = None
    while frame is not None:
        path = frame.f_code.co_filename
        if _HOP_FILE in path:
            stem = os.path.splitext(os.path.basename(path))[0]
            if stem in _OPERATORS:
                return _OPERATORS[stem]
        elif traced is None and path.endswith(_DYNAMO_HOP_FILE):
            owner = type(frame.f_locals.get("self")).__name__
            if owner.endswith("HigherOrderVariable"):
                name = re.sub(r"(?<!^)(?=[A-Z])", "_", owner.removesuffix("HigherOrderVariable"))
                traced = _OPERATORS.get(name.lower())
        frame = frame.f_back
    return traced


class _Tally:
    """Whether Dynamo traced the member into compiled code (``_Member._call``).

    ``mark`` runs when Dynamo *traces* a call of it, not when the compiled
    code runs: a function marked as ``torch._dynamo.assume_constant_result``
    marks it (``_dynamo_marked_constant``, the attribute that decorator sets
    on 2.7-2.14) is called by Dynamo at trace time and its result kept as a
    constant.  So observation stores nothing in the traced code -- a store
    there is a side effect Dynamo refuses inside a higher-order op's body
    (``torch.cond``, ``while_loop``: "Non-nullified side effect", the user's
    forward raised) and replays on every run elsewhere."""

    __slots__ = ("branch", "mark", "seen")

    def __init__(self) -> None:
        self.seen = False
        #: the control-flow operator whose branch Dynamo traced it in, if any
        self.branch: str | None = None

        def mark() -> bool:
            self.seen = True
            self.branch = self.branch or control_flow(sys._getframe(1))
            return True

        # Dynamo guards a function it reads by its code object alone
        # (``CLOSURE_MATCH``): with one code for every member, code traced for
        # one block (a ``torch.cond`` branch) would run for the next without
        # a trace, unmarked.  A code object of its own per member makes that a
        # recompile, and a mark.
        unique = mark.__code__.replace(co_name=f"mark_{next(_MARKS)}")
        self.mark = types.FunctionType(unique, mark.__globals__, unique.co_name, None,
                                       mark.__closure__)
        self.mark._dynamo_marked_constant = True  # type: ignore[attr-defined]


class _Python:
    """The memo check where ``TensorGuards`` is unavailable: the Python key
    (never under ``torch.jit.trace``, which would record its reads)."""

    __slots__ = ("sig",)

    def __init__(self, sig: Any) -> None:
        self.sig = sig

    def check(self, *args: Any) -> bool:
        if _is_tracing():
            return False
        try:
            return bool(call_key(args, {}) == self.sig)
        except NotRealError:
            return False


def _memo_check(args: tuple[Any, ...], sig: Any) -> Any:
    """What a memo hit checks the call's arguments with.  It must fail under
    ``torch.jit.trace`` (a traced call is not a live one, and the slow path
    reads no shape while tracing): ``TensorGuards`` does where it sees the
    tracer's thread-local dispatch key, so the hit path asks nothing else;
    elsewhere the Python key, which asks."""
    check = tensor_guard(args) if CAPS.tensor_guards_see_jit_tracing else None
    return check if check is not None else _Python(sig)


def _both(state: Any, places: Any) -> Any:
    """The memo's state check, and then its member's places."""
    def check() -> bool:
        return bool(state() and places())
    return check


def _tags_too(inputs: Any, same_tags: Any) -> Any:
    """The memo's check of the inputs, and then of the Python attributes its
    member's forward reads off them."""
    def check(*args: Any) -> bool:
        return bool(inputs(*args) and same_tags(args))
    return check


class _Memo:
    """What a repeat of a member's last variant needs on the hot path
    (``_Member.forward``), read from one object: attribute reads of a
    slotted object cost about what unpacking a tuple does (CPython 3.11
    specialises both)."""

    __slots__ = ("cache", "check", "counter", "module", "obs", "orig", "shared", "state",
                 "ticks", "training")

    def __init__(self, cache: Any, state: Any, check: Any, ticks: Any, training: bool,
                 member: _Member, counter: Any) -> None:
        #: the observer's cached snapshot object the memo was made under
        self.cache = cache
        #: the C-level check that the snapshot still holds, and of the inputs
        self.state, self.check = state, check
        #: counts each hit on the variant's counter; runs out when a call is
        #: due to be sampled for the value check
        self.ticks, self.counter = ticks, counter
        self.training = training
        self.module, self.orig = member.module, member.orig
        self.obs, self.shared = member.shared.observer, member.shared


class _Shared:
    """What every member of one session shares."""

    __slots__ = ("active", "errors", "failing_probes", "fold", "lock", "max_variants",
                 "observer", "profile", "retention", "transformed")

    def __init__(self, observer: Observer, *, max_variants: int, profile: bool,
                 retain_bytes: int | None, fold: bool = False, sample: bool = False) -> None:
        self.observer = observer
        self.lock = threading.Lock()
        self.max_variants = max_variants
        #: variants of a member that differ in sizes only, and members that
        #: differ in plain attributes only, count once against max_variants
        self.fold = fold
        self.profile = profile
        self.retention = Retention(retain_bytes, self.lock, sample)
        self.errors: Counter[tuple[str, str]] = Counter()
        self.failing_probes: Counter[str] = Counter()
        #: member -> live calls under a ``torch.func`` transform (not observed)
        self.transformed: Counter[str] = Counter()
        self.active = 0  # calls of the root module in progress (approximate across threads)

    def error(self, where: str, exc: BaseException) -> None:
        """Count one observation error by where it happened and the type of
        what was raised (a probe's own exception, not our wrapper of it)."""
        if isinstance(exc, ProbeObservationError):
            what, probe = exc.exc_type, exc.probe
        else:
            what, probe = type(exc).__name__, None
        with self.lock:
            self.errors[(where, what)] += 1
            if probe is not None:
                self.failing_probes[probe] += 1


class _Member(Wrapper):
    """The observation state of one targeted module; ``forward`` is its wrapper."""

    __slots__ = (*Wrapper.FIELDS, "compiled", "dirty", "identity", "identity_value", "ignore",
                 "lazy", "mark", "memo", "name", "places", "scope", "shared", "stateful", "table",
                 "tables", "training", "writes")

    def __init__(self, module: nn.Module, name: str, scope: Scope, shared: _Shared,
                 ignore: tuple[str, ...]) -> None:
        super().__init__(module, beneath=True)  # a step cache decides whether it runs
        self.name = name
        self.scope = scope
        self.shared = shared
        self.ignore = ignore
        self.compiled = _Tally()
        # read by Dynamo from the member itself: torch 2.7's cannot build the
        # ``_Tally`` it would read it through ("Unexpected type in sourceless
        # builder") inside a ``torch.cond`` branch
        self.mark = self.compiled.mark
        self.stateful: set[str] = set()  # held attributes its forward wrote
        #: what a repeat call wrote in the Python state the forward keeps
        self.writes: set[str] = set()
        self.memo: _Memo | None = None
        self.tables: dict[int, dict[Any, MemberVariant]] = {}
        self.lazy = uninitialized(module)
        self.identity_value: Any = None
        self.identity = -1
        self.training = module.training
        self.table: dict[Any, MemberVariant] = {}
        self.dirty = False  # an attribute of the member's tree was assigned (``watch``)
        #: the state its code reads beside its arguments and weights, checked per call
        self.places = places_of(module, ignore)
        if not self.lazy:
            self.refresh_identity()

    # -- the hot path -----------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # The memo (``_memoize``) holds everything a repeat of the member's
        # last variant needs, in one object: a hit reads one attribute of
        # ``self`` and makes one C-level check of the state (the guard and the
        # watched getters) and one of the inputs (``TensorGuards``).  ``ticks``
        # counts the hit on the variant's counter, and runs out when a call
        # is due to be sampled for the value check (``retained.Pool``),
        # which the slow path then copies.  Every operation here is paid on
        # every observed call.
        # (Dynamo folds ``_dynamo_compiling()`` first, so it guards on nothing here.)
        if not _dynamo_compiling():
            memo = self.memo
            if memo is not None and not kwargs:
                # (another argument count fails ``check``: TensorGuards raises, the
                # Python key differs; under ``torch.jit.trace`` it fails as well,
                # ``_memo_check``)
                obs = memo.obs
                if obs.cache is memo.cache and memo.module.training is memo.training:
                    try:
                        hit = (memo.state() and memo.check(*args)
                               and (memo.shared.active or not obs.forward_changed()))
                    except Exception:  # a getter or check that raises: the slow path decides
                        hit = False
                    # (``ticks`` counts the call on the variant's counter; run out,
                    # a sample is due and the slow path takes the call uncounted)
                    if hit and next(memo.ticks, None) is not None:
                        try:  # (free in CPython >= 3.11 until something raises)
                            return memo.orig(*args)
                        except BaseException:  # counted as raised, then re-raised
                            self._raised(memo.counter)
                            raise
        return self._call(args, kwargs)

    def _call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Every call the memo does not answer."""
        if self.off or _dynamo_compiling() or _is_tracing() or isolating():
            # (``isolating()``: ctxreplay's own capture or check of a module
            # in this thread, e.g. another session's finalize(): not a live
            # call; ``isolating.watch`` drops the memo while it runs.)
            # Under torch.compile the check is a constant and orig is
            # inlined: compiled regions are not observed and get no graph
            # break.  ``mark`` runs while Dynamo traces, leaving nothing in
            # the traced code (``_Tally``).  Under jit tracing, reading a
            # tensor's shape would be recorded into the trace.
            if _dynamo_compiling() and not self.off:
                if not _dynamo_exporting():
                    self.mark()
                return self.traced(args, kwargs)
            return self.orig(*args, **kwargs)
        failed: BaseException | None = None
        real = True
        mv, sampled = None, 0
        moved: list[Any] | tuple[()] = ()
        try:
            places = self.places
            if places is not None and not places.check():
                places.look()
            shared = self.shared
            obs = shared.observer
            try:
                snap = obs()
            except ProbeObservationError:
                raise
            except Exception:  # a watched getter that raises: the state changed
                snap = obs.refresh()
            if not shared.active and obs.forward_changed():
                snap = obs.refresh()  # called outside the model: check those flags here
            mv, sampled = self._lookup(snap, args, kwargs)
            if places is not None and mv is not None:
                moved = places.against(mv, args, kwargs)
        except TransformedError:  # a live call under vmap / grad: it ran, unobserved
            real = False
            with self.shared.lock:
                self.shared.transformed[self.name or self.scope.name] += 1
        except NotRealError:  # fx proxies or fake tensors: a tracer's call
            real = False
        except Exception as exc:  # observation must never disturb the forward
            failed = exc
        # the user's forward runs outside every ``except`` above, so its own
        # exceptions never carry ours as their context
        if failed is not None:
            self.shared.error("observe", failed)
            del failed
            return self.orig(*args, **kwargs)
        if not real:
            return self.orig(*args, **kwargs)
        if mv is not None:
            out = self._second(mv, args, kwargs, sampled) if next(mv.counter) == 1 \
                else self._counted(mv, args, kwargs, sampled)
            if moved:  # (a call that raised is no call to reproduce: it counts nothing)
                mv.moved.update(moved)
            return out
        return self._first(snap, args, kwargs)

    def _counted(self, mv: MemberVariant, args: tuple[Any, ...], kwargs: dict[str, Any],
                 sampled: int) -> Any:
        """A call of a completed variant, counted: retained where sampled."""
        try:
            if sampled:
                return self._retaining(mv, args, kwargs, sampled == _POOLED)
            return self._run(mv, args, kwargs)
        except BaseException:  # counted as raised, then re-raised
            self._raised(mv.counter)
            raise

    def _run(self, mv: MemberVariant, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The user's forward, in a profiler range named for the variant
        while the session profiles (``profile_ranges``)."""
        if self.shared.profile:
            with torch.profiler.record_function(f"ctxreplay:{self.scope.name}#{mv.index}"):
                return self.orig(*args, **kwargs)
        return self.orig(*args, **kwargs)

    def _second(self, mv: MemberVariant, args: tuple[Any, ...], kwargs: dict[str, Any],
                sampled: int) -> Any:
        """The second call of a variant, with the Python state the forward
        reaches (``pystate.reach``: closures, the objects a forward
        replacement holds, a step cache hook's state) recorded around it.  A
        repeat call that writes there keeps a state machine -- compute or
        reuse, a counter -- that no program carries: the member is stateful.
        (The first call may fill a lazy cache once; the second is a repeat.)"""
        try:
            before = None if self.writes else reach(self.module)
        except Exception:  # a walk that fails decides nothing
            before = None
        out = self._counted(mv, args, kwargs, sampled)
        if before is not None:
            try:
                # (a label names a path of keys: bounded, as any report string)
                changed = [c[:_LABEL] for c in before.changes() if not self._ignored(c)]
            except Exception:  # a user object may refuse the walk: no change seen
                changed = []
            self.writes.update(changed)
            self.stateful.update(changed)
        return out

    def _ignored(self, change: str) -> bool:
        """Whether ``change`` (``where: what``) writes an attribute the user
        said the forward's result does not depend on (``ignore_attributes``)."""
        where = change.partition(": ")[0]
        return bool(self.ignore) and not set(_ATTRIBUTE.findall(where)).isdisjoint(self.ignore)

    def _raised(self, counter: Any) -> None:
        """The call just counted on ``counter`` raised in the user's forward:
        not a call to reproduce (the caller may well handle it), so it leaves
        its variant's calls; the member counts it for a notice."""
        try:
            with self.shared.lock:
                for table in self.tables.values():
                    for mv in table.values():
                        if mv.counter is counter:
                            mv.raised += 1
                            return
        except Exception:  # never in the way of the user's exception
            return

    def _memoize(self, snap: ContextSnapshot, args: tuple[Any, ...], sig: Any,
                 mv: MemberVariant, pending: int) -> None:
        """Make ``mv`` the member's memo: what ``forward`` checks first.  Only
        while ``snap`` is the observer's cached snapshot and still holds (and
        never while profiling, whose calls each open a profiler range).
        ``pending``: calls of ``mv`` under way that are not counted yet."""
        self.memo = None
        shared = self.shared
        obs = shared.observer
        cache = obs.cache
        # (while ``verify="values"`` retains, every call takes the slow path,
        # which copies it: the memo stays empty)
        retention = shared.retention
        if cache is None or cache.snapshot is not snap or shared.profile or self.off \
                or (retention.limit is not None and not retention.sample):
            return
        pool = mv.pool
        # (an ``islice`` of the counter takes nothing from it once run out)
        n = mv.calls + mv.raised + pending  # the next call's index
        # (the second call takes the slow path: ``_second``)
        hits = 0 if n <= 1 else None if pool is None else pool.hits(self, n)
        ticks = mv.counter if hits is None else itertools.islice(mv.counter, hits)
        check = _memo_check(args, sig)
        # a TensorGuards check of at least one tensor sees the dispatch keys
        state = cache.beside_tensors if args and not isinstance(check, _Python) else cache.check
        try:
            if not (state() and check.check(*args)):
                return
        except Exception:  # a guard over user values may raise: not memoised
            return
        places, inputs = self.places, check.check
        if places is not None:  # (only a member whose code reads such state pays)
            state = _both(state, places.check)
            if places.arguments:
                inputs = _tags_too(inputs, places.same_tags)
        self.memo = _Memo(cache, state, inputs, ticks, self.training, self, mv.counter)

    # -- the slow paths ---------------------------------------------------
    def _lookup(self, snap: ContextSnapshot, args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> tuple[MemberVariant | None, int]:
        """The completed variant this call belongs to (``None``: the call is
        a first one), and whether it is to be retained (``_RETAINED``, or
        ``_POOLED`` sampled into the variant's reservoir)."""
        sig = call_key(args, kwargs)
        if self.dirty or self.lazy or self.module.training is not self.training:
            self._recheck()
        mv = self.table.get((snap, sig))
        if mv is None or not mv.completed:
            return None, False
        retention = self.shared.retention
        sampled = _RETAINED if retention.limit is not None and not retention.sample else 0
        pool = mv.pool
        if pool is not None:
            n = mv.calls + mv.raised  # this call's index: it is counted next
            if pool.due(self, n) and retention.advance(pool, self, n):
                sampled = _POOLED if n > SAMPLED else _RETAINED
                owner = pool.owner
                if owner is not self:  # its memo counts on past its due: stop it
                    owner.memo = None
        if not kwargs:
            self._memoize(snap, args, sig, mv, 1)
        return mv, sampled

    def _first(self, snap: ContextSnapshot, args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> Any:
        """A call whose variant this member has not completed yet."""
        failed: BaseException | None = None
        mv = None
        try:
            mv = self._record(snap, args, kwargs)
        except NotRealError:
            pass
        except Exception as exc:  # an observation error, never raised
            failed = exc
        if failed is not None:
            self.shared.error("record", failed)
            del failed
        if mv is None:
            return self.orig(*args, **kwargs)
        next(mv.counter)
        held = held_state(self.module, self.ignore)
        try:
            out = self._run(mv, args, kwargs)
        except BaseException:  # counted as raised, then re-raised
            self._raised(mv.counter)
            raise
        places = self.places
        if places is not None:
            try:  # what a variant's first call fills (a lazy cache) is its own state
                if not places.check():
                    places.look()
                mv.moved.update(places.against(mv, args, kwargs))
            except Exception:  # observation must never disturb the forward
                self.places = None
        try:
            changed = held_changes(held)
            if self.lazy:  # a lazy module materialises in its first call
                self._rekey()
        except Exception:  # an object whose __dict__ went away: not our business
            changed = []
        if changed:
            self.stateful.update(changed)
        if mv.completed:  # another thread completed it: this call kept, or counted missed
            self._keep(mv, out)
        elif not mv.completed:
            try:
                self._complete(mv, snap, args, kwargs, out)
            except Exception as exc:  # an observation error, never raised
                failed = exc
            if failed is not None:
                self.shared.error("record", failed)
        return out

    def _record(self, snap: ContextSnapshot, args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> MemberVariant | None:
        if in_jit_check():
            return None  # torch.jit.trace running the module again to check its trace
        sig = call_key(args, kwargs)
        key = (snap, sig)
        scope, shared = self.scope, self.shared
        mv = self.table.get(key)
        if mv is None:
            full = (self.identity, snap, sig)
            family = (snap, size_free_key(sig)) if shared.fold else full
            with shared.lock:
                why = None if full in scope.index else scope.room(family, shared.max_variants)
                if why is not None:
                    scope.drop(full, snap, why)
                    return None
            # mutable constants (a dict the forward fills) are copied as first
            # seen; the spec is made outside the lock
            inputs = freeze_constants(call_spec(args, kwargs))
            with shared.lock:
                mv = self.table.get(key)
                if mv is None:
                    index = scope.index.get(full)
                    if index is None:
                        why = scope.room(family, shared.max_variants)
                        if why is not None:
                            scope.drop(full, snap, why)
                            return None
                        index = scope.add(full, family)
                    mv = MemberVariant(index, self.identity, snap, inputs)
                    if shared.retention.sample:
                        mv.pool = scope.pools.get(index)
                        if mv.pool is None:
                            mv.pool = scope.pools[index] = Pool(shared.retention.rng)
                    self.table[key] = mv
        retention = shared.retention
        if retention.limit is not None:
            if mv.retained_inputs is not None:
                retention.release(mv.retained_inputs)
            mv.retained_inputs = retention.inputs(args, kwargs)
        return mv

    def _complete(self, mv: MemberVariant, snap: ContextSnapshot, args: tuple[Any, ...],
                  kwargs: dict[str, Any], out: Any) -> None:
        mv.outputs = spec_of(out)
        self._keep(mv, out)
        if mv.pool is not None:
            with self.shared.lock:
                mv.pool.join(self)
        mv.completed = True
        if not kwargs:
            sig = call_key(args, kwargs)
            if self.table.get((snap, sig)) is mv:  # the forward left its inputs as they were
                self._memoize(snap, args, sig, mv, 0)

    def _retaining(self, mv: MemberVariant, args: tuple[Any, ...],
                   kwargs: dict[str, Any], pooled: bool) -> Any:
        """A call of a completed variant that is retained for the value check
        (every call under ``verify="values"``, a sampled one under
        ``"sampled"``; ``pooled``: into the variant's reservoir): copied
        before and after the forward (``retained.Kept``)."""
        failed: BaseException | None = None
        inputs = None  # local: other threads may be in a call of ``mv`` too
        pool = mv.pool if pooled else None
        try:
            inputs = self.shared.retention.inputs(args, kwargs, mv.retained, pool)
        except Exception as exc:  # an observation error, never raised
            failed = exc
        if failed is not None:
            self.shared.error("retain", failed)
            del failed
        try:
            out = self._run(mv, args, kwargs)
        except BaseException:  # the budget given back, then re-raised
            if inputs is not None:  # a call that raised is not kept: its budget back
                self.shared.retention.release(inputs)
            raise
        try:
            if inputs is not None:
                self._keep(mv, out, inputs, pool)
            else:  # not copied (the budget, or a copy that failed): counted
                self.shared.retention.missed(self._kept(mv))
        except Exception as exc:  # an observation error, never raised
            failed = exc
        if failed is not None:
            self.shared.error("retain", failed)
        return out

    def _keep(self, mv: MemberVariant, out: Any,
              inputs: tuple[torch.Tensor, ...] | None = None, pool: Pool | None = None) -> None:
        """Retain the call that took ``inputs`` (default: the first call's,
        ``mv.retained_inputs``) and returned ``out`` (into ``pool``'s slots
        as well, for a pooled sample)."""
        if inputs is None:
            inputs, mv.retained_inputs = mv.retained_inputs, None
        retention = self.shared.retention
        if retention.limit is None:
            return
        if inputs is None:  # a first call not copied: counted
            retention.missed(self._kept(mv))
            return
        retention.keep(self._kept(mv), inputs, out, pool)

    def _kept(self, mv: MemberVariant) -> Kept:
        """``mv``'s retained calls, made on first use."""
        with self.shared.lock:
            if mv.retained is None:
                mv.retained = self.shared.retention.new()
            return mv.retained

    def changed(self) -> None:
        """An attribute of the member or a submodule was assigned
        (``watch.AssignmentWatch`` calls this): the next call rechecks the identity."""
        self.memo = None
        self.dirty = True

    def _recheck(self) -> None:
        """The identity may have changed: calls go to the table of the
        identity the member has now (a toggled attribute, a swapped
        processor, ``train()`` -- and back -- each its own variants)."""
        self.dirty = False
        if self.lazy or self.module.training is not self.training:
            self.refresh_identity()
            return
        value = identity_of(self.module, self.ignore)
        if value != self.identity_value:
            self.refresh_identity(value)

    def refresh_identity(self, value: Any = None) -> None:
        """Recompute the member's identity (after ``train()``/``eval()``, an
        attribute assigned, or on a lazy module's first call) and switch to
        that identity's table."""
        self.training = self.module.training
        self.identity_value = identity_of(self.module, self.ignore) if value is None else value
        self.lazy = uninitialized(self.module)
        module, ignore = self.module, self.ignore
        with self.shared.lock:
            self.identity = self.scope.identity_id(self.identity_value,
                                                   lambda: state_of(module, ignore))
        self.table = self.tables.setdefault(self.identity, {})
        self.memo = None

    def _rekey(self) -> None:
        """A lazy module's first call made its parameters (and class): its
        variants move to the identity it has now."""
        if uninitialized(self.module):
            return
        self.lazy = False
        value = identity_of(self.module, self.ignore)
        scope = self.scope
        with self.shared.lock:
            module, ignore = self.module, self.ignore
            old, new = self.identity, scope.identity_id(value, lambda: state_of(module, ignore))
            self.identity_value, self.training = value, self.module.training
            if new == old:
                return
            moved = self.tables.pop(old, {})
            dest = self.tables.setdefault(new, {})
            for (snap, sig), mv in moved.items():
                taken = scope.index.get((new, snap, sig))
                if taken is None:
                    scope.index[(new, snap, sig)] = mv.index
                    if not self.shared.fold:  # a family per variant of an identity
                        scope.families[(new, snap, sig)] = 1
                else:
                    mv.index = taken
                mv.identity = new
                dest[(snap, sig)] = mv
                others = any((snap, sig) in m.tables.get(old, {})
                             for m in scope.member_states if m is not self)
                if not others:
                    scope.index.pop((old, snap, sig), None)
                    scope.families.pop((old, snap, sig), None)
            self.identity, self.table, self.memo = new, dest, None

    def stop(self) -> None:
        super().stop()
        self.memo = None  # the memo's hit path does not read ``off``

    def raised(self) -> int:
        """Calls of this member that raised in its forward."""
        return sum(mv.raised for table in list(self.tables.values())
                   for mv in list(table.values()))

    def all_variants(self) -> Iterator[tuple[Any, MemberVariant]]:
        for identity, table in list(self.tables.items()):
            for (snap, sig), mv in list(table.items()):
                yield (identity, snap, sig), mv

