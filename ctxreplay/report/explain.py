"""Which probes changed a captured graph: recapture with each one left out.

``explain_captures`` recaptures every capture once per probe whose observed
state is not neutral, with that probe's replay left out
(``capture.snapshot.without(name)``), and compares the graphs node by node:
ops and their dtypes.  A capture whose context can no longer be replayed
(its live states were released by ``finalize()``) is reported
``unavailable`` -- never blamed on a probe.  Beside the probes, a capture
checked by value shows how many of its calls were compared, and how many
its level meant to compare the ``retain_bytes`` budget did not keep; the
places its program baked in (which an installed model checks per call) and
those whose state changed between its members' calls.
"""

from __future__ import annotations

import difflib
import textwrap
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs
from torch import nn

from .._base.jsonread import read_int, read_list, read_mapping, read_str
from ..backends import Backend, UnknownBackendError, get_backend
from ..capture.options import CaptureOptions
from ..capture.results import Capture, Notice
from ..capture.variant import READ_FIELD, CaptureFailed, recapture
from ..core.snapshots import ContextSnapshot
from ..fidelity.verify import is_neutral
from ..specs.baked import Baked
from ..specs.signature import Spec, TensorSpec, flatten_spec

__all__ = ["EFFECT_REASONS", "STATUSES", "CaptureExplanation", "Explanation", "ProbeEffect",
           "compare_ops", "explain_capture", "explain_captures"]

#: ``changed``: leaving the probe out changes the graph; ``no effect``: it does
#: not; ``neutral``: its state is what a fresh process has, so leaving it out
#: cannot change anything and no recapture is made; ``failed``: the capture
#: without it failed (``reason`` says why -- itself a sign the probe matters);
#: ``unavailable``: the capture's context can no longer be replayed (live
#: states released by ``finalize()``; explain with ``finalize(explain=True)``).
STATUSES = ("changed", "no effect", "neutral", "failed", "unavailable")

#: ``ProbeEffect.reason`` of an ``unavailable`` or ``failed`` effect besides a
#: ``CaptureFailure`` reason of the recapture: the context's live states were
#: released; the capture's backend is not one explain can rebuild; no module
#: of the model is the capture's member
EFFECT_REASONS = ("replay_released", "backend_unavailable", "module_not_found")


