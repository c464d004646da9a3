"""The report ``finalize()`` returns: captures, failures, and what keeps it
from being ok; metadata-only JSON."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
from torch import nn

from .._base.environment import environment
from ..backends import Backend, get_backend
from ..capture.options import CaptureOptions
from ..capture.results import Capture, CaptureFailure, Notice, Problem
from ..errors import Error
from ..fidelity.verify import UNOBSERVED, UNOBSERVED_HELP, Mismatch
from . import manifest as _manifest
from .explain import CaptureExplanation, Explanation, explain_captures

__all__ = ["REPORT_SCHEMA", "CaptureReport", "FidelityError"]

REPORT_SCHEMA = "ctxreplay.report/1"


@attrs.frozen(eq=False)
class CaptureReport:
    """What ``finalize()`` returns.

    ``ok`` is True only when every observed call is covered by a capture
    proven to reproduce it: no capture failed, every capture's fidelity
    holds, and there is no ``problem`` (dropped variants, observation
    errors, calls in compiled regions, a session that captured nothing...).
    """

    captures: tuple[Capture, ...]
    """Every captured variant."""
    failures: tuple[CaptureFailure, ...]
    """Variants that could not be captured (a reason code each)."""
    probes: tuple[str, ...]
    """Names of the probes observed."""
    settings: dict[str, Any]
    """The session's options as JSON (``CaptureOptions.to_json()``)."""
    dropped: dict[str, int]
    """Counts: ``variants`` and ``variant_calls`` past ``max_variants``, ``scopes`` (structures)
    past ``max_scopes``."""
    observation_errors: tuple[tuple[str, str, int], ...] = ()
    """``(where, what, count)`` of observation errors."""
    seconds: float = 0.0
    """Seconds ``finalize()`` took."""
    problems: tuple[Problem, ...] = ()
    """Why the report is not ok although no capture failed (reason codes)."""
    notices: tuple[Notice, ...] = ()
    """Suspicious though not wrong (``ok`` is unaffected)."""
    options: CaptureOptions | None = attrs.field(default=None, repr=False)
    """The session's options (``None`` for a report built by hand)."""
    retained: dict[str, int] | None = None
    """``verify="values"``: the byte cap, bytes held, variants not retained."""
    distributed: dict[str, Any] | None = None
    """A distributed finalize: world size, the group's ranks, backend, each rank's finalize seconds
    and number of captures (``None``: one process)."""
    _explanations: dict[tuple[str, int], CaptureExplanation] = attrs.field(
        factory=dict, repr=False, alias="explanations")

    @property
    def ok(self) -> bool:
        """Every observed call is covered by a capture proven to reproduce it."""
        return not self.failures and not self.problems and \
            all(c.fidelity.ok for c in self.captures)

    @property
    def summary(self) -> str:
        """One line: ``ok``, or why not -- the captures that do not reproduce
        their calls (the first mismatch named), the failures and the
        problems, counted."""
        if self.ok:
            said = f" (notices: {', '.join(n.reason for n in self.notices)})" \
                if self.notices else ""
            return f"ok: {len(self.captures)} captures{said}"
        parts = []
        bad = [c for c in self.captures if not c.fidelity.ok]
        if bad:
            first = next((f"{c.scope}#{c.variant}: {m.path} {m.field}: {m.live}"
                          for c in bad for m in c.fidelity.mismatches),
                         f"{bad[0].scope}#{bad[0].variant}")
            parts.append(f"{len(bad)} of {len(self.captures)} captures do not reproduce "
                         f"their calls (first: {first})")
        if self.failures:
            f = self.failures[0]
            parts.append(f"{len(self.failures)} variants not captured (first: "
                         f"{f.scope}#{f.variant}: {f.reason})")
        if self.problems:
            parts.append(f"{len(self.problems)} problems (first: {self.problems[0].reason})")
        return "not ok: " + "; ".join(parts)

    @property
    def explanations(self) -> dict[tuple[str, int], CaptureExplanation]:
        """``(scope, variant)`` -> probe effects, once computed."""
        return dict(self._explanations)

    @property
    def cache(self) -> dict[str, Any] | None:
        """The capture cache's share (``capture_with(..., cache=...)``): its
        ``directory``, the captures loaded ``from_cache``, those ``traced``, and
        those it could not keep (``not_stored``: ``scope#variant`` -> a code of
        ``cache.use.NOT_STORED_REASONS``); ``None``
        when the session used no cache."""
        where = self.settings.get("cache")
        if where is None:
            return None
        hits = sum(1 for c in self.captures if c.from_cache)
        return {"directory": where, "from_cache": hits, "traced": len(self.captures) - hits,
                "not_stored": {f"{c.scope}#{c.variant}": c.not_cached
                               for c in self.captures if c.not_cached}}

    @property
    def cache_summary(self) -> str | None:
        """``cache`` in one line (``None`` without a cache)."""
        cache = self.cache
        if cache is None:
            return None
        refused = len(cache["not_stored"])
        return (f"capture cache {cache['directory']}: {cache['from_cache']} of "
                f"{len(self.captures)} captures loaded from it and checked, "
                f"{cache['traced']} traced"
                + (f", {refused} of them could not be stored (see the CacheWarning)"
                   if refused else ""))

    def mismatches(self) -> Iterator[tuple[Capture, Mismatch]]:
        """Every ``(capture, mismatch)`` pair of the report, in capture order."""
        for c in self.captures:
            for m in c.fidelity.mismatches:
                yield c, m

    def explain(self, model: nn.Module, *, backend: str | Backend | None = None,
                include_neutral: bool = False) -> Explanation:
        """Which probes changed each captured graph.

        ``model`` is the module that was passed to ``capture_with`` (a
        finalized session keeps no reference to it).  Each capture is
        recaptured once per probe whose state was not neutral, with that
        probe's replay left out, and the graphs are compared op by op and
        dtype by dtype.  The results are returned, printable with
        ``.table()``, and kept on the report: ``to_json()`` stores them
        under each capture's ``explain`` key.  Live probe states (a forward
        context) are released by ``finalize()``: pass ``explain=True`` to
        ``finalize`` to explain while they are held; here such captures say
        ``unavailable``.

        Args:
            model: the module that was passed to ``capture_with``.
            backend: ``None`` reuses each capture's backend (a custom backend
                must be passed again).
            include_neutral: recapture probes in their neutral state too.
        """
        options = self.options
        if options is None:
            raise ValueError("explain: this report has no session options; explain it with "
                             "finalize(explain=True)")
        if backend is not None:
            options = attrs.evolve(options, backend=get_backend(backend))
        result = explain_captures(self.captures, model, options,
                                  include_neutral=include_neutral,
                                  reuse_backend=backend is None)
        # what finalize(explain=True) worked out while the live states were
        # held stays: a later explain that can no longer replay them says less
        kept = []
        for ce in result.captures:
            before = self._explanations.get((ce.scope, ce.variant))
            unavailable = any(e.status == "unavailable" for e in ce.effects)
            kept.append(before if before is not None and unavailable else ce)
        result = Explanation(tuple(kept), self.notices)
        self._keep(result)
        return result

    def _keep(self, explanation: Explanation) -> None:
        """Store explanations on this report (the report's own state)."""
        for ce in explanation.captures:
            self._explanations[(ce.scope, ce.variant)] = ce

    def to_json(self) -> dict[str, Any]:
        """Metadata only: no tensor values, parameters, strings from the
        user's inputs or source."""
        return {
            "schema": REPORT_SCHEMA,
            "ok": self.ok,
            "environment": environment(),
            "probes": list(self.probes),
            "settings": dict(self.settings),
            "seconds": round(self.seconds, 6),
            "dropped": dict(self.dropped),
            "observation_errors": [list(e) for e in self.observation_errors],
            "problems": [p.to_json() for p in self.problems],
            "notices": [n.to_json() for n in self.notices],
            "retained": None if self.retained is None else dict(self.retained),
            "distributed": None if self.distributed is None else dict(self.distributed),
            "cache": self.cache,
            "captures": [self._capture_json(c) for c in self.captures],
            "failures": [f.to_json() for f in self.failures],
        }

    def _capture_json(self, c: Capture) -> dict[str, Any]:
        doc = c.to_json()
        explained = self._explanations.get((c.scope, c.variant))
        if explained is not None:
            doc["explain"] = [e.to_json() for e in explained.effects]
        return doc

    def save(self, path: str | Path) -> None:
        """Write ``to_json()`` to ``path`` (what ``ctxreplay explain`` reads)."""
        Path(path).write_text(json.dumps(self.to_json(), indent=2, sort_keys=True))

    def save_all(self, directory: str | Path, *, verify: bool = True,
                 progress: Callable[[int, int, str], None] | None = None
                 ) -> _manifest.SavedManifest:
        """Write every capture into ``directory`` (created if missing): per
        capture its artifact file (named with its format's suffix: ``.pt2``
        for a torch.export program) and metadata-only sidecar (``Capture.save``,
        ``verify`` as there), and one ``manifest.json`` indexing them --
        scopes, the members each capture stands for and whose weights it
        holds (``weights_from``), variants, signatures, snapshots (their
        portable part), fingerprints, fidelity, failures, problems and the
        versions (ctxreplay, torch, Python, device type and capability,
        autocast op policy).  A capture no registered artifact format can
        hold (for the ``.pt2``, another backend than ``torch.export``) is
        recorded as not saved, with its reason code.  Open the directory
        with :func:`ctxreplay.load`.

        Each written file is loaded back and checked (``SavedArtifact.fidelity``):
        one that holds the very program ``finalize()`` already checked is
        compared by its graph and weights and not run (it is vouched for as
        far as that capture's check went: ``Capture.fidelity.checked``).  ``progress(done,
        total, capture)`` is called after each capture; with many captures a
        tqdm bar shows on a terminal (when tqdm is installed), else one
        ``logging`` line per capture (logger ``"ctxreplay"``), and one summary
        line at the end."""
        return _manifest.save_all(self, directory, verify=verify, progress=progress)


class FidelityError(Error, AssertionError):
    """Raised by ``finalize(strict=True)``: lists every mismatch, failure and
    problem."""

    def __init__(self, report: CaptureReport) -> None:
        lines = [f"{c.scope}#{c.variant}: {m.path} {m.field} live={m.live} "
                 f"captured={m.captured} ({m.level})"
                 + (f" [{', '.join(m.members)}]" if m.members else "")
                 + (f" -- {_hint_text(m.hint)}" if m.hint else "")
                 for c, m in report.mismatches()]
        lines += [f"{f.scope}#{f.variant}: capture failed: {f.reason} ({f.exc_type}"
                  + (f": {f.message}" if f.message else "") + ")"
                  for f in report.failures]
        lines += [f"{p.reason}: {p.message}" for p in report.problems]
        super().__init__("capture does not match the live call:\n  " + "\n  ".join(lines))
        self.report = report
        """The report that was not ok."""


def _hint_text(hint: str) -> str:
    """A mismatch's hint for a person: the unobserved-state hint with how to
    find that state."""
    return UNOBSERVED_HELP if hint == UNOBSERVED else hint
