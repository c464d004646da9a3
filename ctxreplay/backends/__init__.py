"""Capture backends: export, dynamo, symbolic, auto, or your own.

A backend turns ``(module, args, kwargs)`` into an artifact and says what
the artifact's graph outputs are.  The engine has already entered the
replayed context when ``capture`` runs.
"""

from __future__ import annotations

from .base import Backend, BackendError, classify_exception, get_backend
from .builtin import AutoBackend, DynamoBackend, ExportBackend, SymbolicBackend

__all__ = [
    "AutoBackend",
    "Backend",
    "BackendError",
    "DynamoBackend",
    "ExportBackend",
    "SymbolicBackend",
    "classify_exception",
    "get_backend",
]