@attrs.frozen
class ProbeEffect:
    """What leaving one probe's replay out did to one capture's graph.

    ``retyped``: nodes with the same op but another dtype; ``added`` /
    ``removed``: nodes only in the graph without the probe / only in the
    faithful one; ``constants``: nodes with the same op whose non-tensor
    arguments differ (a scale, a dim, a flag); ``changed`` is their sum.
    ``outputs``: the graph output dtypes without the probe when they differ
    from the faithful ones.
    """

    probe: str
    """The probe whose replay was left out."""
    state: str
    """Its state in the capture's context, in words."""
    status: str
    """One of ``STATUSES``: ``changed``, ``no effect``, ``neutral``, ``failed`` or
    ``unavailable``."""
    changed: int = 0
    """Nodes that differ: ``retyped + added + removed + constants``."""
    retyped: int = 0
    """Nodes with the same op but another result dtype."""
    added: int = 0
    """Nodes only in the graph captured without the probe."""
    removed: int = 0
    """Nodes only in the faithful graph."""
    outputs: tuple[str, ...] = ()
    """The graph's output dtypes without the probe, when they differ from the faithful ones."""
    live_outputs: tuple[str, ...] = ()
    """The faithful graph's output dtypes, when ``outputs`` differ from them."""
    reason: str | None = None
    """Why a ``failed`` or ``unavailable`` effect has no comparison: a ``CaptureFailure`` reason of
    the recapture, or one of ``EFFECT_REASONS``."""
    constants: int = 0
    """Nodes with the same op whose non-tensor arguments differ (a scale, a dim, a flag)."""

    def describe(self) -> str:
        """One line for the table."""
        if self.status == "neutral":
            return "no effect (neutral state: nothing to replay)"
        if self.status == "failed":
            return f"capture fails without it: {self.reason}"
        if self.status == "unavailable":
            return (f"not explained: {self.reason} (a live state was released by "
                    "finalize(); explain with finalize(explain=True))")
        if self.status == "no effect":
            return "no effect"
        text = (f"{self.changed} node{'s' if self.changed != 1 else ''} changed "
                f"({self.retyped} retyped, +{self.added}, -{self.removed}"
                + (f", {self.constants} constants" if self.constants else "") + ")")
        if self.outputs:
            text += f"; outputs {','.join(self.live_outputs)} -> {','.join(self.outputs)}"
        return text

    def to_json(self) -> dict[str, Any]:
        """Metadata only."""
        return {"probe": self.probe, "state": self.state, "status": self.status,
                "changed": self.changed, "retyped": self.retyped, "added": self.added,
                "removed": self.removed, "constants": self.constants,
                "outputs": list(self.outputs),
                "live_outputs": list(self.live_outputs), "reason": self.reason}

    @classmethod
    def from_json(cls, data: object, path: str = "$") -> ProbeEffect:
        """Strict inverse of ``to_json``; ``ValueError`` naming the path."""
        keys = {"probe", "state", "status", "changed", "retyped", "added", "removed",
                "constants", "outputs", "live_outputs", "reason"}
        doc = read_mapping(data, path, keys=keys, required={"probe", "state", "status"})
        counts = {k: read_int(doc.get(k, 0), f"{path}.{k}", lo=0)
                  for k in ("changed", "retyped", "added", "removed", "constants")}
        reason = doc.get("reason")
        return cls(
            read_str(doc["probe"], f"{path}.probe"),
            read_str(doc["state"], f"{path}.state", max_len=4096),
            read_str(doc["status"], f"{path}.status", choices=set(STATUSES)),
            outputs=_read_names(doc.get("outputs", []), f"{path}.outputs"),
            live_outputs=_read_names(doc.get("live_outputs", []), f"{path}.live_outputs"),
            reason=None if reason is None else read_str(reason, f"{path}.reason"),
            **counts,
        )


@attrs.frozen
class CaptureExplanation:
    """The probe effects of one capture."""

    scope: str
    """The capture's variant table."""
    variant: int
    """The capture's variant number."""
    effects: tuple[ProbeEffect, ...]
    """One effect per probe of the capture's snapshot."""
    compared: int = 0
    """Live calls its check compared by value (``Fidelity.by_value``)."""
    calls: int = 0
    """Live calls the checked members ran (``Fidelity.calls``)."""
    not_retained: int = 0
    """Calls its level meant to compare by value that ``retain_bytes`` did not keep
    (``Fidelity.not_retained``): more than 0, the capture is not ok."""
    guarded: tuple[str, ...] = ()
    """The places beside its arguments and weights its program baked in
    (``Capture.baked``), which an installed model checks on every call."""
    changed: tuple[str, ...] = ()
    """The places its members' code reads that held something else on some
    of their calls (``read_state`` mismatches): the capture is not ok."""

    @property
    def by_value(self) -> str | None:
        """The value check's counts in words (``None``: nothing compared by
        value, nor meant to be)."""
        if not self.compared and not self.not_retained:
            return None
        text = (f"{self.compared} of {self.calls} call{'' if self.calls == 1 else 's'} "
                "compared by value")
        if self.not_retained:
            text += (f"; {self.not_retained} not kept (retain_bytes reached): not ok, "
                     "those calls were never compared")
        return text

    @property
    def changing(self) -> tuple[str, ...]:
        """Probes whose absence changed (or broke) the graph."""
        return tuple(e.probe for e in self.effects if e.status in ("changed", "failed"))

    def __getitem__(self, probe: str) -> ProbeEffect:
        for e in self.effects:
            if e.probe == probe:
                return e
        raise KeyError(f"no probe {probe!r} in this explanation; it has "
                       f"{[e.probe for e in self.effects]}")


