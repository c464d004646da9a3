"""The metadata-only oracle for ``CaptureReport.to_json()``.

``check_metadata_only(doc)`` walks a report document and fails on anything
that is not metadata: long strings, multi-line text, prose (exception
messages, source), lists of floats (tensor data), and any given sentinel
string.  ``finalize_checked(session)`` is how the engine tests finalize, so
every report they build passes through it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

from ctxreplay import CaptureReport, CaptureSession

__all__ = ["MetadataViolation", "check_metadata_only", "check_report", "finalize_checked"]

MAX_STRING = 200
#: this many float entries in one list look like tensor values
MAX_FLOATS = 4
#: keys whose value is a scalar constant, never a container of numbers
SCALAR_KEYS = frozenset({"value", "values", "data", "tensor_data", "storage"})
#: a word of English prose: letters only, an optional trailing punctuation mark
_WORD = re.compile(r"^[A-Za-z][a-z']*[.,;:!?]?$")
#: this many prose words in a row make a sentence
PROSE_RUN = 4
#: library-authored templates that are allowed to read like prose, by key
LIBRARY_TEXT = {
    # Mismatch.hint: a fixed phrase, then probe=state pairs
    "hint": re.compile(r"^not carried by the artifact: [^\n]*$"),
}
_SUSPICIOUS = ("Traceback", 'File "', "tensor(", "Parameter containing", "\n", "\r", "\t")


class MetadataViolation(AssertionError):
    """What ``check_metadata_only`` raises: the JSON path and why."""


def _prose(text: str) -> bool:
    run = 0
    for token in text.split():
        run = run + 1 if _WORD.match(token) else 0
        if run >= PROSE_RUN:
            return True
    return False


def check_metadata_only(doc: Any, *, sentinels: Iterable[str] = ()) -> None:
    """Raise ``MetadataViolation`` naming the first offending path.

    Also fails when ``doc`` is not plain JSON (``json.dumps`` with
    ``allow_nan=False``) or when any of ``sentinels`` occurs anywhere in it.
    """
    try:
        text = json.dumps(doc, allow_nan=False, sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise MetadataViolation(f"not plain JSON: {type(exc).__name__}") from None
    for s in sentinels:
        if s in text:
            raise MetadataViolation(f"sentinel {s!r} found in the document")
    _walk(doc, "$", None)


def _walk(value: Any, path: str, key: str | None) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise MetadataViolation(f"{path}: non-string key {k!r}")
            _check_string(k, f"{path}.<key {k[:40]!r}>", None)
            _walk(v, f"{path}.{k}", k)
        return
    if isinstance(value, list):
        floats = sum(isinstance(v, float) for v in value)
        if floats and key in SCALAR_KEYS:
            raise MetadataViolation(f"{path}: {key!r} holds a list of floats (tensor data?)")
        if floats > MAX_FLOATS:
            raise MetadataViolation(f"{path}: a list of {floats} floats (tensor data?)")
        for i, v in enumerate(value):
            _walk(v, f"{path}[{i}]", key)
        return
    if key in SCALAR_KEYS and isinstance(value, dict | list):
        raise MetadataViolation(f"{path}: {key!r} holds a container")
    if isinstance(value, str):
        _check_string(value, path, key)
        return
    if value is None or isinstance(value, bool | int | float):
        return
    raise MetadataViolation(f"{path}: unexpected type {type(value).__name__}")


def _check_string(text: str, path: str, key: str | None) -> None:
    if len(text) > MAX_STRING:
        raise MetadataViolation(f"{path}: string of {len(text)} characters")
    for bad in _SUSPICIOUS:
        if bad in text:
            raise MetadataViolation(f"{path}: contains {bad!r}")
    template = LIBRARY_TEXT.get(key or "")
    if template is not None and template.match(text):
        return
    if _prose(text):
        raise MetadataViolation(f"{path}: reads like prose: {text[:60]!r}")


def check_report(report: CaptureReport, *, sentinels: Iterable[str] = ()) -> CaptureReport:
    """``check_metadata_only(report.to_json())``; returns the report."""
    doc = report.to_json()
    check_metadata_only(doc, sentinels=sentinels)
    # the document must survive a JSON round trip unchanged
    assert json.loads(json.dumps(doc)) == doc
    return report


def finalize_checked(session: CaptureSession, *, strict: bool = False,
                     sentinels: Iterable[str] = ()) -> CaptureReport:
    """``session.finalize()``, with the report checked to be metadata only."""
    return check_report(session.finalize(strict=strict), sentinels=sentinels)
