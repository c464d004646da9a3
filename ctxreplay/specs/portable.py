"""Keys of classes and constants that another process computes alike.

A saved capture is matched with a live call in a fresh process by its
signature's JSON (``specjson``), so every part of it must be written in a
form that process can compute from the live call: a class by its import
path (``module:qualname``), a constant by a digest of its equality key
(``signature._const_key``: its content -- strings included, which are never
written themselves -- with types by import path).

What no other process can compute is refused (``None``), never guessed:
a key that holds an ``id()`` (a callable, a module, an object too large to
look through), an object compared by its own ``__eq__`` (its content is not
what it compares), and a class defined inside a function (``<locals>`` in
its qualified name: each call of that function makes a new class of the
same name, so the name does not say which).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

__all__ = ["class_path", "digest"]

_DIGEST_CHARS = 32
_MAX_NODES = 4096
# values ``_content`` keeps as they are, written by ``str`` (``repr`` for
# floats: ``str`` of a float may round in older Pythons)
_BY_STR = (type(None), bool, int, str, torch.dtype, torch.device, torch.layout,
           torch.memory_format)


class _NotPortable(Exception):
    """A key part no other process can compute."""


def class_path(cls: type) -> str | None:
    """``module:qualname`` of ``cls``; ``None`` for a class defined inside a
    function (another process cannot tell which of its classes it was)."""
    qualname = getattr(cls, "__qualname__", None)
    module = getattr(cls, "__module__", None)
    if not isinstance(qualname, str) or not isinstance(module, str) or "<locals>" in qualname:
        return None
    return f"{module}:{qualname}"


def _encode(value: Any, budget: list[int]) -> Any:
    budget[0] -= 1
    if budget[0] < 0:
        raise _NotPortable("too large")
    if isinstance(value, type):
        path = class_path(value)
        if path is None:
            raise _NotPortable("local class")
        return ["class", path]
    if type(value) is tuple:
        # ``(type, "id", id(value))``: an object compared by identity
        if len(value) == 3 and isinstance(value[0], type) and value[1] == "id":
            raise _NotPortable("identity")
        return ["tuple", [_encode(v, budget) for v in value]]
    t = type(value)
    if t is float or t is complex:
        return [t.__name__, repr(value)]
    if t is bytes:
        return ["bytes", value.hex()]
    if t in _BY_STR:
        return [t.__name__, str(value)]
    # an object compared by its own ``==`` (a frozen config): its content is
    # not what it compares
    raise _NotPortable(t.__qualname__)


def digest(parts: Any) -> str | None:
    """A digest of ``parts`` (a ``_content`` key, or a tuple of them) that
    any process computes alike from the same content; ``None`` where a part
    holds something no other process can compute."""
    try:
        encoded = _encode(parts, [_MAX_NODES])
    except (_NotPortable, RecursionError):
        return None
    text = json.dumps(encoded, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()[:_DIGEST_CHARS]

