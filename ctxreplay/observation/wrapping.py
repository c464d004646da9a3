"""Installing and removing ``forward`` wrappers: the one protocol every
ctxreplay wrapper follows (observation's members and root, dispatch's slots
and root), and the root wrapper both use.

A wrapper's bound ``forward`` is set as the module's instance attribute
(``Module.__call__`` finds it like the class's forward; hooks still run).
``Wrapper.__init__`` remembers what that attribute held (``prev``, or
``NO_FORWARD`` when it held nothing) and what calling ``module.forward`` meant
then (``orig``); ``wrap`` sets it; ``unwrap`` takes it out exactly:

* a module whose ``forward`` is still ours gets back what it held before,
  leaving out the wrappers of ctxreplay sessions already stopped under ours
  (a session stopped while another wrapped on top of it stays in the chain
  as a pass-through until the top one unwinds);
* a wrapper another tool set on top of ours stays where it is: ours, still
  in its chain, only passes calls through (``off``), and ``let_go`` turns it
  into a pass-through that holds its module weakly and no session state.
"""

from __future__ import annotations

import itertools
import types
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from .._base.torchcaps import dynamo_compiling as _dynamo_compiling
from ..capture.stephooks import inner_seat
from .copies import callees, signed
from .modules import NO_FORWARD, Holder

__all__ = ["Root", "ForwardWatch", "Wrapper", "let_go", "reaches", "unwrap", "wrap"]

_is_tracing = torch._C._is_tracing  # torch.jit.trace records every Python tensor access

#: each running wrapper's ``orig`` by its ``key`` (``Wrapper.traced``),
#: until it stops
_ORIGS: dict[int, Callable[..., Any]] = {}
_KEYS = itertools.count()
#: the seat of a wrapper let go of: it holds no module or reference of one
_NOWHERE = types.SimpleNamespace()


