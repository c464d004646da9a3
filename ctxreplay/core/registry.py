"""Name -> probe.  Built-ins, entry points and runtime registrations meet here."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from importlib import metadata
from typing import Any, TypeVar, overload

import attrs

from .._base.plugins import Origin, Registry
from ..errors import Error, Warning
from .probe import ContextProbe

__all__ = [
    "ENTRY_POINT_GROUP",
    "ProbeInfo",
    "ProbeRegistrationWarning",
    "UnknownProbeError",
    "available_probes",
    "default_key",
    "default_probes",
    "generation",
    "get_probe",
    "register_probe",
    "resolve_probes",
    "unregister_probe",
]

ENTRY_POINT_GROUP = "ctxreplay.probes"

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
    inactive: str | None = None
    """Why the probe is not active now (a framework it reads is not imported), else ``None``."""

    @property
    def loaded(self) -> bool:
        """Whether the probe is usable (its entry point, if any, loaded)."""
        return self.error is None


def _register_entry_point(ep: metadata.EntryPoint, obj: object) -> None:
    if not (isinstance(obj, ContextProbe) or (isinstance(obj, type)
                                              and issubclass(obj, ContextProbe))):
        raise TypeError(f"{ep.value} is not a ContextProbe class or instance")
    instance = _as_instance(obj)
    if instance.name != ep.name:
        raise ValueError(f"entry point {ep.name!r} loads a probe named {instance.name!r}")
    register_probe(instance)


_PROBES: Registry[ContextProbe[Any]] = Registry(
    "probe", ENTRY_POINT_GROUP,
    builtin_prefix=tuple(__name__.partition(".")[0] + f".{p}." for p in ("probes", "integrations")),
    unknown=UnknownProbeError, warning=ProbeRegistrationWarning,
    register_entry_point=_register_entry_point)


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
    _PROBES.add(name, instance, type(instance).__module__, replace=replace)
    return probe


def unregister_probe(name: str) -> ContextProbe[Any]:
    """Remove a probe by name and return it."""
    return _PROBES.remove(name)


def generation() -> int:
    """A counter that changes whenever the set of registered probes changes."""
    _PROBES.load_entry_points()
    return _PROBES.generation


def get_probe(name: str) -> ContextProbe[Any]:
    """The registered probe called ``name``; an unknown name lists the known ones."""
    return _PROBES.get(name)


def available_probes() -> Mapping[str, ProbeInfo]:
    """Every known name with its info, broken entry points included (with their error)."""
    entries, broken = _PROBES.listing()
    out = {n: ProbeInfo(n, e.value.description, bool(e.value.default), e.origin,
                        e.distribution, None, _inactive(e.value)) for n, e in entries.items()}
    for key, b in broken.items():
        out.setdefault(key, ProbeInfo(b.name, "", False, "entry_point", b.distribution, b.error))
    return dict(sorted(out.items()))


def _inactive(probe: ContextProbe[Any]) -> str | None:
    try:
        return probe.inactive_reason()
    except Exception as exc:  # a probe that cannot say: not active, and why
        return f"inactive_reason() raised {type(exc).__name__}: {exc}"


def default_probes() -> tuple[str, ...]:
    """Names used when ``probes=None``, in registry order (sorted by name): the
    ``default`` probes that are active now (``ContextProbe.requires``)."""
    entries, _ = _PROBES.listing()
    return tuple(sorted(n for n, e in entries.items()
                        if e.value.default and _inactive(e.value) is None))


def default_key() -> tuple[int, tuple[bool, ...]]:
    """What the default set depends on, cheaply: the registry's generation and,
    per module some default probe ``requires``, whether it is imported.  Equal
    keys resolve to the same default set."""
    _PROBES.load_entry_points()
    gen = _PROBES.generation
    if _REQUIRED[0] != gen:
        entries, _ = _PROBES.listing()
        _REQUIRED[:] = [gen, tuple(sorted({m for e in entries.values() if e.value.default
                                           for m in e.value.requires}))]
    modules = sys.modules
    return gen, tuple(m in modules for m in _REQUIRED[1])


# [generation, the modules the default probes of that generation require]
_REQUIRED: list[Any] = [-1, ()]


def resolve_probes(
    probes: object = None,
) -> tuple[ContextProbe[Any], ...]:
    """Turn ``None`` / names / instances / classes into probe instances, sorted
    by name (the stable replay order).  Errors name the bad entry.

    A probe instance (or class) takes the place of the registered probe a
    name gives, so ``[*default_probes(), ModeStackProbe(replay_instances=True)]``
    is the default set with that probe configured; two different instances
    of one name are refused."""
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
    named: set[str] = set()  # resolved from a name: an instance may take their place
    for item in names:
        if isinstance(item, str):
            p = get_probe(item)
            if p.name in out:
                continue
            named.add(p.name)
        elif isinstance(item, ContextProbe) or (
            isinstance(item, type) and issubclass(item, ContextProbe)
        ):
            p = _as_instance(item)
            if p.name in named:
                named.discard(p.name)
                out[p.name] = p
                continue
        else:
            raise TypeError(f"probes: expected a name or a ContextProbe, got {item!r}")
        if p.name in out and out[p.name] is not p:
            raise ValueError(f"probes: two different probes are named {p.name!r}")
        out[p.name] = p
    return tuple(out[n] for n in sorted(out))

