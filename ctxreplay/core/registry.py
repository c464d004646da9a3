"""Name -> probe.  Built-ins, entry points and runtime registrations meet here."""

from __future__ import annotations

import difflib
import threading
import warnings
from collections.abc import Mapping
from importlib import metadata
from typing import Any, Literal, TypeVar, overload

import attrs

from ..errors import Error, Warning
from .probe import ContextProbe

__all__ = [
    "ENTRY_POINT_GROUP",
    "ProbeInfo",
    "ProbeRegistrationWarning",
    "UnknownProbeError",
    "available_probes",
    "default_probes",
    "generation",
    "get_probe",
    "register_probe",
    "resolve_probes",
    "unregister_probe",
]

ENTRY_POINT_GROUP = "ctxreplay.probes"

Origin = Literal["builtin", "entry_point", "runtime"]
P = TypeVar("P", bound="type[ContextProbe[Any]] | ContextProbe[Any]")


class ProbeRegistrationWarning(Warning):
    """A probe from an entry point could not be registered."""


class UnknownProbeError(Error, KeyError, ValueError):
    """No probe of that name; the message lists the known ones."""

    def __str__(self) -> str:
        return str(self.args[0])


@attrs.frozen
class ProbeInfo:
    """What ``available_probes()`` says about one name."""

    name: str
    """The registry key."""
    description: str
    """The probe's one-line description."""
    default: bool
    """Whether it is in the default set."""
    origin: Origin
    """``builtin``, ``entry_point`` or ``runtime`` (registered by ``register_probe``)."""
    distribution: str | None = None
    """For an entry point: the distribution that provides it."""
    error: str | None = None  # set when an entry point failed to load
    """Set when its entry point failed to load: what went wrong."""

    @property
    def loaded(self) -> bool:
        """Whether the probe is usable (its entry point, if any, loaded)."""
        return self.error is None


@attrs.define
class _Entry:
    probe: ContextProbe[Any]
    origin: Origin
    distribution: str | None


_lock = threading.RLock()
_probes: dict[str, _Entry] = {}
_broken: dict[str, ProbeInfo] = {}
_entry_points_loaded = False
_generation = 0  # bumped on every change, so callers can cache resolutions
_registering_origin: tuple[Origin, str | None] = ("runtime", None)
_BUILTIN_PREFIX = __name__.partition(".")[0] + ".probes."


def _as_instance(obj: object) -> ContextProbe[Any]:
    if isinstance(obj, type) and issubclass(obj, ContextProbe):
        return obj()
    if isinstance(obj, ContextProbe):
        return obj
    raise TypeError(f"expected a ContextProbe subclass or instance, got {obj!r}")


@overload
def register_probe(probe: P, *, replace: bool = False) -> P: ...
@overload
def register_probe(*, replace: bool = False) -> Any: ...
def register_probe(probe: Any = None, *, replace: bool = False) -> Any:
    """Register a probe class (instantiated with no arguments) or instance.

    Usable as ``@register_probe`` or ``@register_probe(replace=True)`` on a
    class.

    Args:
        probe: a ``ContextProbe`` subclass or instance (omitted when used as
            ``@register_probe(replace=True)``).
        replace: replace a probe already registered under the same name
            (otherwise that is refused).

    Returns:
        Its argument, so a decorated class stays a class.
    """
    if probe is None:
        return lambda p: register_probe(p, replace=replace)
    instance = _as_instance(probe)
    name = instance.name
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"probe name must be an identifier, got {name!r} from {probe!r}")
    origin, dist = _registering_origin
    if origin == "runtime" and type(instance).__module__.startswith(_BUILTIN_PREFIX):
        origin = "builtin"
    with _lock:
        if name in _probes and not replace:
            raise ValueError(
                f"a probe named {name!r} is already registered "
                f"({_probes[name].origin}); pass replace=True to replace it"
            )
        _probes[name] = _Entry(instance, origin, dist)
        _broken.pop(name, None)
        _bump()
    return probe


def unregister_probe(name: str) -> ContextProbe[Any]:
    """Remove a probe by name and return it."""
    _load_entry_points()
    with _lock:
        try:
            entry = _probes.pop(name)
        except KeyError:
            raise _unknown(name) from None
        _bump()
        return entry.probe


def _bump() -> None:
    global _generation
    _generation += 1


def generation() -> int:
    """A counter that changes whenever the set of registered probes changes."""
    _load_entry_points()
    return _generation