class Wrapper(Holder):
    """One ctxreplay wrapper of one module's ``forward``: ``forward`` (each
    kind's own) is the wrapper, ``orig`` what it calls, ``off`` set once it
    only passes calls through.

    Each concrete wrapper lists ``FIELDS`` in its own ``__slots__`` (this
    class declares none, so wrappers can be held weakly): torch 2.7's Dynamo
    resolves a slot of an object only where it is named in the ``__slots__``
    of the object's own class, and a branch on an inherited one
    (``self.off``) inside a ``torch.cond`` branch fails the user's forward
    ("attempted to jump with GetAttrVariable(..., off)")."""

    FIELDS = ("key", "module", "off", "orig", "prev", "seat")
    key: int
    module: nn.Module
    off: bool
    orig: Callable[..., Any]
    #: ``(owner, attribute)`` holding the wrapper: the module's ``forward``,
    #: or, beneath a diffusers step cache's hooks, the function reference
    #: they call the module's own forward through (``stephooks``)
    seat: tuple[Any, str]

    def __init__(self, module: nn.Module, *, beneath: bool = False) -> None:
        self.module = module
        inner = inner_seat(module) if beneath else None
        self.seat = (module, "forward") if inner is None else inner
        self.prev = self.current()
        self.orig = module.forward if inner is None else getattr(*inner)
        self.off = False
        self.key = next(_KEYS)
        _ORIGS[self.key] = self.orig

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def current(self) -> Any:
        """What the seat holds now (``NO_FORWARD``: nothing)."""
        owner, name = self.seat
        return owner.__dict__.get(name, NO_FORWARD)

    @property
    def beneath(self) -> bool:
        """Whether the wrapper sits beneath a step cache's hooks."""
        return self.seat[0] is not self.module

    def reached(self) -> bool:
        """Whether calling the module still goes through this wrapper: its
        seat still holds it (or a chain another tool set on top of it), or,
        beneath step-cache hooks diffusers has since removed, the module's
        ``forward`` does (removing a hook puts what it called there)."""
        if reaches(self.current(), self):
            return True
        return self.beneath and reaches(self.module.__dict__.get("forward", NO_FORWARD), self)

    def traced(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``orig`` called where Dynamo traces the wrapper.  Torch 2.7's
        Dynamo builds the wrapper it reaches through a module's ``forward``
        without a source, and then cannot read a bound method it holds
        ("Unexpected type in sourceless builder builtins.method"; inside a
        ``torch.cond`` branch the user's forward raised); an item of a module
        global it reads with one, on every release."""
        orig = _ORIGS.get(self.key)
        return (self.orig if orig is None else orig)(*args, **kwargs)

    def stop(self) -> None:
        """Only pass calls through from now on (each kind drops its own
        per-call state too, and calls this)."""
        self.off = True
        _ORIGS.pop(self.key, None)


def wrap(wrapper: Wrapper) -> None:
    """Set ``wrapper``'s ``forward`` on its module.  It keeps the signature
    of what it wraps (``torch.jit.trace`` names inputs by it; frameworks
    read it for keyword arguments)."""
    owner, name = wrapper.seat
    setattr(owner, name, signed(wrapper, type(wrapper).forward, wrapper.orig))


def unwrap(wrappers: Sequence[Wrapper]) -> list[Wrapper]:
    """Stop every wrapper, last wrapped first, and put back what each
    module's ``forward`` held where it is still ours; returns the wrappers
    left in another tool's chain (a wrapper set on top of ours, which keeps
    calling ours: now a pass-through)."""
    left = []
    for w in reversed(wrappers):
        w.stop()
        put = _put_back(w, *w.seat)
        if w.beneath:  # diffusers, removing a hook, put what it called on the module
            put = _put_back(w, w.module, "forward") or put
        if not put:
            left.append(w)
    return left


def _put_back(w: Wrapper, owner: Any, name: str) -> bool:
    """What ``w``'s seat held before, back on ``owner.name`` where that
    still holds ``w``; whether it did."""
    current = owner.__dict__.get(name)
    if not (isinstance(current, types.MethodType) and current.__self__ is w):
        return False
    prev = _unwound(w.prev)
    if prev is NO_FORWARD:
        delattr(owner, name)
    else:
        setattr(owner, name, prev)
    return True


def _unwound(fn: Any) -> Any:
    """What ``fn`` stands for once stopped ctxreplay wrappers are dropped: a
    session stopped while another wrapped on top of it left its wrapper as a
    pass-through, which the top one's ``unwrap`` unwinds too."""
    while fn is not NO_FORWARD:
        holder = getattr(fn, "__self__", None)
        if not isinstance(holder, Wrapper) or not holder.off:
            break
        fn = holder.prev
    return fn


def let_go(wrappers: Iterable[Wrapper], left: Iterable[Wrapper]) -> None:
    """Drop every (stopped) wrapper's references to its module.  Those
    ``unwrap`` left in another tool's chain (``left``) keep passing calls
    through: to the module's forward, the module held weakly, or to what
    the attribute held before ours."""
    still = {id(w) for w in left}
    for w in wrappers:
        orig, module = w.orig, w.module
        w.module = None  # type: ignore[assignment]
        w.seat = (_NOWHERE, "forward")
        if id(w) not in still:
            w.orig = None  # type: ignore[assignment]
        elif isinstance(orig, types.MethodType) and orig.__self__ is module:
            w.orig = _WeakForward(orig.__func__, module)


class _WeakForward:
    """A module's bound forward, holding the module weakly."""

    __slots__ = ("function", "module")

    def __init__(self, function: Callable[..., Any], module: nn.Module) -> None:
        self.function = function
        self.module = weakref.ref(module)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module()
        if module is None:
            raise ReferenceError("the module this forward belonged to no longer exists")
        return self.function(module, *args, **kwargs)


def reaches(fn: Any, wrapper: Wrapper, budget: int = 64) -> bool:
    """Whether calling ``fn`` (what a module's ``forward`` holds now) still
    goes through ``wrapper``: another tool wrapped on top of it, and its
    wrapper says what it calls the usual ways (``copies.callees``).
    Bounded; a chain hidden elsewhere reads as not reaching it."""
    return any(getattr(f, "__self__", None) is wrapper for f in callees(fn, budget))


class ForwardWatch:
    """Whether each watched module's ``forward`` is still what was last seen
    there: another tool may set it anew while a session is open
    (accelerate's ``remove_hook_from_module`` puts back the forward it
    saved), and then calls go round ctxreplay's wrapper.  ``intact()`` looks
    only after ``touched()`` said an attribute of a watched module was
    assigned (the session's ``__setattr__`` watch calls it), one dict lookup
    a module then; a forward written into a module's ``__dict__`` without an
    assignment is found when the session detaches.  ``repair(during)`` is
    called when it fails and must ``update`` what is seen: ``during`` when
    it failed at the end of a model call (the forward was set anew inside
    it, so calls of that call may have gone unobserved)."""

    __slots__ = ("dirty", "pairs", "repair")

    def __init__(self, modules: Iterable[nn.Module], repair: Callable[[bool], None]) -> None:
        self.repair = repair
        self.pairs: tuple[tuple[dict[str, Any], Any], ...] = ()
        self.dirty = True
        self.update(modules)

    def update(self, modules: Iterable[nn.Module]) -> None:
        self.pairs = tuple((m.__dict__, m.__dict__.get("forward")) for m in modules)

    def touched(self) -> None:
        """An attribute of a watched module was assigned: look at the next check."""
        self.dirty = True

    def intact(self) -> bool:
        if not self.dirty:
            return True
        self.dirty = False  # before looking: an assignment while we look sets it again
        for d, seen in self.pairs:
            if d.get("forward") is not seen:
                self.dirty = True
                return False
        return True


class FlagCheck(Protocol):
    """What a root asks once per model call: whether a watched state changed
    (an ``Observer``'s numerics-only flags; install's hook watch)."""

    def forward_changed(self) -> bool: ...


class Counts(Protocol):
    """Where a root counts the model calls in progress (``active``): its
    members read the numerics-only flags themselves when it is zero."""

    active: int


class Root(Wrapper):
    """Wraps the model given to ``capture_with`` or ``install``: per call of
    the whole model, the probes' numerics-only flags (``watch_forward``) are
    checked once, by each of ``observers``, not on every block call (a
    change of one inside a forward counts from the next model call); calls
    in progress are counted in ``counts.active``; an observer that raises is
    told to ``errors`` (``None``: ignored -- the members observe it again).
    ``watch``: members whose ``forward`` is checked before and after each
    model call, wrapped again when another tool set it anew."""

    __slots__ = (*Wrapper.FIELDS, "counts", "errors", "observers", "watch")

    def __init__(self, module: nn.Module, observers: tuple[FlagCheck, ...], counts: Counts,
                 errors: Callable[[str, BaseException], None] | None = None) -> None:
        super().__init__(module)
        self.observers = observers
        self.counts = counts
        self.errors = errors
        self.watch: ForwardWatch | None = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.off or _dynamo_compiling() or _is_tracing():
            if not self.off and _dynamo_compiling():
                return self.traced(args, kwargs)
            return self.orig(*args, **kwargs)
        watch = self.watch
        # (``dirty`` read here first: ``intact()`` is a Python call per model call)
        if watch is not None and watch.dirty and not watch.intact():
            self._repair(watch, False)
        try:
            for obs in self.observers:
                obs.forward_changed()
        except Exception as exc:  # a getter that raises: the members see it too
            if self.errors is not None:
                self.errors("observe", exc)
        counts = self.counts
        counts.active += 1
        try:
            return self.orig(*args, **kwargs)
        finally:
            counts.active -= 1
            if watch is not None and watch.dirty and not self.off and not watch.intact():
                self._repair(watch, True)

    def _repair(self, watch: ForwardWatch, during: bool) -> None:
        try:
            watch.repair(during)
        except Exception as exc:  # the calls it would observe are not covered
            if self.errors is not None:
                self.errors("rewrap", exc)
