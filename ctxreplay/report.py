"""Capture records and the metadata-only report."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs

from .signature import CallSpec, Spec, SpecMismatch, spec_to_json
from .snapshot import ContextSnapshot

__all__ = ["REPORT_SCHEMA", "Capture", "CaptureFailure", "CaptureReport", "Fidelity",
           "FidelityError", "Mismatch"]

REPORT_SCHEMA = "ctxreplay.report/1"


@attrs.frozen
class Mismatch:
    """A captured output that disagrees with the live one."""

    path: str
    field: str
    live: str
    captured: str
    level: str  # "signature" or "execute"
    hint: str | None = None  # probes whose state was not carried by the artifact

    @classmethod
    def of(cls, m: SpecMismatch, level: str, hint: str | None) -> Mismatch:
        return cls(m.path, m.field, m.live, m.captured, level, hint)

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)


@attrs.frozen
class Fidelity:
    """Whether the capture matches its live call, at the requested level."""

    level: str
    ok: bool
    mismatches: tuple[Mismatch, ...] = ()
    checked: tuple[str, ...] = ()  # levels actually checked

    def to_json(self) -> dict[str, Any]:
        return {"level": self.level, "ok": self.ok, "checked": list(self.checked),
                "mismatches": [m.to_json() for m in self.mismatches]}


@attrs.frozen(eq=False)
class Capture:
    """One captured variant."""

    scope: str
    members: tuple[str, ...]
    variant: int
    signature: CallSpec
    outputs: Spec | None  # the live call's
    graph_outputs: Spec | None  # what the captured graph says (flattened leaves)
    snapshot: ContextSnapshot
    calls: int
    backend: str
    artifact: Any = attrs.field(repr=False)
    fidelity: Fidelity
    fingerprint: str
    embedded: tuple[str, ...]
    ambient_only: tuple[str, ...]
    binding: str
    constants: tuple[str, ...]
    attempts: tuple[tuple[str, str, str], ...]
    seconds: float
    ops: tuple[tuple[str, str | None], ...] = attrs.field(repr=False, default=())

    def to_json(self) -> dict[str, Any]:
        return {
            "scope": self.scope,
            "members": list(self.members),
            "variant": self.variant,
            "calls": self.calls,
            "backend": self.backend,
            "binding": self.binding,
            "constants": list(self.constants),
            "embedded": list(self.embedded),
            "ambient_only": list(self.ambient_only),
            "attempts": [list(a) for a in self.attempts],
            "fingerprint": self.fingerprint,
            "seconds": round(self.seconds, 6),
            "inputs": {"args": [spec_to_json(s) for s in self.signature.args],
                       "kwargs": [[k, spec_to_json(s)] for k, s in self.signature.kwargs]},
            "outputs": None if self.outputs is None else spec_to_json(self.outputs),
            "graph_outputs": None if self.graph_outputs is None
            else spec_to_json(self.graph_outputs),
            "snapshot": self.snapshot.to_json(),
            "context": self.snapshot.describe(),
            "fidelity": self.fidelity.to_json(),
            "graph": {"nodes": len(self.ops),
                      "ops": sorted({op for op, _ in self.ops})},
        }


@attrs.frozen
class CaptureFailure:
    """A variant that could not be captured: a reason code and the exception
    type, never the exception's text."""

    scope: str
    variant: int
    backend: str
    reason: str
    exc_type: str
    attempts: tuple[tuple[str, str, str], ...] = ()
    context: dict[str, str] = attrs.field(factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"scope": self.scope, "variant": self.variant, "backend": self.backend,
                "reason": self.reason, "exc_type": self.exc_type,
                "attempts": [list(a) for a in self.attempts], "context": dict(self.context)}


@attrs.frozen(eq=False)
class CaptureReport:
    """What ``finalize()`` returns."""

    captures: tuple[Capture, ...]
    failures: tuple[CaptureFailure, ...]
    probes: tuple[str, ...]
    settings: dict[str, Any]
    dropped: dict[str, int]
    observation_errors: tuple[tuple[str, str, int], ...] = ()  # (reason, exc type, count)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """No failure and every capture's fidelity holds."""
        return not self.failures and all(c.fidelity.ok for c in self.captures)

    def mismatches(self) -> Iterator[tuple[Capture, Mismatch]]:
        for c in self.captures:
            for m in c.fidelity.mismatches:
                yield c, m

    def to_json(self) -> dict[str, Any]:
        """Metadata only: no tensor values, parameters, strings from the
        user's inputs, exception texts or source."""
        return {
            "schema": REPORT_SCHEMA,
            "ok": self.ok,
            "probes": list(self.probes),
            "settings": dict(self.settings),
            "seconds": round(self.seconds, 6),
            "dropped": dict(self.dropped),
            "observation_errors": [list(e) for e in self.observation_errors],
            "captures": [c.to_json() for c in self.captures],
            "failures": [f.to_json() for f in self.failures],
        }

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2, sort_keys=True))


class FidelityError(AssertionError):
    """Raised by ``finalize(strict=True)``: lists every mismatch and failure."""

    def __init__(self, report: CaptureReport) -> None:
        lines = [f"{c.scope}#{c.variant}: {m.path} {m.field} live={m.live} "
                 f"captured={m.captured} ({m.level})" + (f" -- {m.hint}" if m.hint else "")
                 for c, m in report.mismatches()]
        lines += [f"{f.scope}#{f.variant}: capture failed: {f.reason} ({f.exc_type})"
                  for f in report.failures]
        super().__init__("capture does not match the live call:\n  " + "\n  ".join(lines))
        self.report = report
