"""The metadata-only oracle for ctxreplay's JSON documents.

A report (``CaptureReport.to_json()``), a snapshot document or an artifact
sidecar may carry names, codes, shapes, dtypes, devices, counts and short
descriptions -- never tensor values, parameter data, exception messages,
source text or the contents of strings the user passed in.

* ``metadata_violations(doc)``: one line per violation (empty: clean);
* ``assert_metadata_only(doc)``: raises ``MetadataViolation`` with them;
* ``check_report(report)``: the same for ``report.to_json()``, which must
  also serialise with ``allow_nan=False`` and survive a JSON round trip;
* ``finalize_checked(session)``: ``session.finalize()`` then ``check_report``.

``ReportAudit`` wraps ``CaptureSession.finalize`` (and ``CaptureReport.explain``
and ``save_capture``) so that tests/conftest.py checks every report the suite
produces, not only those a test checks by hand.

The rules (each one has a self-test in tests/project/test_metadata_check.py):

* plain JSON only: ``json.dumps(allow_nan=False)`` must succeed; no
  non-finite floats, no objects (tensors, bytes...), string keys only;
* no key in ``FORBIDDEN_KEYS``; a key in ``SCALAR_KEYS`` holds a scalar;
* strings (keys and values) at most ``MAX_STRING`` characters, without
  control characters (newlines, tabs), traceback, ``tensor(`` or source text
  (``FREE_TEXT``), and without ``PROSE_RUN`` prose words in a row -- except
  the library's own ``hint`` phrase, and only under the ``hint`` key;
* no list with more than ``MAX_FLOATS`` floats (tensor data);
* none of the given ``sentinels`` (planted strings) anywhere, in a key, a
  value or the serialised document; no float equal to one of the given
  ``sentinel_numbers`` (planted tensor or parameter values).
"""

from __future__ import annotations

import functools
import json
import math
import re
import threading
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from ctxreplay import CaptureReport, CaptureSession, FidelityError

__all__ = ["FORBIDDEN_KEYS", "MetadataViolation", "ReportAudit", "assert_metadata_only",
           "check_report", "finalize_checked", "metadata_violations", "report_violations"]

#: keys that would only ever hold values, free text or serialized objects
FORBIDDEN_KEYS = frozenset({
    "data", "values", "tensor_data", "weight", "weights", "bias", "parameters", "params",
    "state_dict", "buffers", "source", "source_code", "code", "traceback", "stack",
    "stacktrace", "message", "msg", "error_message", "exception", "exc_message", "text",
    "prompt", "repr", "pickle", "pickled", "payload", "locals", "globals", "args_repr",
})
#: keys whose value is a scalar constant (a ``ConstSpec`` value), never a container
SCALAR_KEYS = frozenset({"value", "storage"})
#: a type name, code, fingerprint or a "was -> left" state description fits
MAX_STRING = 200
#: more floats than this in one list look like tensor values
MAX_FLOATS = 4
#: this many prose words in a row make a sentence
PROSE_RUN = 4
#: a word of English prose: letters only, an optional trailing punctuation mark
_WORD = re.compile(r"^[A-Za-z][a-z']*[.,;:!?]?$")
#: control characters: newlines, tabs, escapes
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
#: text that is a traceback, a tensor's repr, source code or an exception message
FREE_TEXT = (
    re.compile(r"Traceback"),
    re.compile(r'File "'),
    re.compile(r"tensor\("),
    re.compile(r"Parameter containing"),
    re.compile(r"^\s*(def|class|return|import|from|lambda)\s"),
    re.compile(r"\w+(Error|Exception): \S"),
)
#: the one library-authored phrase allowed to read like prose, and only under
#: the ``hint`` key (``Mismatch.hint``): the phrase, then comma-separated
#: probe names or ``probe=state`` pairs, each checked like any other string
HINT_KEY = "hint"
HINT_PHRASE = "not carried by the artifact: "
#: the other hint, whole: a value mismatch no observed state explains
UNOBSERVED_HINT = "state no probe observes"


class MetadataViolation(AssertionError):
    """What ``assert_metadata_only`` and ``check_report`` raise: every
    violation, one line each (``path: what``)."""

    def __init__(self, problems: list[str], what: str = "not metadata-only") -> None:
        self.problems = list(problems)
        super().__init__(f"{what}:\n  - " + "\n  - ".join(self.problems))


