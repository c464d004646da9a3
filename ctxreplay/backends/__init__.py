"""Capture backends: export, dynamo, symbolic, auto, or your own.

A backend turns ``(module, args, kwargs)`` into an artifact and says what
the artifact's graph outputs are.  The engine has already entered the
replayed context when ``capture`` runs.
"""

from __future__ import annotations

from .base import Adapter, Backend, BackendError, classify_exception, exception_message
from .builtin import AutoBackend, DynamoBackend, ExportBackend, SymbolicBackend

__all__ = [
    "BUILTIN_BACKENDS",
    "AutoBackend",
    "Backend",
    "BackendError",
    "DynamoBackend",
    "ExportBackend",
    "SymbolicBackend",
    "classify_exception",
    "exception_message",
    "get_backend",
]

#: name -> class of the built-in backends
BUILTIN_BACKENDS: dict[str, type[Backend]] = {
    "auto": AutoBackend, "export": ExportBackend, "dynamo": DynamoBackend,
    "symbolic": SymbolicBackend,
}


def get_backend(backend: object) -> Backend:
    """Resolve ``"auto"`` / ``"export"`` / ``"dynamo"`` / ``"symbolic"`` or a backend object."""
    if isinstance(backend, str):
        try:
            return BUILTIN_BACKENDS[backend]()
        except KeyError:
            raise ValueError(f"unknown backend {backend!r}; choose one of "
                             f"{sorted(BUILTIN_BACKENDS)} or pass a Backend object") from None
    if isinstance(backend, Backend):
        return backend
    if callable(getattr(backend, "capture", None)):
        return Adapter(backend)
    raise TypeError(f"backend must be a name or an object with a capture() method, "
                    f"got {backend!r}")
