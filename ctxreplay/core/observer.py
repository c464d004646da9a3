"""Observer: the current snapshot of a fixed set of probes, cheaply.

The last snapshot is reused while a generated, allocation-free check
(``checker``) of torch's ``GlobalStateGuard`` and of every probe's watched
getters still holds; ``snapshot()`` is the public face of one for the
default probes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from .._base import codegen
from .._base.torchcaps import TENSOR_GUARDED_GETTERS as _TENSOR_GUARDED
from .._base.torchcaps import GlobalStateGuard as _GlobalStateGuard
from ..errors import Error
from . import registry
from .probe import ContextProbe, FrameworkStateError, ProbeContractError, unhashable
from .snapshots import ContextSnapshot

__all__ = ["Cache", "Observer", "ProbeObservationError", "checker", "snapshot"]


class ProbeObservationError(Error, RuntimeError):
    """A probe raised while observing; ``probe`` names it, ``__cause__`` is
    what it raised."""

    def __init__(self, probe: str, exc: BaseException) -> None:
        if isinstance(exc, ProbeContractError):  # it names the probe and the rule
            super().__init__(str(exc))
        else:
            super().__init__(f"probe {probe!r} could not observe the current state: "
                             f"{type(exc).__name__}: {exc}")
        self.probe = probe
        """The probe that raised."""
        self.exc_type = type(exc).__name__
        """The type name of what it raised (with the framework and its version for a
        ``FrameworkStateError``; for a broken contract, the rule's code and the state's
        type, ``unhashable_state(list)``: metadata, never a state's value)."""
        if isinstance(exc, FrameworkStateError):
            self.exc_type += f" ({exc.framework} {exc.version})"
        elif isinstance(exc, ProbeContractError):
            self.exc_type = f"{exc.code}({exc.state_type})"


_Checks = tuple[tuple[Any, Any], ...]
_NEVER: _Checks = ((lambda: True, False),)  # a watch that failed: never reuse the snapshot


def _watch(probe: ContextProbe[Any], state: Any, forward: bool) -> _Checks:
    try:
        return tuple(probe.watch_forward(state) if forward else probe.watch(state))
    except Exception:  # a user's probe may raise anything: never reused
        return _NEVER


def checker(checks: _Checks) -> Callable[[], bool]:
    """One function that calls each getter of ``checks`` and says (truthy or
    not) whether every one still returns what it returned (``is``, else
    ``==``), stopping at the first that does not.  A getter that raises
    propagates.

    It is generated (``codegen.function`` of a fixed template; the getters and values go
    in its namespace, never in its source) because it runs on every observed
    call and must allocate nothing: ``list(map(call, getters)) == expected``
    makes two new containers per call, and the garbage collector's share of
    those measured 0.19x a no-op hook pair per call (benchmarks/)."""
    if not checks:
        return _always
    namespace: dict[str, Any] = {}
    terms = []
    for i, (getter, expected) in enumerate(checks):
        namespace[f"g{i}"], namespace[f"e{i}"] = getter, expected
        terms.append(f"((v := g{i}()) is e{i} or v == e{i})")
    source = "def check():\n    return " + " and ".join(terms) + "\n"
    check: Callable[[], bool] = codegen.function(source, "check", namespace, what="state check")
    return check


def _always() -> bool:
    return True


class Cache(NamedTuple):
    """What ``Observer`` checks to reuse its last snapshot (each a
    ``checker``).  ``check`` is torch's ``GlobalStateGuard`` check, then every
    probe's ``watch`` getters; ``forward_check`` the ``watch_forward`` ones;
    ``beside_tensors`` is ``check`` less the getters whose state a passing
    ``TensorGuards`` check of the call's inputs has seen already (the
    thread-local dispatch keys: inference mode)."""

    check: Callable[[], bool]
    snapshot: ContextSnapshot
    forward_check: Callable[[], bool]
    beside_tensors: Callable[[], bool]


def _once(checks: _Checks) -> _Checks:
    """Each ``(getter, expected)`` pair once (both the same objects): probes
    share getters (``default_device`` and ``mode_stack`` both watch the
    length of the torch-function mode stack to be 0), and a check runs on
    every call.  Identity only: ``==`` of an arbitrary expected value may
    raise or return a tensor."""
    out: list[tuple[Any, Any]] = []
    for getter, expected in checks:
        if not any(g is getter and e is expected for g, e in out):
            out.append((getter, expected))
    return tuple(out)


def _cache(guard: Any, snap: ContextSnapshot, every: _Checks, forward: _Checks) -> Cache:
    checks = _once(((guard.check, True), *every))
    forward = _once(forward)
    beside = tuple(c for c in checks if not any(c[0] is g for g in _TENSOR_GUARDED))
    check = checker(checks)
    return Cache(check, snap, checker(forward),
                 checker(beside) if len(beside) < len(checks) else check)


class Observer:
    """Observes a fixed tuple of probes, cheaply.

    The last snapshot is reused while torch's ``GlobalStateGuard`` still holds
    and every probe's ``watch`` getter still returns what it returned
    (``Cache``).  ``watch_forward`` getters are checked by ``forward_changed``
    -- once per call of the observed model -- or, with ``per_call=True``,
    with the others on every call.  Identical states give the identical
    snapshot object, so variant keys hash and compare by identity.  A probe
    that raises makes ``ProbeObservationError`` naming it.
    """

    __slots__ = ("cache", "names", "per_call", "probes")

    def __init__(self, probes: tuple[ContextProbe[Any], ...], *, per_call: bool = True) -> None:
        self.probes = probes
        self.names = tuple(p.name for p in probes)
        self.per_call = per_call
        self.cache: Cache | None = None

    def __call__(self) -> ContextSnapshot:
        cache = self.cache
        if cache is not None:
            try:
                if cache.check():
                    return cache.snapshot
            except Exception:  # a watched getter that raises: the state changed
                pass
        return self.refresh()

    def refresh(self) -> ContextSnapshot:
        """Observe every probe now (and cache the result)."""
        cache = self.cache
        guard = _GlobalStateGuard() if _GlobalStateGuard is not None else None
        states = []
        for p in self.probes:
            try:
                states.append(p.observe())
            except Exception as exc:  # a user's probe may raise anything: wrapped, re-raised
                raise ProbeObservationError(p.name, exc) from exc
        state_tuple = tuple(states)
        snap: ContextSnapshot
        if cache is not None and cache.snapshot.states == state_tuple:
            snap = cache.snapshot
        else:
            # a new state becomes part of variant keys: one that cannot hash
            # is its probe's error, named here rather than at the key lookup
            for p, s in zip(self.probes, state_tuple):
                broken = unhashable(p, s)
                if broken is not None:
                    raise ProbeObservationError(p.name, broken) from None
            snap = ContextSnapshot(self.names, state_tuple, self.probes)
        if guard is not None:
            pairs = list(zip(self.probes, state_tuple))
            every = tuple(c for p, s in pairs for c in _watch(p, s, False))
            forward = tuple(c for p, s in pairs for c in _watch(p, s, True))
            if self.per_call:
                every, forward = every + forward, ()
            self.cache = _cache(guard, snap, every, forward)
        return snap

    def forward_changed(self) -> bool:
        """Whether a ``watch_forward`` getter disagrees with the cached
        snapshot (which is then dropped)."""
        cache = self.cache
        if cache is None:
            return False
        try:
            if cache.forward_check():
                return False
        except Exception:  # a watched getter that raises: the state changed
            pass
        self.cache = None
        return True

    def invalidate(self) -> None:
        self.cache = None


_default_observer: tuple[Any, Observer] | None = None


def snapshot(probes: object = None) -> ContextSnapshot:
    """Observe the given probes (the default set when ``None``) now.

    A probe that cannot observe raises ``ProbeObservationError`` naming it."""
    global _default_observer
    if probes is None:
        # the default set changes with the registry and with which frameworks
        # the integration probes need are imported (``registry.default_key``)
        key = registry.default_key()
        cached = _default_observer
        if cached is None or cached[0] != key:
            cached = (key, Observer(registry.resolve_probes(None)))
            _default_observer = cached
        snap: ContextSnapshot = cached[1]()
        return snap
    observed: ContextSnapshot = Observer(registry.resolve_probes(probes))()
    return observed
