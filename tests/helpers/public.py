"""ctxreplay's public faces and every name they export, for the tests that
walk the public API (docstrings, loaders, error roots)."""

from __future__ import annotations

import importlib
from typing import Any

FACES = ("ctxreplay", "ctxreplay.report", "ctxreplay.artifacts", "ctxreplay.probes",
         "ctxreplay.backends", "ctxreplay.testing")


def public_names() -> dict[str, Any]:
    """``face.name`` -> the object, each object once (under its first face)."""
    out: dict[str, Any] = {}
    seen: set[int] = set()
    for face in FACES:
        module = importlib.import_module(face)
        for name in module.__all__:
            obj = getattr(module, name)
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            out[f"{face}.{name}"] = obj
    return out


def resolve(path: str) -> Any:
    """Resolve ``a.b.c`` as mkdocstrings does: the longest importable module
    prefix first, then attributes."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(path)
