"""A checker for the metadata-only guarantee of ctxreplay's JSON documents.

A report (``CaptureReport.to_json()``) and a snapshot document may carry
names, codes, shapes, dtypes, devices, counts and short descriptions -- never
tensor values, parameter data, exception messages, source text or the
contents of strings the user passed in.  ``check_metadata_only`` walks a
document and returns one line per violation (empty: the document is clean);
``assert_metadata_only`` raises with those lines.

Shared by the reliability tests (faults, concurrency, bounds); other test
files may reuse it.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from typing import Any

__all__ = ["FORBIDDEN_KEYS", "assert_metadata_only", "check_metadata_only"]

#: keys that would only ever hold values, free text or serialized objects
FORBIDDEN_KEYS = frozenset({
    "data", "values", "tensor_data", "weight", "weights", "bias", "parameters", "params",
    "state_dict", "buffers", "source", "source_code", "code", "traceback", "stack",
    "stacktrace", "message", "msg", "error_message", "exception", "exc_message", "text",
    "prompt", "repr", "pickle", "pickled", "payload", "locals", "globals", "args_repr",
})

_MAX_STR = 512  # a type name, code, fingerprint or a "was -> left" state description fits
_MAX_NUMBERS = 64  # a list of more plain numbers than this looks like a value dump
_FREE_TEXT = (
    re.compile(r"Traceback \(most recent call last\)"),
    re.compile(r'File "[^"]*", line \d+'),
    re.compile(r"^\s*(def|class|return|import|from)\s", re.MULTILINE),
    re.compile(r"\btensor\(\[?"),  # repr of a tensor
    re.compile(r"Parameter containing"),
    re.compile(r"\w+Error: \S"),  # "ValueError: something": an exception text
)


def check_metadata_only(doc: Any, *, sentinels: Iterable[str] = (),
                        sentinel_numbers: Iterable[float] = (),
                        path: str = "$") -> list[str]:
    """Every violation in ``doc``, one line each (``path: what``).

    ``sentinels``: strings the test planted where they must not travel
    (exception messages, string arguments, source comments); any occurrence,
    in a key or a value, is a violation.  ``sentinel_numbers``: numbers the
    test planted in tensors or parameters; a float equal to one is a
    violation.  The document must also survive ``json.dumps(allow_nan=False)``.
    """
    problems: list[str] = []
    texts = tuple(s for s in sentinels if s)
    numbers = tuple(float(n) for n in sentinel_numbers)
    _walk(doc, path, problems, texts, numbers)
    try:
        dumped = json.dumps(doc, allow_nan=False)
    except (TypeError, ValueError) as exc:
        problems.append(f"{path}: not plain JSON ({type(exc).__name__})")
    else:
        problems += [f"{path}: sentinel {s!r} appears in the serialized document"
                     for s in texts if s in dumped]
    # one line per violation, in order, without duplicates
    return list(dict.fromkeys(problems))


def assert_metadata_only(doc: Any, **kwargs: Any) -> None:
    problems = check_metadata_only(doc, **kwargs)
    if problems:
        raise AssertionError("not metadata-only:\n  - " + "\n  - ".join(problems))


def _walk(value: Any, path: str, out: list[str], texts: tuple[str, ...],
          numbers: tuple[float, ...]) -> None:
    if value is None or isinstance(value, bool):
        return
    if isinstance(value, int):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            out.append(f"{path}: non-finite number")
        if any(value == n for n in numbers):
            out.append(f"{path}: planted number {value!r} (a tensor or parameter value)")
        return
    if isinstance(value, str):
        _check_str(value, path, out, texts)
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                out.append(f"{path}: non-string key of type {type(k).__name__}")
                continue
            where = f"{path}.{k}"
            if k.lower() in FORBIDDEN_KEYS:
                out.append(f"{where}: forbidden key")
            _check_str(k, f"{path}[key]", out, texts)
            _walk(v, where, out, texts, numbers)
        return
    if isinstance(value, (list, tuple)):
        plain = sum(isinstance(v, float) for v in value)
        if plain > _MAX_NUMBERS:
            out.append(f"{path}: {plain} floats in one list (a value dump?)")
        for i, v in enumerate(value):
            _walk(v, f"{path}[{i}]", out, texts, numbers)
        return
    # tensors, arrays, bytes, arbitrary objects: never in a metadata document
    out.append(f"{path}: non-JSON value of type {type(value).__module__}."
               f"{type(value).__qualname__}")


def _check_str(s: str, path: str, out: list[str], texts: tuple[str, ...]) -> None:
    if len(s) > _MAX_STR:
        out.append(f"{path}: string of {len(s)} characters (free text?)")
    if "\n" in s or "\r" in s:
        out.append(f"{path}: multi-line string (free text?)")
    for pattern in _FREE_TEXT:
        if pattern.search(s):
            out.append(f"{path}: looks like free text ({pattern.pattern!r})")
    for t in texts:
        if t in s:
            out.append(f"{path}: contains the planted string {t!r}")