def metadata_violations(doc: Any, *, sentinels: Iterable[str] = (),
                        sentinel_numbers: Iterable[float] = (),
                        path: str = "$") -> list[str]:
    """Every violation in ``doc``, one line each, in order, without duplicates."""
    texts = tuple(s for s in sentinels if s)
    numbers = tuple(float(n) for n in sentinel_numbers)
    problems: list[str] = []
    _walk(doc, path, None, problems, texts, numbers)
    try:
        dumped = json.dumps(doc, allow_nan=False)
    except (TypeError, ValueError) as exc:
        problems.append(f"{path}: not plain JSON ({type(exc).__name__})")
    else:
        # also what an escape in the serialised form would hide from the walk
        problems += [f"{path}: sentinel {s!r} in the serialized document"
                     for s in texts if s in dumped or json.dumps(s)[1:-1] in dumped]
    return list(dict.fromkeys(problems))


def assert_metadata_only(doc: Any, *, sentinels: Iterable[str] = (),
                         sentinel_numbers: Iterable[float] = ()) -> None:
    """Raise ``MetadataViolation`` listing every violation in ``doc``."""
    problems = metadata_violations(doc, sentinels=sentinels, sentinel_numbers=sentinel_numbers)
    if problems:
        raise MetadataViolation(problems)


def report_violations(report: CaptureReport, *, sentinels: Iterable[str] = (),
                      sentinel_numbers: Iterable[float] = ()) -> list[str]:
    """``metadata_violations(report.to_json())``, plus: the document serialises
    with ``allow_nan=False`` and reads back equal (no tuples, no odd keys)."""
    doc = report.to_json()
    try:
        text = json.dumps(doc, allow_nan=False)
    except (TypeError, ValueError) as exc:
        text = None
        problems = [f"$: json.dumps(allow_nan=False) fails ({type(exc).__name__})"]
    else:
        problems = []
    problems += metadata_violations(doc, sentinels=sentinels, sentinel_numbers=sentinel_numbers)
    if text is not None and json.loads(text) != doc:
        problems.append("$: the document does not survive a JSON round trip")
    return problems


def check_report(report: CaptureReport, *, sentinels: Iterable[str] = (),
                 sentinel_numbers: Iterable[float] = ()) -> CaptureReport:
    """Raise ``MetadataViolation`` unless ``report.to_json()`` is metadata only;
    return the report."""
    problems = report_violations(report, sentinels=sentinels, sentinel_numbers=sentinel_numbers)
    if problems:
        raise MetadataViolation(problems, "report is not metadata-only")
    return report


def finalize_checked(session: CaptureSession, *, strict: bool = False,
                     sentinels: Iterable[str] = (),
                     sentinel_numbers: Iterable[float] = ()) -> CaptureReport:
    """``session.finalize(strict=strict)``, with the report checked."""
    return check_report(session.finalize(strict=strict), sentinels=sentinels,
                        sentinel_numbers=sentinel_numbers)


# -- the walk -------------------------------------------------------------------------

def _walk(value: Any, path: str, key: str | None, out: list[str], texts: tuple[str, ...],
          numbers: tuple[float, ...]) -> None:
    if key in SCALAR_KEYS and isinstance(value, dict | list | tuple):
        out.append(f"{path}: {key!r} holds a container (tensor data?)")
    if key == HINT_KEY and value is not None and not isinstance(value, str):
        out.append(f"{path}: {HINT_KEY!r} holds a {type(value).__name__}, not the library's "
                   "phrase")
    if value is None or isinstance(value, bool | int):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            out.append(f"{path}: non-finite number")
        if any(value == n for n in numbers):
            out.append(f"{path}: planted number {value!r} (a tensor or parameter value)")
        return
    if isinstance(value, str):
        _check_str(value, path, key, out, texts)
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                out.append(f"{path}: non-string key of type {type(k).__name__}")
                continue
            if k.lower() in FORBIDDEN_KEYS:
                out.append(f"{path}.{k}: forbidden key")
            _check_str(k, f"{path}.<key {k[:40]!r}>", None, out, texts)
            _walk(v, f"{path}.{k}", k, out, texts, numbers)
        return
    if isinstance(value, list | tuple):
        floats = sum(isinstance(v, float) for v in value)
        if floats > MAX_FLOATS:
            out.append(f"{path}: {floats} floats in one list (tensor data?)")
        for i, v in enumerate(value):
            _walk(v, f"{path}[{i}]", key, out, texts, numbers)
        return
    # tensors, arrays, bytes, arbitrary objects: never in a metadata document
    out.append(f"{path}: non-JSON value of type {type(value).__module__}."
               f"{type(value).__qualname__}")


