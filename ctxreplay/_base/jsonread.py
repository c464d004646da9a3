"""Strict readers for JSON documents.

Every reader takes the value and the path it was found at, and raises a
``ValueError`` naming that path when the value is not what the schema says.
Nothing here evaluates, imports or unpickles anything: a dtype is looked up in
a fixed table, a device is parsed by ``torch.device`` from a bounded string.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = [
    "DTYPES",
    "dtype_name",
    "key_path",
    "loads",
    "read_bool",
    "read_device",
    "read_dtype",
    "read_int",
    "read_list",
    "read_mapping",
    "read_pairs",
    "read_str",
]

# A fixed table: decoding never calls getattr(torch, <untrusted string>).
DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in {v for v in vars(torch).values() if isinstance(v, torch.dtype)}
}

_MAX_STR = 256


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _fail(path: str, expected: str, value: object) -> ValueError:
    return ValueError(f"{path}: expected {expected}, got {type(value).__name__}")


MAX_DOCUMENT = 64 << 20  # characters


def loads(text: str | bytes, path: str = "$", *, source: str = "") -> Any:
    """Parse JSON text; anything that is not a JSON document -- bad syntax,
    bytes that are not UTF-8, an integer literal too long to convert, nesting
    too deep for the parser (a ``RecursionError``) -- raises ``ValueError``
    naming ``path`` (and ``source``, e.g. the file, after it)."""
    where = f" in {source}" if source else ""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{path}: not a JSON document (not UTF-8 text){where}") from None
    if not isinstance(text, str):
        raise _fail(path, "JSON text", text)
    if len(text) > MAX_DOCUMENT:
        raise ValueError(f"{path}: document longer than {MAX_DOCUMENT} characters{where}")
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError(f"{path}: not a JSON document (nested too deeply){where}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not a JSON document ({exc.msg} at line {exc.lineno} "
                         f"column {exc.colno}){where}") from None
    except ValueError as exc:  # e.g. an integer literal past sys.get_int_max_str_digits()
        raise ValueError(f"{path}: not a JSON document ({type(exc).__name__}){where}") \
            from None


def key_path(path: str, key: object) -> str:
    """``path.key`` for an identifier of at most 128 characters, else
    ``path[<bounded repr>]``: an untrusted key never makes an error message
    long or multi-line."""
    if isinstance(key, str) and len(key) <= 128 and key.isidentifier():
        return f"{path}.{key}"
    if not isinstance(key, str):
        return f"{path}[<{type(key).__name__}>]"
    shown = repr(key[:40]) + ("..." if len(key) > 40 else "")
    return f"{path}[{shown}]"


def read_mapping(value: object, path: str, *, keys: set[str] | None = None,
                 required: set[str] | None = None) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise _fail(path, "an object", value)
    for k in value:
        if not isinstance(k, str):
            raise ValueError(f"{path}: keys must be strings, got {type(k).__name__}")
        if keys is not None and k not in keys:
            raise ValueError(f"{key_path(path, k)}: unknown field; expected one of "
                             f"{sorted(keys)}")
    for k in sorted(required or ()):
        if k not in value:
            raise ValueError(f"{path}.{k}: missing required field")
    return value


def read_list(value: object, path: str, *, max_len: int = 10_000) -> list[Any]:
    if not isinstance(value, list):
        raise _fail(path, "a list", value)
    if len(value) > max_len:
        raise ValueError(f"{path}: list longer than {max_len}")
    return value


def read_pairs(value: object, path: str, shape: str,
               first: Callable[[object, str], Any], second: Callable[[object, str], Any],
               *, max_len: int = 10_000) -> list[tuple[Any, Any]]:
    """A list of two-element lists (``shape`` names them in errors, e.g.
    ``"[name, spec]"``), each element read by its own reader."""
    out = []
    for i, item in enumerate(read_list(value, path, max_len=max_len)):
        where = f"{path}[{i}]"
        pair = read_list(item, where, max_len=2)
        if len(pair) != 2:
            raise ValueError(f"{where}: expected {shape}")
        out.append((first(pair[0], f"{where}[0]"), second(pair[1], f"{where}[1]")))
    return out


def read_bool(value: object, path: str) -> bool:
    if not isinstance(value, bool):
        raise _fail(path, "a boolean", value)
    return value


def read_int(value: object, path: str, *, lo: int = -(2**63), hi: int = 2**63 - 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(path, "an integer", value)
    if not lo <= value <= hi:
        raise ValueError(f"{path}: integer out of range [{lo}, {hi}]")
    return value


def read_str(value: object, path: str, *, choices: set[str] | None = None,
             max_len: int = _MAX_STR) -> str:
    if not isinstance(value, str):
        raise _fail(path, "a string", value)
    if len(value) > max_len:
        raise ValueError(f"{path}: string longer than {max_len} characters")
    if choices is not None and value not in choices:
        raise ValueError(f"{path}: {value!r} is not one of {sorted(choices)}")
    return value


def read_dtype(value: object, path: str) -> torch.dtype:
    name = read_str(value, path)
    try:
        return DTYPES[name.removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"{path}: unknown dtype {name!r}") from None


_DEVICE_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz_0123456789:")


def read_device(value: object, path: str) -> str:
    text = read_str(value, path, max_len=64)
    if not text or not set(text) <= _DEVICE_CHARS:
        raise ValueError(f"{path}: {text!r} is not a device string")
    try:
        torch.device(text)
    except (RuntimeError, ValueError):
        raise ValueError(f"{path}: {text!r} is not a device torch knows") from None
    return text
