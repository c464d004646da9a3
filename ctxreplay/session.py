"""The capture engine: observe cheaply during the live forward, capture later.

Layering note: the engine sits above the report and fidelity records it
fills (``report.py``, ``verify.py``), which know nothing of the engine.  The
engine never names a concrete probe: it only calls the probe contract.
"""

from __future__ import annotations

import functools
import itertools
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import attrs
import torch
from torch import nn

from ._baseline import Baseline
from ._frozen import freeze_constants
from .backends import Backend, get_backend
from .capture import Failed as _Failed
from .capture import capture_variant
from .registry import resolve_probes
from .report import CaptureFailure, CaptureReport, FidelityError
from .signature import CallSpec, Spec, call_key, spec_of
from .snapshot import ContextSnapshot, Observer
from .targets import resolve_targets, structure_key
from .verify import LEVELS

__all__ = ["CaptureSession", "Scope", "Variant", "capture_with"]

REPLAY_MODES = ("embedded", "ambient", "off")


@attrs.define(eq=False)
class Variant:
    """A distinct (structure, input signature, snapshot) seen live."""

    index: int
    snapshot: ContextSnapshot
    inputs: CallSpec
    module: nn.Module | None  # the member that first ran it; dropped at finalize
    outputs: Spec | None = None
    counter: Any = attrs.field(factory=itertools.count)
    output_error: str | None = None

    @property
    def calls(self) -> int:
        # itertools.count increments atomically under the GIL (a plain
        # ``+= 1`` loses updates between threads); its repr, "count(N)",
        # gives the next value without consuming it.
        return int(repr(self.counter)[6:-1])


@attrs.define(eq=False)
class Scope:
    """Modules sharing one structure: they share one variant table."""

    name: str
    key: tuple[Any, ...]
    members: list[str]
    variants: dict[Any, Variant] = attrs.field(factory=dict)
    dropped_calls: int = 0