@attrs.frozen
class Explanation:
    """Probe effects for every capture of a report; ``table()`` renders them."""

    captures: tuple[CaptureExplanation, ...]
    """One explanation per capture, in report order."""
    notices: tuple[Notice, ...] = ()
    """The report's notices (what was served and how), listed under the table."""

    def __getitem__(self, key: tuple[str, int]) -> CaptureExplanation:
        for c in self.captures:
            if (c.scope, c.variant) == key:
                return c
        raise KeyError(f"no capture {key!r}; explained: "
                       f"{[(c.scope, c.variant) for c in self.captures]}")

    def table(self, *, state_width: int = 32, width: int | None = None) -> str:
        """A compact table: capture, probe, its state, effect.  A capture's
        probes that changed nothing (``no effect`` and ``neutral``) share one
        row, so the probes that matter stand out; ``width`` wraps the effect
        column to fit that many characters (``None``: no wrapping)."""
        rows = [row for c in self.captures for row in _capture_rows(c, state_width)]
        head = ("capture", "probe", "state", "effect")
        widths = [max(len(r[i]) for r in [head, *rows]) for i in range(3)]
        lines = ["  ".join(h.ljust(w) for h, w in zip(head[:3], widths)) + "  " + head[3]]
        lines.append("-" * len(lines[0]))
        indent = sum(widths) + 2 * len(widths)
        for r in rows:
            prefix = "  ".join(v.ljust(w) for v, w in zip(r[:3], widths)) + "  "
            if width is None:
                lines.append(prefix + r[3])
                continue
            # the effect wraps under itself; never narrower than 30 characters
            lines += textwrap.wrap(r[3], width=max(indent + 30, width), initial_indent=prefix,
                                   subsequent_indent=" " * indent, break_on_hyphens=False,
                                   break_long_words=False)
        for n in self.notices:
            names = f": {'; '.join(n.names)}" if n.names else ""
            lines.append(f"notice {n.reason}: {n.message}{names}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def to_json(self) -> list[dict[str, Any]]:
        """Metadata only: one entry per capture, with its effects."""
        return [{"scope": c.scope, "variant": c.variant,
                 "effects": [e.to_json() for e in c.effects]} for c in self.captures]

    @classmethod
    def from_report_json(cls, data: object, path: str = "$") -> Explanation:
        """The explanations stored in a report document (``report.to_json()``
        after ``report.explain(model)``): each capture's ``explain`` key.
        Captures without one are left out."""
        doc = read_mapping(data, path)
        out = []
        for i, cap in enumerate(read_list(doc.get("captures", []), f"{path}.captures")):
            where = f"{path}.captures[{i}]"
            cap = read_mapping(cap, where)
            if cap.get("explain") is None:
                continue
            effects = tuple(ProbeEffect.from_json(e, f"{where}.explain[{j}]") for j, e in
                            enumerate(read_list(cap["explain"], f"{where}.explain")))
            out.append(CaptureExplanation(read_str(cap.get("scope"), f"{where}.scope",
                                                   max_len=4096),
                                          read_int(cap.get("variant"), f"{where}.variant", lo=0),
                                          effects, *_read_counts(cap.get("fidelity"),
                                                                 f"{where}.fidelity"),
                                          *_read_places(cap, where)))
        return cls(tuple(out))


def _read_counts(value: object, path: str) -> tuple[int, int, int]:
    """``(by_value, calls, not_retained)`` of a capture's fidelity document
    (0 for a count an older document lacks)."""
    if value is None:
        return 0, 0, 0
    doc = read_mapping(value, path)
    by_value, calls, lost = (read_int(doc.get(k, 0), f"{path}.{k}", lo=0)
                             for k in ("by_value", "calls", "not_retained"))
    return by_value, calls, lost


def _places(capture: Capture) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(guarded, changed)``: the places its program baked in, and those
    whose state changed between its members' calls."""
    baked = capture.baked
    guarded = () if baked is None else tuple(s.where() for s in baked.sources)
    changed = tuple(dict.fromkeys(m.path for m in capture.fidelity.mismatches
                                  if m.field == READ_FIELD))
    return guarded, changed


def _read_places(cap: Mapping[str, Any], where: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``_places`` of a capture's document (empty where an older one lacks them)."""
    baked = cap.get("baked")
    guarded = () if baked is None else tuple(
        s.where() for s in Baked.from_json(baked, f"{where}.baked").sources)
    fid = cap.get("fidelity")
    mismatches = [] if not isinstance(fid, Mapping) else \
        read_list(fid.get("mismatches", []), f"{where}.fidelity.mismatches")
    changed = tuple(dict.fromkeys(
        read_str(m.get("path"), f"{where}.fidelity.mismatches[{i}].path", max_len=4096)
        for i, m in enumerate(mismatches)
        if isinstance(m, Mapping) and m.get("field") == READ_FIELD))
    return guarded, changed


#: the statuses of probes that changed nothing in the graph
_QUIET = ("no effect", "neutral")


def _capture_rows(c: CaptureExplanation, state_width: int) -> list[tuple[str, str, str, str]]:
    """One row per probe that changed (or broke, or could not explain) the
    graph; one row for all that did not, when there are several."""
    label = f"{c.scope}#{c.variant}"
    quiet = [e for e in c.effects if e.status in _QUIET]
    shown = [e for e in c.effects if e.status not in _QUIET or len(quiet) == 1]
    rows = [(label, e.probe, _clip(e.state, state_width), e.describe()) for e in shown]
    if len(quiet) > 1:
        rows.append((label, f"{len(quiet)} others", "-", _quiet_effect(quiet, state_width)))
    if c.by_value is not None:
        rows.append((label, "by value", "-", c.by_value))
    if c.changed:
        rows.append((label, "read state", "-", f"changed between calls: {', '.join(c.changed)}"
                     " (the graph holds one value): not ok"))
    if c.guarded:
        rows.append((label, "baked in", "-", f"{', '.join(c.guarded)}: checked on every "
                     "installed call; one that differs runs eagerly (baked_state)"))
    return rows


def _quiet_effect(effects: Sequence[ProbeEffect], state_width: int) -> str:
    """``no effect: grad_mode (inference_mode); neutral state, nothing to
    replay: default_device, ...``"""
    parts = []
    same = [f"{e.probe} ({_clip(e.state, state_width)})" for e in effects
            if e.status == "no effect"]
    if same:
        parts.append("no effect: " + ", ".join(same))
    neutral = [e.probe for e in effects if e.status == "neutral"]
    if neutral:
        parts.append("neutral state, nothing to replay: " + ", ".join(neutral))
    return "; ".join(parts)


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[:width - 3] + "..."


def _read_names(value: object, path: str) -> tuple[str, ...]:
    return tuple(read_str(v, f"{path}[{i}]") for i, v in enumerate(read_list(value, path)))


def _dtypes(spec: Spec | None) -> tuple[str, ...]:
    if spec is None:
        return ()
    return tuple(str(s.dtype).removeprefix("torch.") for s in flatten_spec(spec)
                 if isinstance(s, TensorSpec))


def compare_args(faithful: Sequence[tuple[str, str | None]], faithful_args: Sequence[str],
                 other: Sequence[tuple[str, str | None]], other_args: Sequence[str]) -> int:
    """Nodes with the same op in both graphs whose non-tensor arguments
    (constants, dims, flags) differ, aligned as ``compare_ops`` aligns them."""
    if len(faithful_args) != len(faithful) or len(other_args) != len(other):
        return 0
    a = [op for op, _ in faithful]
    b = [op for op, _ in other]
    differ = 0
    matcher = difflib.SequenceMatcher(None, a, b, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            differ += sum(faithful_args[i] != other_args[j]
                          for i, j in zip(range(i1, i2), range(j1, j2)))
    return differ


def compare_ops(faithful: Sequence[tuple[str, str | None]],
                other: Sequence[tuple[str, str | None]]) -> tuple[int, int, int]:
    """``(retyped, added, removed)`` between two graphs' ``(op, dtype)`` lists,
    aligned by op name."""
    a = [op for op, _ in faithful]
    b = [op for op, _ in other]
    retyped = added = removed = 0
    matcher = difflib.SequenceMatcher(None, a, b, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            retyped += sum(faithful[i][1] != other[j][1]
                           for i, j in zip(range(i1, i2), range(j1, j2)))
        else:
            removed += i2 - i1
            added += j2 - j1
    return retyped, added, removed


def _module_for(model: nn.Module | Mapping[str, nn.Module],
                capture: Capture) -> nn.Module | None:
    names = (capture.weights_from, *capture.members) if capture.weights_from else capture.members
    for name in names or ("",):
        if isinstance(model, Mapping):
            found = model.get(name)
            if found is not None:
                return found
            continue
        try:
            return model.get_submodule(name) if name else model
        except AttributeError:
            continue
    return None


def _backend_for(capture: Capture, options: CaptureOptions, reuse: bool) -> Backend | None:
    if not reuse:
        return options.backend
    try:  # a registered name is rebuilt, built-in or not
        return get_backend(capture.backend)
    except UnknownBackendError:
        pass
    if capture.backend == options.backend.name:
        return options.backend
    return None


def _replayable(snapshot: ContextSnapshot) -> str | None:
    """Why ``snapshot`` cannot be replayed any more (``None``: it can)."""
    try:
        with snapshot.replay():
            pass
    except Exception:  # a user's probe may raise anything: replay_released
        return "replay_released"
    return None


def explain_capture(capture: Capture, module: nn.Module, options: CaptureOptions, *,
                    backend: Backend | None = None,
                    include_neutral: bool = False) -> CaptureExplanation:
    """Probe effects for one capture; ``module`` is the member it captured.
    ``include_neutral`` recaptures probes in their neutral state too (useful
    when the ambient state at explain time is not neutral)."""
    real = backend
    snap = capture.snapshot
    described = snap.describe()
    gone = _replayable(snap)
    effects = []
    live = _dtypes(capture.graph_outputs)
    for name, probe, state in zip(snap.names, snap.probes, snap.states):
        if not include_neutral and is_neutral(probe, state):
            effects.append(ProbeEffect(name, described[name], "neutral"))
            continue
        if gone is not None:
            effects.append(ProbeEffect(name, described[name], "unavailable", reason=gone))
            continue
        if real is None:
            effects.append(ProbeEffect(name, described[name], "failed",
                                       reason="backend_unavailable"))
            continue
        try:
            other = recapture(capture, module, attrs.evolve(options, backend=real),
                              snapshot=snap.without(name))
        except CaptureFailed as f:
            effects.append(ProbeEffect(name, described[name], "failed",
                                       reason=f.failure.reason))
            continue
        retyped, added, removed = compare_ops(capture.ops, other.ops)
        constants = compare_args(capture.ops, capture.op_args, other.ops, other.op_args)
        outs = _dtypes(other.graph_outputs)
        changed = retyped + added + removed + constants
        status = "changed" if changed or outs != live else "no effect"
        effects.append(ProbeEffect(name, described[name], status, changed, retyped, added,
                                   removed, outs if outs != live else (),
                                   live if outs != live else (), constants=constants))
    fid = capture.fidelity
    return CaptureExplanation(capture.scope, capture.variant, tuple(effects), fid.by_value,
                              fid.calls, fid.not_retained, *_places(capture))


def explain_captures(captures: Iterable[Capture],
                     model: nn.Module | Mapping[str, nn.Module], options: CaptureOptions, *,
                     include_neutral: bool = False, reuse_backend: bool = True) -> Explanation:
    """Probe effects for every capture; ``model`` is the module that was
    passed to ``capture_with`` (or member name -> module)."""
    out = []
    for c in captures:
        module = _module_for(model, c)
        if module is None:
            effects = tuple(ProbeEffect(n, d, "failed", reason="module_not_found")
                            for n, d in c.snapshot.describe().items())
            fid = c.fidelity
            out.append(CaptureExplanation(c.scope, c.variant, effects, fid.by_value,
                                          fid.calls, fid.not_retained, *_places(c)))
            continue
        out.append(explain_capture(c, module, options,
                                   backend=_backend_for(c, options, reuse_backend),
                                   include_neutral=include_neutral))
    return Explanation(tuple(out))