def _check_str(s: str, path: str, key: str | None, out: list[str],
               texts: tuple[str, ...]) -> None:
    if len(s) > MAX_STRING:
        out.append(f"{path}: string of {len(s)} characters (free text?)")
    if _CONTROL.search(s):
        out.append(f"{path}: control character (multi-line or tabbed free text?)")
    for pattern in FREE_TEXT:
        if pattern.search(s):
            out.append(f"{path}: looks like free text ({pattern.pattern!r})")
    for t in texts:
        if t in s:
            out.append(f"{path}: contains the planted string {t!r}")
    if key == HINT_KEY and s == UNOBSERVED_HINT:
        return
    if key == HINT_KEY:
        if not s.startswith(HINT_PHRASE):
            out.append(f"{path}: {HINT_KEY!r} is not the library's phrase: {s[:60]!r}")
            return
        # the phrase itself may read like prose; what follows it may not
        parts = s[len(HINT_PHRASE):].split(", ")
    else:
        parts = [s]
    if any(_prose(p) for p in parts):
        out.append(f"{path}: reads like prose: {s[:60]!r}")


def _prose(text: str) -> bool:
    run = 0
    for token in text.split():
        run = run + 1 if _WORD.match(token) else 0
        if run >= PROSE_RUN:
            return True
    return False


# -- every report of the suite ----------------------------------------------------------

class ReportAudit:
    """Checks every report (and sidecar) through wrapped library entry points.

    ``wrap_finalize(CaptureSession.finalize)`` returns a drop-in ``finalize``
    (same signature, arguments, return value and exceptions) that checks the
    report it returns -- or the ``report`` of the ``FidelityError`` it raises
    -- and raises ``MetadataViolation`` instead when that report is not
    metadata only.  Every violation is also kept in ``violations``, so that
    one raised in a thread or swallowed by a broad ``except`` is not lost.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: dict[str, int] = {"finalize": 0, "FidelityError": 0, "explain": 0,
                                       "sidecar": 0, "manifest": 0}
        self.violations: list[str] = []
        self.reports = 0  # distinct reports checked
        self._seen: weakref.WeakSet[CaptureReport] = weakref.WeakSet()

    def reset(self) -> list[str]:
        """Forget the violations recorded so far; return them."""
        with self._lock:
            found, self.violations = self.violations, []
            return found

    def _record(self, kind: str, problems: list[str]) -> None:
        with self._lock:
            self.counts[kind] += 1
            self.violations += [f"{kind}: {p}" for p in problems]
        if problems:
            raise MetadataViolation(problems, f"{kind}: report is not metadata-only")

    def check(self, kind: str, report: CaptureReport) -> None:
        with self._lock:
            if report not in self._seen:
                self._seen.add(report)
                self.reports += 1
        self._record(kind, report_violations(report))

    def check_sidecar(self, path: Path) -> None:
        problems = metadata_violations(json.loads(Path(path).read_text()))
        self._record("sidecar", [f"{path.name}: {p}" for p in problems])

    def wrap_manifest(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """``ctxreplay.report.manifest.write_manifest``: what ``report.save_all`` writes
        last; checked before it is written."""

        @functools.wraps(original)
        def write_manifest(path: Path, doc: Any) -> None:
            self._record("manifest", [f"{Path(path).name}: {p}"
                                      for p in metadata_violations(doc)])
            original(path, doc)

        return write_manifest

    def wrap_finalize(self, original: Callable[..., CaptureReport]) -> Callable[..., Any]:
        @functools.wraps(original)
        def finalize(session: CaptureSession, *args: Any, **kwargs: Any) -> CaptureReport:
            try:
                report = original(session, *args, **kwargs)
            except FidelityError as exc:
                self.check("FidelityError", exc.report)
                raise
            self.check("finalize", report)
            return report

        return finalize

    def wrap_explain(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """``CaptureReport.explain`` stores its results in the report's JSON."""

        @functools.wraps(original)
        def explain(report: CaptureReport, *args: Any, **kwargs: Any) -> Any:
            result = original(report, *args, **kwargs)
            self.check("explain", report)
            return result

        return explain

    def wrap_save(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """``ctxreplay.artifacts.saving.save_capture``: what ``Capture.save`` runs."""

        @functools.wraps(original)
        def save_capture(*args: Any, **kwargs: Any) -> Any:
            saved = original(*args, **kwargs)
            self.check_sidecar(saved.sidecar)
            return saved

        return save_capture
