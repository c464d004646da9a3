"""Name -> plugin tables: built-ins, installed packages' entry points and runtime
registrations meet in one, for the probe and the backend registries.

A ``Registry`` holds one kind of plugin.  Its entry points are loaded once, on
the first lookup or listing; one that fails to load or register warns and is
listed with its error, and never breaks the others.
"""

from __future__ import annotations

import difflib
import threading
import warnings
from collections.abc import Callable
from importlib import metadata
from typing import Generic, Literal, TypeVar

import attrs

__all__ = ["Broken", "Registration", "Origin", "Registry"]

Origin = Literal["builtin", "entry_point", "runtime"]
T = TypeVar("T")

#: a warning's stacklevel from ``load_entry_points`` to the user's call: it runs
#: inside a ``Registry`` method, called by a registry's public function
_CALLER = 4


@attrs.frozen
class Registration(Generic[T]):
    """One registered plugin and where it came from."""

    value: T
    origin: Origin
    distribution: str | None


@attrs.frozen
class Broken:
    """An entry point that could not be registered."""

    name: str
    """The entry point's name."""
    distribution: str | None
    """The distribution that declares it."""
    error: str
    """``"TypeName: message"`` of what went wrong."""


class Registry(Generic[T]):
    """Name -> plugin of one kind.

    Args:
        kind: what a plugin is called in messages (``"probe"``).
        group: the entry-point group installed packages declare plugins in.
        builtin_prefix: a registration from a module under this prefix (or
            one of these prefixes) has origin ``builtin`` (any other one
            outside entry-point loading is ``runtime``).
        unknown: the exception an unknown name raises, given the message.
        warning: the warning a broken entry point issues.
        register_entry_point: registers what an entry point loaded (it calls
            ``add``, which records origin ``entry_point``); raises on anything
            it refuses.
        unknown_hint: appended to the unknown-name message.
    """

    def __init__(self, kind: str, group: str, *, builtin_prefix: str | tuple[str, ...],
                 unknown: Callable[[str], Exception], warning: type[Warning],
                 register_entry_point: Callable[[metadata.EntryPoint, object], object],
                 unknown_hint: str = "") -> None:
        self.kind = kind
        self.group = group
        self._builtin_prefix = builtin_prefix
        self._unknown = unknown
        self._warning = warning
        self._register_entry_point = register_entry_point
        self._unknown_hint = unknown_hint
        self._lock = threading.RLock()
        self._entries: dict[str, Registration[T]] = {}
        self._broken: dict[str, Broken] = {}
        self._loaded = False
        self._loading: tuple[Origin, str | None] = ("runtime", None)
        self.generation = 0
        """Bumped on every change, so callers can cache what they resolved."""

    def add(self, name: str, value: T, module: str, *, replace: bool) -> None:
        """Register ``value`` (defined in ``module``) under ``name``; a taken
        name is refused unless ``replace``."""
        with self._lock:  # held while entry points load, so ``_loading`` is this thread's
            origin, dist = self._loading
            if origin == "runtime" and module.startswith(self._builtin_prefix):
                origin = "builtin"
            if name in self._entries and not replace:
                raise ValueError(
                    f"a {self.kind} named {name!r} is already registered "
                    f"({self._entries[name].origin}); pass replace=True to replace it")
            self._entries[name] = Registration(value, origin, dist)
            self._broken.pop(name, None)
            self.generation += 1

    def remove(self, name: str) -> T:
        """Unregister ``name`` and return what it held."""
        self.load_entry_points()
        with self._lock:
            try:
                entry = self._entries.pop(name)
            except KeyError:
                raise self.unknown(name) from None
            self.generation += 1
            return entry.value

    def get(self, name: str) -> T:
        """What ``name`` holds; an unknown name lists the known ones, and a name
        the listing gives as broken (an entry point that failed) says so."""
        self.load_entry_points()
        entry = self._entries.get(name)
        if entry is None:
            raise self.unknown(name)
        return entry.value

    def listing(self) -> tuple[dict[str, Registration[T]], dict[str, Broken]]:
        """Copies of the registered plugins and of the broken entry points (a
        broken one whose name is taken is keyed ``name@distribution``)."""
        self.load_entry_points()
        with self._lock:
            return dict(self._entries), dict(self._broken)

    def unknown(self, name: object) -> Exception:
        """The error for an unknown name: close matches and every known name;
        for the name of a broken entry point, what went wrong loading it."""
        known = sorted(self._entries)
        broken = self._broken.get(str(name))
        if broken is not None:
            return self._unknown(
                f"{self.kind} {name!r} from {broken.distribution or '?'} is installed but "
                f"could not be registered ({broken.error}); usable {self.kind}s: "
                f"{', '.join(known)}{self._unknown_hint}")
        close = difflib.get_close_matches(str(name), known, n=3)
        hint = f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
        return self._unknown(f"unknown {self.kind} {name!r}{hint}; known {self.kind}s: "
                             f"{', '.join(known)}{self._unknown_hint}")

    def load_entry_points(self) -> None:
        """Register the group's entry points, the first time only."""
        if self._loaded:
            return
        with self._lock:
            if self._loaded:
                return
            self._loaded = True
            try:
                eps = list(metadata.entry_points(group=self.group))
            except Exception as exc:  # pragma: no cover - broken metadata
                warnings.warn(f"could not read entry points: {type(exc).__name__}",
                              self._warning, stacklevel=_CALLER)
                return
            for ep in eps:
                dist = ep.dist.name if ep.dist is not None else None
                try:
                    obj = ep.load()
                    self._loading = ("entry_point", dist)
                    try:
                        self._register_entry_point(ep, obj)
                    finally:
                        self._loading = ("runtime", None)
                except Exception as exc:  # a plugin may raise anything: warned
                    error = f"{type(exc).__name__}: {exc}"
                    warnings.warn(
                        f"ctxreplay {self.kind} entry point {ep.name!r} from {dist or '?'} "
                        f"could not be registered: {error}", self._warning, stacklevel=_CALLER)
                    # a name already taken (a duplicate) is listed under
                    # "name@distribution", so the working plugin keeps its name
                    key = ep.name if ep.name not in self._entries else f"{ep.name}@{dist or '?'}"
                    self._broken[key] = Broken(ep.name, dist, error)

    def reset_entry_points(self) -> None:
        """Forget what entry points registered, so the next lookup loads them
        again (for tests that install fake distributions)."""
        with self._lock:
            for name in [n for n, e in self._entries.items() if e.origin == "entry_point"]:
                del self._entries[name]
            self._broken.clear()
            self._loaded = False
            self.generation += 1
