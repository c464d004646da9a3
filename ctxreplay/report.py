"""Capture records and the metadata-only report."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from .signature import CallSpec, Spec, SpecMismatch, spec_to_json
from .snapshot import ContextSnapshot

if TYPE_CHECKING:
    from torch import nn

    from .artifact import SavedArtifact
    from .explain import CaptureExplanation, Explanation

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

    def save(self, path: str | Path, *, verify: bool = True) -> SavedArtifact:
        """Write the artifact as a ``.pt2`` that ``torch.export.load`` reads back,
        and a metadata-only sidecar ``<path>.json`` (snapshot and signatures;
        read it with :func:`ctxreplay.load_sidecar`).

        Only ``torch.export`` artifacts can be saved; any other backend raises
        :class:`ctxreplay.ArtifactError` naming it.  Context wrappers the
        serialiser rejects are lowered to explicit casts first.  ``verify``
        loads the file back, runs it on fresh inputs outside any replay and
        compares with the live call: the result is the returned
        ``SavedArtifact.fidelity`` (also stored in the sidecar).
        """
        from .artifact import save_capture

        return save_capture(self, path, verify=verify)

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
    type, never the exception's text.

    Reasons: a backend's code (``trace_error``, ``unsupported_graph``,
    ``data_dependent_control_flow``, ``dynamic_python_control_flow``, or a
    custom backend's ``BackendError.reason``); ``replay_failed`` (a probe's
    replay raised entering, inside the trace or restoring); ``timeout``
    (``capture_timeout`` passed; the capture thread is abandoned);
    ``no_artifact`` / ``bad_artifact`` (the backend returned ``None``, or
    something its own accessors fail on); ``materialize_failed``,
    ``verify_failed``, ``module_released``, ``internal_error``.  And
    ``state_leak``: the variant captured, but afterwards the ambient state
    differed from the state ``finalize()`` began with -- the engine put it
    back; ``context`` names each probe as ``"was -> left"`` (and
    ``torch_global_state`` what only torch's guard saw, not put back).
    """

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
    #: filled by ``explain()``: (scope, variant) -> probe effects
    explanations: dict[tuple[str, int], CaptureExplanation] = attrs.field(factory=dict,
                                                                         repr=False)

    @property
    def ok(self) -> bool:
        """No failure and every capture's fidelity holds."""
        return not self.failures and all(c.fidelity.ok for c in self.captures)

    def mismatches(self) -> Iterator[tuple[Capture, Mismatch]]:
        """Every ``(capture, mismatch)`` pair of the report, in capture order."""
        for c in self.captures:
            for m in c.fidelity.mismatches:
                yield c, m

    def explain(self, model: nn.Module, *, backend: object = None,
                include_neutral: bool = False) -> Explanation:
        """Which probes changed each captured graph.

        ``model`` is the module that was passed to ``capture_with`` (a
        finalized session keeps no reference to it).  Each capture is
        recaptured once per probe whose state was not neutral, with that
        probe's replay left out, and the graphs are compared op by op and
        dtype by dtype.  The results are returned, printable with
        ``.table()``, and kept on the report: ``to_json()`` stores them under
        each capture's ``explain`` key (``ctxreplay explain REPORT.json``).
        ``backend``: ``None`` reuses each capture's backend (a custom backend
        must be passed again).
        """
        from .explain import explain

        return explain(self, model, backend=backend, include_neutral=include_neutral)

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
            "captures": [self._capture_json(c) for c in self.captures],
            "failures": [f.to_json() for f in self.failures],
        }

    def _capture_json(self, c: Capture) -> dict[str, Any]:
        doc = c.to_json()
        explained = self.explanations.get((c.scope, c.variant))
        if explained is not None:
            doc["explain"] = [e.to_json() for e in explained.effects]
        return doc

    def save(self, path: str | Path) -> None:
        """Write ``to_json()`` to ``path`` (what ``ctxreplay explain`` reads)."""
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
