"""Capture backends: export, dynamo, symbolic, auto, or your own, chosen by name
from a registry that built-ins, installed packages' entry points and runtime
registrations share.

A backend turns ``(module, args, kwargs)`` into an artifact and says what
the artifact's graph outputs are.  The engine has already entered the
replayed context when ``capture`` runs.  ``register_backend`` makes one
available by name (``capture_with(model, backend="mine")``), as the built-ins
are; ``available_backends`` lists them.
"""

from __future__ import annotations

from .base import Backend, BackendError, classify_exception, exception_message
from .builtin import AutoBackend, DynamoBackend, ExportBackend, SymbolicBackend
from .registry import (
    BackendInfo,
    BackendRegistrationWarning,
    UnknownBackendError,
    available_backends,
    get_backend,
    register_backend,
    unregister_backend,
)

__all__ = [
    "AutoBackend",
    "Backend",
    "BackendError",
    "BackendInfo",
    "BackendRegistrationWarning",
    "DynamoBackend",
    "ExportBackend",
    "SymbolicBackend",
    "UnknownBackendError",
    "available_backends",
    "classify_exception",
    "exception_message",
    "get_backend",
    "register_backend",
    "unregister_backend",
]
