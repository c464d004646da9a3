"""Name -> backend.  Built-ins, entry points and runtime registrations meet here,
and ``get_backend`` turns a name or a backend object into a ``Backend``."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from importlib import metadata
from typing import Any, TypeVar, overload

import attrs

from .._base.plugins import Origin, Registry
from ..errors import Error, Warning
from .base import Adapter, Backend

__all__ = [
    "ENTRY_POINT_GROUP",
    "BackendInfo",
    "BackendRegistrationWarning",
    "UnknownBackendError",
    "available_backends",
    "get_backend",
    "register_backend",
    "unregister_backend",
]

ENTRY_POINT_GROUP = "ctxreplay.backends"

B = TypeVar("B")


class BackendRegistrationWarning(Warning):
    """A backend from an entry point could not be registered."""


class UnknownBackendError(Error, ValueError):
    """No backend of that name; the message lists the known ones."""


@attrs.frozen
class BackendInfo:
    """What ``available_backends()`` says about one name."""

    name: str
    """The registry key: what ``capture_with(backend=...)`` takes."""
    description: str
    """The first paragraph of the backend class's own docstring, as plain text
    (empty without one)."""
    origin: Origin
    """``builtin``, ``entry_point`` or ``runtime`` (registered by ``register_backend``)."""
    distribution: str | None = None
    """For an entry point: the distribution that provides it."""
    error: str | None = None
    """Set when its entry point failed to load: what went wrong."""

    @property
    def loaded(self) -> bool:
        """Whether the backend is usable (its entry point, if any, loaded)."""
        return self.error is None


def _register_entry_point(ep: metadata.EntryPoint, obj: object) -> None:
    register_backend(obj, name=ep.name)


_BACKENDS: Registry[object] = Registry(
    "backend", ENTRY_POINT_GROUP, builtin_prefix=__name__.rpartition(".")[0] + ".",
    unknown=UnknownBackendError, warning=BackendRegistrationWarning,
    register_entry_point=_register_entry_point,
    unknown_hint="; or pass an object with a capture() method")


def _has_capture(obj: object) -> bool:
    return callable(getattr(obj, "capture", None))


def _check(obj: object) -> None:
    """Refuse what ``get_backend`` could not turn into a working backend."""
    if not _has_capture(obj):
        raise TypeError("expected a backend class or an object with a capture() method, "
                        f"got {obj!r}")
    if isinstance(obj, type) and inspect.isabstract(obj):
        raise TypeError(f"{obj.__qualname__} is abstract: it cannot be instantiated")


@overload
def register_backend(backend: None = None, *, name: str | None = None,
                     replace: bool = False) -> Callable[[B], B]: ...
@overload
def register_backend(backend: B, *, name: str | None = None, replace: bool = False) -> B: ...
def register_backend(backend: Any = None, *, name: str | None = None,
                     replace: bool = False) -> Any:
    """Register a backend under a name, for ``capture_with(model, backend=name)``.

    Usable as ``@register_backend`` or ``@register_backend(name=..., replace=True)``
    on a class.  A registered class is instantiated with no arguments by every
    ``get_backend(name)`` (each capture session gets its own); a registered
    instance is handed out as it is.  Installed packages register backends
    through entry points in the group ``ctxreplay.backends``, each pointing
    at a class or an instance; the entry point's name is the backend's name.

    Args:
        backend: a ``Backend`` subclass or instance, or a class or object with
            the same methods (at least ``capture``); omitted when used as
            ``@register_backend(...)``.
        name: the registry key; by default the backend's ``name`` attribute.
            That attribute is what reports call the backend
            (``Capture.backend``), so a different ``name`` is an alias.
        replace: replace a backend already registered under the same name
            (otherwise that is refused, built-ins included).

    Returns:
        Its argument, so a decorated class stays a class.
    """
    if backend is None:
        return lambda b: register_backend(b, name=name, replace=replace)
    _check(backend)
    key = getattr(backend, "name", None) if name is None else name
    if not isinstance(key, str) or not key.isidentifier():
        raise ValueError(f"backend name must be an identifier, got {key!r} from {backend!r}; "
                         "pass name=...")
    module = (backend if isinstance(backend, type) else type(backend)).__module__
    _BACKENDS.add(key, backend, module, replace=replace)
    return backend


def unregister_backend(name: str) -> object:
    """Remove a backend by name and return what was registered (class or instance)."""
    return _BACKENDS.remove(name)


def get_backend(backend: object) -> Backend:
    """A ``Backend`` for ``capture_with(backend=...)``: a registered name
    (``"auto"``, ``"export"``, ``"dynamo"``, ``"symbolic"`` or one given to
    ``register_backend``), a ``Backend``, or any object with a ``capture()``
    method (wrapped, its missing optional methods filled in).

    Raises:
        UnknownBackendError: an unknown name; the message lists the known ones.
        TypeError: neither a name nor an object with a ``capture()`` method.
    """
    if isinstance(backend, str):
        backend = _BACKENDS.get(backend)
        if isinstance(backend, type):
            backend = backend()
    if isinstance(backend, Backend):
        return backend
    if _has_capture(backend):
        return Adapter(backend)
    raise TypeError(f"backend must be a name or an object with a capture() method, "
                    f"got {backend!r}")


def _description(obj: object) -> str:
    """The first paragraph of the class's own docstring, on one line, as plain
    text (reST's double backticks dropped)."""
    doc = (obj if isinstance(obj, type) else type(obj)).__doc__ or ""
    return " ".join(inspect.cleandoc(doc).split("\n\n")[0].replace("``", "").split())


def available_backends() -> Mapping[str, BackendInfo]:
    """Every known name with its info, broken entry points included (with their error)."""
    entries, broken = _BACKENDS.listing()
    out = {n: BackendInfo(n, _description(e.value), e.origin, e.distribution)
           for n, e in entries.items()}
    for key, b in broken.items():
        out.setdefault(key, BackendInfo(b.name, "", "entry_point", b.distribution, b.error))
    return dict(sorted(out.items()))