class CaptureSession:
    """Observes a module's calls, then captures each variant on ``finalize()``.

    Created by :func:`capture_with`; observation starts at once.  Use it as a
    context manager (hooks are removed at exit) or call ``close()``;
    ``finalize()`` closes first if needed.
    """

    def __init__(self, module: nn.Module, *, probes: object = None, targets: object = None,
                 backend: object = "auto", replay: str = "embedded",
                 verify: str = "signature", max_variants: int = 8, max_scopes: int = 64,
                 profile_ranges: bool = False, capture_timeout: float | None = None,
                 pin_factories: bool = True) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"capture_with: expected an nn.Module, got {type(module).__name__}")
        if replay not in REPLAY_MODES:
            raise ValueError(f"replay: {replay!r} is not one of {list(REPLAY_MODES)}")
        if verify not in LEVELS:
            raise ValueError(f"verify: {verify!r} is not one of {list(LEVELS)}")
        for name, value in (("max_variants", max_variants), ("max_scopes", max_scopes)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive integer, got {value!r}")
        if capture_timeout is not None and not capture_timeout > 0:
            raise ValueError(f"capture_timeout: expected seconds > 0, got {capture_timeout!r}")
        self.probes = resolve_probes(probes)
        self.backend: Backend = get_backend(backend)
        self.replay = replay
        self.verify = verify
        self.max_variants = max_variants
        self.max_scopes = max_scopes
        self.profile_ranges = profile_ranges
        self.capture_timeout = capture_timeout
        self.pin_factories = pin_factories
        self._observer = Observer(self.probes)
        self._lock = threading.Lock()
        self._scopes: list[Scope] = []
        self._observation_errors: Counter[tuple[str, str]] = Counter()
        self._dropped_scopes = 0
        self._attached: list[tuple[nn.Module, Any, list[Any]]] = []
        self._state = "open"
        self._report: CaptureReport | None = None
        self._settings = {"replay": replay, "verify": verify, "max_variants": max_variants,
                          "max_scopes": max_scopes, "targets": _describe_targets(targets),
                          "backend": self.backend.name, "pin_factories": pin_factories}
        self._attach(module, targets)

    # -- attaching ---------------------------------------------------------
    def _attach(self, root: nn.Module, targets: object) -> None:
        by_key: dict[tuple[Any, ...], Scope] = {}
        dropped: set[tuple[Any, ...]] = set()  # structures, not their members
        for name, mod in resolve_targets(root, targets):
            key = structure_key(mod)
            scope = by_key.get(key)
            if scope is None:
                if len(by_key) >= self.max_scopes:
                    dropped.add(key)
                    self._dropped_scopes = len(dropped)
                    continue
                scope = Scope(name or type(mod).__name__, key, [])
                by_key[key] = scope
                self._scopes.append(scope)
            scope.members.append(name)
            self._wrap(mod, scope)

    def _wrap(self, mod: nn.Module, scope: Scope) -> None:
        # A thin forward wrapper set as an instance attribute: Module.__call__
        # finds it like the class's forward, hooks still run, and it costs a
        # fraction of a hook pair (DESIGN.md fact 14).
        had = "forward" in mod.__dict__
        prev = mod.__dict__.get("forward")
        orig = mod.forward
        cell: list[Any] = [self]
        wrapper = _make_wrapper(orig, mod, scope, cell, self._observer,
                                self.profile_ranges)
        mod.forward = wrapper
        wrapper.__dict__[_LINK] = (cell, prev if had else _ABSENT)
        self._attached.append((mod, prev if had else _ABSENT, cell))

    def close(self) -> None:
        """Stop observing and restore every wrapped module's ``forward``."""
        with self._lock:
            attached, self._attached = self._attached, []
            if self._state == "open":
                self._state = "closed"
        for mod, prev, cell in reversed(attached):
            mine = cell[1] if len(cell) > 1 else None
            cell[0] = None  # any wrapper left in a chain passes straight through
            if mod.__dict__.get("forward") is mine:
                prev = _skip_closed(prev)
                if prev is _ABSENT:
                    del mod.forward
                else:
                    mod.forward = prev
            # else: another tool wrapped on top of us; our wrapper stays in
            # its chain as a pass-through holding no reference to the session.

    def __enter__(self) -> CaptureSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._state != "open"

    # -- observation (hot path helpers) -----------------------------------
    def _observation_error(self, where: str, exc: BaseException) -> None:
        with self._lock:
            self._observation_errors[(where, type(exc).__name__)] += 1

    def _new_variant(self, scope: Scope, key: Any, snap: ContextSnapshot,
                     mod: nn.Module, args: tuple[Any, ...],
                     kwargs: dict[str, Any]) -> Variant | None:
        # mutable constants (a cache the forward fills) are copied as first seen
        inputs = freeze_constants(CallSpec(tuple(spec_of(a) for a in args),
                                           tuple((k, spec_of(v)) for k, v in kwargs.items())))
        with self._lock:
            v = scope.variants.get(key)
            if v is not None:
                return v
            if len(scope.variants) >= self.max_variants:
                scope.dropped_calls += 1
                return None
            v = Variant(len(scope.variants), snap, inputs, mod)
            scope.variants[key] = v
            return v

    @property
    def variants(self) -> list[tuple[Scope, Variant]]:
        return [(s, v) for s in self._scopes for v in list(s.variants.values())]

    @property
    def scopes(self) -> tuple[Scope, ...]:
        return tuple(self._scopes)

    # -- finalize ------------------------------------------------------------
    def finalize(self, *, strict: bool = False) -> CaptureReport:
        """Capture every variant under its replayed context; return the report.

        Detaches first.  Afterwards the session holds no example arguments,
        no observed live objects (each probe's ``clear()`` runs) and no
        module.  ``strict=True`` raises :class:`FidelityError` listing every
        mismatch and failure instead of returning a report that has them.
        """
        if self._report is not None:
            if strict and not self._report.ok:  # strict holds on every call
                raise FidelityError(self._report)
            return self._report
        self.close()
        t0 = time.perf_counter()
        captures = []
        failures: list[CaptureFailure] = []
        # The safety net: whatever a probe's replay, a backend or a capture
        # thread abandoned after ``capture_timeout`` did to the ambient state,
        # each variant starts from -- and the caller gets back -- the state
        # finalize() began with.  It also runs when a KeyboardInterrupt passes.
        baseline = Baseline()
        try:
            for scope in self._scopes:
                for v in list(scope.variants.values()):
                    failure: CaptureFailure | None = None
                    try:
                        captures.append(capture_variant(self, scope, v))
                    except _Failed as f:
                        failure = f.failure
                    except Exception as exc:  # an engine bug must not cost the other variants
                        failure = CaptureFailure(scope.name, v.index, self.backend.name,
                                                 "internal_error", type(exc).__name__)
                    finally:
                        v.module = None
                        leaked = baseline.restore()
                    if failure is not None:
                        failures.append(failure)
                    # an abandoned capture thread holds its replay until its
                    # backend returns: expected after a timeout, not a leak
                    if leaked and (failure is None or failure.reason != "timeout"):
                        failures.append(CaptureFailure(scope.name, v.index, self.backend.name,
                                                       "state_leak", "-", (), leaked))
        finally:
            try:
                self._release()
            finally:
                baseline.restore()
        report = CaptureReport(
            tuple(captures), tuple(failures), tuple(p.name for p in self.probes),
            dict(self._settings),
            {"variants": sum(s.dropped_calls > 0 for s in self._scopes),
             "variant_calls": sum(s.dropped_calls for s in self._scopes),
             "scopes": self._dropped_scopes},
            tuple((w, t, n) for (w, t), n in sorted(self._observation_errors.items())),
            time.perf_counter() - t0,
        )
        self._report = report
        if strict and not report.ok:
            raise FidelityError(report)
        return report

    def _release(self) -> None:
        interrupt: BaseException | None = None
        for p in self.probes:
            try:
                p.clear()
            except Exception as exc:
                self._observation_error("clear", exc)
            except BaseException as exc:  # a Ctrl-C: the rest still let go, then it goes on
                interrupt = interrupt or exc
        for scope in self._scopes:
            for v in scope.variants.values():
                v.module = None
        self._observer.invalidate()
        self._state = "finalized"
        if interrupt is not None:
            raise interrupt


_ABSENT = object()
# True while torch.compile or torch.export traces; dynamo folds the call to a
# constant (reading the flag it returns would make dynamo guard on it, and
# recompile on every call).
_compiling = torch.compiler.is_compiling
_Tensor = torch.Tensor
_LINK = "_ctxreplay_link"  # on each wrapper: (its cell, what it replaced)


def _skip_closed(fn: Any) -> Any:
    """What ``fn`` stands for once closed sessions' wrappers are dropped: a
    session closed while another wrapped on top of it left its wrapper as a
    pass-through, which the top one's close unwinds too."""
    while fn is not _ABSENT:
        link = getattr(fn, "__dict__", {}).get(_LINK)
        # functools.wraps copies __dict__: a link is ours only on its own wrapper
        if link is None or len(link[0]) < 2 or link[0][1] is not fn or link[0][0] is not None:
            break
        fn = link[1]
    return fn


def _make_wrapper(orig: Callable[..., Any], mod: nn.Module, scope: Scope, cell: list[Any],
                  observer: Observer, profile: bool) -> Callable[..., Any]:
    table = scope.variants
    # The last hit as ONE tuple, read and replaced atomically: threads with
    # different contexts must never pair one hit's snapshot with another's variant.
    memo: list[Any] = [(None, None, None)]

    def forward(*args: Any, **kwargs: Any) -> Any:
        session = cell[0]
        if session is None or _compiling():
            # Under torch.compile the check is a constant and orig is inlined:
            # compiled regions are not observed, and get no graph break.
            return orig(*args, **kwargs)
        try:
            # Observer.__call__ inlined: this runs on every call of every
            # hooked module, and a Python call layer is a measurable share.
            cache = observer._cache
            if cache is not None and cache[0].check():
                snap = cache[1]
                for getter, expected in cache[2]:
                    if getter() != expected:
                        snap = observer()
                        break
            else:
                snap = observer()
            if not kwargs and len(args) == 1 and type(args[0]) is _Tensor:
                x = args[0]  # call_key's own single-tensor key, without the call
                sig = (x.dtype, x.shape, x.device, x.requires_grad)
            else:
                sig = call_key(args, kwargs)
            last = memo[0]
            if snap is last[0] and sig == last[1]:
                variant = last[2]
            else:
                variant = table.get((snap, sig))
                if variant is not None:
                    memo[0] = (snap, sig, variant)
        except Exception as exc:  # observation must never disturb the forward
            session._observation_error("observe", exc)
            return orig(*args, **kwargs)
        if variant is not None:
            next(variant.counter)
            if profile:
                with torch.profiler.record_function(f"ctxreplay:{scope.name}#{variant.index}"):
                    return orig(*args, **kwargs)
            return orig(*args, **kwargs)
        return _first_call(session, orig, mod, scope, (snap, sig), snap, args, kwargs, profile)

    functools.update_wrapper(forward, orig)
    cell.append(forward)
    return forward


def _first_call(session: CaptureSession, orig: Callable[..., Any], mod: nn.Module,
                scope: Scope, key: Any, snap: ContextSnapshot, args: tuple[Any, ...],
                kwargs: dict[str, Any], profile: bool) -> Any:
    try:
        variant = session._new_variant(scope, key, snap, mod, args, kwargs)
    except Exception as exc:
        session._observation_error("record", exc)
        variant = None
    if variant is None:
        return orig(*args, **kwargs)
    next(variant.counter)
    if profile:
        with torch.profiler.record_function(f"ctxreplay:{scope.name}#{variant.index}"):
            out = orig(*args, **kwargs)
    else:
        out = orig(*args, **kwargs)
    if variant.outputs is None:
        try:
            variant.outputs = spec_of(out)
        except Exception as exc:
            session._observation_error("record", exc)
    return out


def _describe_targets(targets: object) -> str:
    if targets is None or isinstance(targets, str):
        return str(targets)
    if callable(targets):
        return "predicate"
    return "names"


def capture_with(module: nn.Module, *, probes: object = None, targets: object = None,
                 backend: object = "auto", replay: str = "embedded",
                 verify: str = "signature", max_variants: int = 8, max_scopes: int = 64,
                 profile_ranges: bool = False, capture_timeout: float | None = None,
                 pin_factories: bool = True) -> CaptureSession:
    """Observe ``module`` (or the chosen ``targets`` inside it) from now on,
    and capture each observed variant on ``finalize()``.

    ``probes``: names or probe instances (``None``: the default set; an
    unknown name fails here).  ``targets``: ``None`` (the module itself),
    ``"repeated"`` (the members of every homogeneous ``nn.ModuleList``, and
    of every ``nn.Sequential`` of two or more blocks of one class, grouped by
    structure), qualified names, or a predicate ``(name, module) -> bool``.
    ``backend``: ``"auto"``, ``"export"``, ``"dynamo"``, ``"symbolic"`` or a
    backend object.  ``replay``: ``"embedded"`` (traceable probe contexts
    inside the captured callable, the rest around it), ``"ambient"``
    (everything around it) or ``"off"`` (no replay: the unfaithful baseline).
    ``verify``: ``"signature"``, ``"execute"`` or ``"off"``.
    """
    return CaptureSession(module, probes=probes, targets=targets, backend=backend,
                          replay=replay, verify=verify, max_variants=max_variants,
                          max_scopes=max_scopes, profile_ranges=profile_ranges,
                          capture_timeout=capture_timeout, pin_factories=pin_factories)