def _unknown(name: object) -> UnknownProbeError:
    known = sorted(_probes)
    close = difflib.get_close_matches(str(name), known, n=3)
    hint = f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
    return UnknownProbeError(f"unknown probe {name!r}{hint}; known probes: {', '.join(known)}")


def get_probe(name: str) -> ContextProbe[Any]:
    """The registered probe called ``name``; an unknown name lists the known ones."""
    _load_entry_points()
    entry = _probes.get(name)
    if entry is None:
        raise _unknown(name)
    return entry.probe


def available_probes() -> Mapping[str, ProbeInfo]:
    """Every known name with its info, broken entry points included (with their error)."""
    _load_entry_points()
    with _lock:
        out = {
            n: ProbeInfo(n, e.probe.description, bool(e.probe.default), e.origin, e.distribution)
            for n, e in _probes.items()
        }
        for n, info in _broken.items():
            out.setdefault(n, info)
    return dict(sorted(out.items()))


def default_probes() -> tuple[str, ...]:
    """Names used when ``probes=None``, in registry order (sorted by name)."""
    _load_entry_points()
    with _lock:
        return tuple(sorted(n for n, e in _probes.items() if e.probe.default))


def resolve_probes(
    probes: object = None,
) -> tuple[ContextProbe[Any], ...]:
    """Turn ``None`` / names / instances / classes into probe instances, sorted
    by name (the stable replay order).  Errors name the bad entry."""
    if probes is None:
        names: list[Any] = list(default_probes())
    elif isinstance(probes, (str, ContextProbe)) or (
        isinstance(probes, type) and issubclass(probes, ContextProbe)
    ):
        names = [probes]
    else:
        try:
            names = list(probes)  # type: ignore[call-overload]
        except TypeError:
            raise TypeError(
                f"probes must be None, a name, a probe or an iterable of them, got {probes!r}"
            ) from None
    out: dict[str, ContextProbe[Any]] = {}
    for item in names:
        if isinstance(item, str):
            p = get_probe(item)
        elif isinstance(item, ContextProbe) or (
            isinstance(item, type) and issubclass(item, ContextProbe)
        ):
            p = _as_instance(item)
        else:
            raise TypeError(f"probes: expected a name or a ContextProbe, got {item!r}")
        if p.name in out and out[p.name] is not p:
            raise ValueError(f"probes: two different probes are named {p.name!r}")
        out[p.name] = p
    return tuple(out[n] for n in sorted(out))


def _load_entry_points() -> None:
    """Discover the ``ctxreplay.probes`` entry points once.  A broken one warns
    and is listed with its error; it never breaks the others."""
    global _entry_points_loaded, _registering_origin
    if _entry_points_loaded:
        return
    with _lock:
        if _entry_points_loaded:
            return
        _entry_points_loaded = True
        try:
            eps = list(metadata.entry_points(group=ENTRY_POINT_GROUP))
        except Exception as exc:  # pragma: no cover - broken metadata
            warnings.warn(f"could not read entry points: {type(exc).__name__}",
                          ProbeRegistrationWarning, stacklevel=3)
            return
        for ep in eps:
            dist = ep.dist.name if ep.dist is not None else None
            try:
                obj = ep.load()
                if isinstance(obj, ContextProbe) or (
                    isinstance(obj, type) and issubclass(obj, ContextProbe)
                ):
                    instance = _as_instance(obj)
                else:
                    raise TypeError(f"{ep.value} is not a ContextProbe class or instance")
                if instance.name != ep.name:
                    raise ValueError(
                        f"entry point {ep.name!r} loads a probe named {instance.name!r}"
                    )
                prev = _registering_origin
                _registering_origin = ("entry_point", dist)
                try:
                    register_probe(instance)
                finally:
                    _registering_origin = prev
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
                warnings.warn(
                    f"ctxreplay probe entry point {ep.name!r} from {dist or '?'} "
                    f"could not be registered: {error}",
                    ProbeRegistrationWarning,
                    stacklevel=3,
                )
                # A name already taken (a duplicate) is listed under
                # "name@distribution", so the working probe keeps its name.
                key = ep.name if ep.name not in _probes else f"{ep.name}@{dist or '?'}"
                _broken[key] = ProbeInfo(ep.name, "", False, "entry_point", dist, error)


def _reset_entry_points_for_tests() -> None:
    global _entry_points_loaded
    with _lock:
        for name in [n for n, e in _probes.items() if e.origin == "entry_point"]:
            del _probes[name]
        _broken.clear()
        _entry_points_loaded = False
        _bump()
