"""The engine's records: options, per-variant requests, captures, failures
and the report-level problems and notices.

Records hold data and import no behaviour above them: a capture saves
itself through ``artifact`` (below), and the modules that make captures
(``capture``, ``session``) import this one, never the reverse.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import torch

from . import artifact as _artifact
from .artifact import SavedArtifact
from .backends import Backend
from .materialize import BINDINGS
from .probe import ContextProbe
from .signature import CallSpec, Spec
from .snapshot import ContextSnapshot
from .specjson import call_to_json, spec_to_json
from .verify import LEVELS, Fidelity

__all__ = ["NOTICES", "PROBLEMS", "REPLAY_MODES", "WATCH_MODES", "Capture", "CaptureFailure",
           "CaptureOptions", "MemberCall", "Notice", "Problem", "RetainedCall",
           "VariantRequest"]

REPLAY_MODES = ("embedded", "ambient", "off")
WATCH_MODES = ("forward", "call")

#: report-level reasons ``ok`` is False although no capture failed
PROBLEMS = {
    "no_captures": "the session saw calls but made no capture",
    "nothing_observed": "no call of a targeted module was observed",
    "variant_limit": "variants past max_variants were dropped, never captured",
    "scope_limit": "structures past max_scopes were never observed",
    "observation_error": "observing some calls failed, so they are not covered",
    "not_observed": "calls ran inside a compiled region, where blocks are not observed",
    "never_completed": "no call of a variant returned, so there is nothing to capture",
    "member_changed": "a block's attributes changed while observed, so its calls may "
                      "have run another graph",
    "stateful_member": "a block's forward writes Python state it keeps, so a later capture "
                       "may take another path than its calls did",
}


@attrs.frozen
class CaptureOptions:
    """Every setting of a session, validated once, read by capture, explain
    and the report (``to_json``: the report's ``settings``)."""

    probes: tuple[ContextProbe[Any], ...]
    backend: Backend
    targets: str = "None"
    replay: str = attrs.field(default="embedded", validator=attrs.validators.in_(REPLAY_MODES))
    verify: str = attrs.field(default="signature", validator=attrs.validators.in_(LEVELS))
    max_variants: int = 8
    max_scopes: int = 64
    profile_ranges: bool = False
    capture_timeout: float | None = None
    pin_factories: bool = True
    watch: str = attrs.field(default="forward", validator=attrs.validators.in_(WATCH_MODES))
    retain_bytes: int = 256 << 20
    ignore_attributes: tuple[str, ...] = ()
    #: a ``torch.distributed`` process group (``None``: the default group
    #: when one is initialised); ``finalize()`` is then a collective over it
    group: Any = attrs.field(default=None, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        for name in ("max_variants", "max_scopes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive integer, got {value!r}")
        if isinstance(self.retain_bytes, bool) or not isinstance(self.retain_bytes, int) \
                or self.retain_bytes < 0:
            raise ValueError(f"retain_bytes: expected a byte count >= 0, got "
                             f"{self.retain_bytes!r}")
        t = self.capture_timeout
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float))
                              or not t > 0):
            raise ValueError(f"capture_timeout: expected seconds > 0, got {t!r}")

    @property
    def probe_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.probes)

    def to_json(self) -> dict[str, Any]:
        return {"replay": self.replay, "verify": self.verify, "max_variants": self.max_variants,
                "max_scopes": self.max_scopes, "targets": self.targets,
                "backend": self.backend.name, "pin_factories": self.pin_factories,
                "watch": self.watch, "retain_bytes": self.retain_bytes,
                "capture_timeout": self.capture_timeout,
                "ignore_attributes": list(self.ignore_attributes)}


@attrs.frozen(eq=False)
class RetainedCall:
    """CPU copies of one live call (``verify="values"``): the input tensors in
    ``CallSpec.leaves()`` order, the output tensors in output order."""

    inputs: tuple[torch.Tensor, ...] = attrs.field(repr=False)
    outputs: tuple[torch.Tensor, ...] = attrs.field(repr=False)
    nbytes: int = 0


@attrs.frozen(eq=False)
class MemberCall:
    """One member's share of a variant: its calls and its first live output."""

    name: str
    calls: int
    outputs: Spec | None
    completed: bool
    retained: RetainedCall | None = attrs.field(default=None, repr=False)


@attrs.frozen(eq=False)
class VariantRequest:
    """One variant to capture: the first completed member is traced (its
    weights are the artifact's); every member's calls are verified."""

    scope: str
    variant: int
    snapshot: ContextSnapshot
    inputs: CallSpec
    members: tuple[MemberCall, ...]
    #: ``(submodule path, training)`` the members had when the variant ran:
    #: capture and checks put every view in that mode, whatever the model is
    #: in by finalize()
    training: tuple[tuple[str, bool], ...] = ()
    #: ``targets.identity_digest`` of the members' identity when it ran
    identity: str = ""

    @property
    def traced(self) -> MemberCall:
        for m in self.members:
            if m.completed:
                return m
        return self.members[0]

    @property
    def outputs(self) -> Spec | None:
        return self.traced.outputs

    @property
    def calls(self) -> int:
        return sum(m.calls for m in self.members)

    def with_snapshot(self, snapshot: ContextSnapshot) -> VariantRequest:
        return attrs.evolve(self, snapshot=snapshot)


@attrs.frozen(eq=False)
class Capture:
    """One captured variant and the live calls it stands for.

    ``members`` are the blocks that ran it (``member_calls`` their call
    counts); ``weights_from`` is the member whose parameters the artifact holds
    -- run it for another member with that member's weights (see
    ``ctxreplay.install``).  ``embedded`` probes are carried by the
    artifact itself; ``ambient_only`` ones must be re-established around it
    wherever it runs."""

    scope: str
    members: tuple[str, ...]
    variant: int
    signature: CallSpec
    outputs: Spec | None
    graph_outputs: Spec | None
    snapshot: ContextSnapshot
    calls: int
    backend: str
    artifact: Any = attrs.field(repr=False)
    fidelity: Fidelity
    fingerprint: str
    embedded: tuple[str, ...]
    ambient_only: tuple[str, ...]
    binding: str = attrs.field(validator=attrs.validators.in_(BINDINGS))
    constants: tuple[str, ...]
    attempts: tuple[tuple[str, str, str], ...]
    seconds: float
    ops: tuple[tuple[str, str | None], ...] = attrs.field(repr=False, default=())
    member_calls: tuple[tuple[str, int], ...] = ()
    weights_from: str = ""
    #: variants of other member identities whose graphs turned out identical
    #: to this one's, merged into this record (their members are listed here)
    merged: tuple[int, ...] = ()
    #: in a distributed finalize: the rank that captured it (holds the artifact)
    rank: int | None = None
    #: ranks that observed it, and each one's calls
    observed_on: tuple[int, ...] = ()
    rank_calls: tuple[tuple[int, int], ...] = ()
    #: its graph holds collectives: executing it waits for the other ranks
    collective: bool = False
    #: a digest of the graph's code (nested graphs and constants included):
    #: equal digests, equal computation for the same inputs and weights
    graph_digest: str = ""
    #: per op of ``ops``, a digest of its non-tensor arguments
    op_args: tuple[str, ...] = attrs.field(repr=False, default=())
    #: ``(member, digest)``: each member's identity (class, shapes, training,
    #: plain attributes; ``targets.identity_digest``) when it ran the variant,
    #: and the attributes left out of it: what ``install`` holds a member to
    identities: tuple[tuple[str, str], ...] = ()
    ignore_attributes: tuple[str, ...] = ()

    def save(self, path: str | Path, *, verify: bool = True) -> SavedArtifact:
        """Write the artifact as a ``.pt2`` that ``torch.export.load`` reads back,
        and a metadata-only sidecar ``<path>.json`` (snapshot and signatures;
        read it with :func:`ctxreplay.load_sidecar`).

        Only ``torch.export`` artifacts can be saved; any other raises
        :class:`ctxreplay.ArtifactError` naming its backend.  Context wrappers
        the serialiser rejects are lowered to explicit casts first.
        ``verify`` loads the file back, runs it on fresh inputs from a
        neutral state and compares with the live call: the result is the
        returned ``SavedArtifact.fidelity`` (also stored in the sidecar).
        """
        # looked up on the module, so a wrapper installed there (an audit) applies
        return _artifact.save_capture(self, path, verify=verify)

    def to_json(self) -> dict[str, Any]:
        """Metadata only."""
        return {
            "scope": self.scope,
            "members": list(self.members),
            "member_calls": [list(m) for m in self.member_calls],
            "weights_from": self.weights_from,
            "variant": self.variant,
            "merged": list(self.merged),
            "calls": self.calls,
            "rank": self.rank,
            "observed_on": list(self.observed_on),
            "rank_calls": [list(r) for r in self.rank_calls],
            "collective": self.collective,
            "graph_digest": self.graph_digest,
            "identities": [list(i) for i in self.identities],
            "ignore_attributes": list(self.ignore_attributes),
            "backend": self.backend,
            "binding": self.binding,
            "constants": list(self.constants),
            "embedded": list(self.embedded),
            "ambient_only": list(self.ambient_only),
            "attempts": [list(a) for a in self.attempts],
            "fingerprint": self.fingerprint,
            "seconds": round(self.seconds, 6),
            "inputs": call_to_json(self.signature),
            "outputs": None if self.outputs is None else spec_to_json(self.outputs),
            "graph_outputs": None if self.graph_outputs is None
            else spec_to_json(self.graph_outputs),
            "snapshot": self.snapshot.to_json(),
            "context": self.snapshot.describe(),
            "fidelity": self.fidelity.to_json(),
            "graph": {"nodes": len(self.ops), "ops": sorted({op for op, _ in self.ops})},
        }


@attrs.frozen
class CaptureFailure:
    """A variant that could not be captured: a reason code, the exception
    type and the first line of its message (at most 200 characters, with
    anything that looks like a tensor's repr cut; kept on the record and in
    ``FidelityError``'s text, never in JSON).

    Reasons: a backend's code (``trace_error``, ``unsupported_graph``,
    ``data_dependent_control_flow``, ``dynamic_python_control_flow``,
    ``data_dependent_output_shape``, or a custom backend's
    ``BackendError.reason``); ``replay_failed`` (a probe's replay raised
    entering, inside the trace or restoring); ``replay_released`` (a live
    probe state was released by ``finalize()`` before this recapture);
    ``timeout`` (``capture_timeout`` passed; the capture thread is
    abandoned); ``no_artifact`` / ``bad_artifact`` (the backend returned
    ``None``, or something its own accessors fail on);
    ``materialize_failed``, ``verify_failed``, ``module_released``,
    ``isolation_failed``, ``internal_error``; ``interrupted`` (a Ctrl-C
    stopped ``finalize()`` before this variant; those captured before it are
    kept).  And ``state_leak``: the
    variant captured, but afterwards the ambient state differed from the
    state ``finalize()`` began with -- the engine put it back; ``context``
    names each probe as ``"was -> left"`` (and ``torch_global_state`` what
    only torch's guard saw, not put back).
    """

    scope: str
    variant: int
    backend: str
    reason: str
    exc_type: str
    attempts: tuple[tuple[str, str, str], ...] = ()
    context: dict[str, str] = attrs.field(factory=dict)
    message: str = ""

    def to_json(self) -> dict[str, Any]:
        """Metadata only: ``message`` stays out (an exception's text can quote
        the user's data); it is in ``FidelityError``'s text and on the record."""
        return {"scope": self.scope, "variant": self.variant, "backend": self.backend,
                "reason": self.reason, "exc_type": self.exc_type,
                "attempts": [list(a) for a in self.attempts], "context": dict(self.context)}


@attrs.frozen
class Problem:
    """A reason the report is not ok although no capture failed: calls that
    no faithful capture covers.  ``reason`` is a key of ``PROBLEMS``;
    ``variants`` and ``calls`` count exactly what is not covered; ``names``
    lists what it concerns (members, compiled regions, attributes, probes).
    Its JSON is structured (names and counts); ``message`` says it in words."""

    reason: str = attrs.field(validator=attrs.validators.in_(PROBLEMS))
    scope: str | None = None
    variants: int = 0
    calls: int = 0
    names: tuple[str, ...] = ()
    #: for ``variant_limit`` / ``scope_limit``: the limit that was hit
    limit: int | None = None
    #: ``False``: ``variants`` is a lower bound (bookkeeping stays bounded)
    exact: bool = True
    #: in a distributed finalize: the rank it was seen on
    rank: int | None = None

    @property
    def message(self) -> str:
        return str(_PROBLEM_TEXT[self.reason](self))

    def to_json(self) -> dict[str, Any]:
        return {"reason": self.reason, "scope": self.scope, "variants": self.variants,
                "calls": self.calls, "names": list(self.names), "limit": self.limit,
                "exact": self.exact, "rank": self.rank}


def _n(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _names(p: Problem | Notice) -> str:
    shown = ", ".join(p.names[:5]) + (", ..." if len(p.names) > 5 else "")
    return shown or "-"


_PROBLEM_TEXT: dict[str, Any] = {
    "no_captures": lambda p: f"{_n(p.variants, 'variant')} observed and none captured "
                             "(see the failures)",
    "nothing_observed": lambda p: "no call of a targeted module was observed while the "
                                  "session was open",
    "variant_limit": lambda p: f"{p.scope}: {'' if p.exact else 'at least '}"
                               f"{_n(p.variants, 'variant')} "
                               f"({_n(p.calls, 'call')}) past max_variants={p.limit} were "
                               "never captured; raise max_variants or give a probe a "
                               "coarser key",
    "scope_limit": lambda p: f"{_n(p.variants, 'structure')} ({_names(p)}) past "
                             f"max_scopes={p.limit} were never observed",
    "observation_error": lambda p: f"{_n(p.calls, 'observation')} failed ({_names(p)}); "
                                   "those calls are not covered",
    "not_observed": lambda p: (f"{_n(p.calls, 'call')} ran inside compiled region(s) "
                               f"({_names(p)})" if p.exact else
                               f"{_names(p)} ran inside a region compiled after capture_with "
                               "(how often is not countable)")
                              + ": the blocks inside were not observed; pass the uncompiled "
                                "module to capture_with and compile afterwards",
    "never_completed": lambda p: f"{p.scope}: no call of {_n(p.variants, 'variant')} "
                                 f"returned ({_n(p.calls, 'call')} raised), so there is "
                                 "nothing to capture",
    "stateful_member": lambda p: f"{p.scope}: member {p.names[0] if p.names else '?'} writes "
                                 f"state it holds ({', '.join(p.names[1:]) or '?'}) in its "
                                 "forward; a capture made afterwards sees that state as "
                                 "finalize() finds it, not as each call did. List the "
                                 "attributes in ignore_attributes if the graph does not "
                                 "depend on them",
    "member_changed": lambda p: f"{p.scope}: member {p.names[0] if p.names else '?'} changed "
                                f"({p.names[1] if len(p.names) > 1 else '?'}) while observed; "
                                "later calls may have run another graph than the one "
                                "recorded. Set it before capture_with, or list the attribute "
                                "in ignore_attributes if the graph does not depend on it",
}

#: notice reasons, in words
NOTICES = {
    "probe_too_fine": "captures with identical graphs differ only in this probe's state: "
                      "its key separates calls that run the same graph (give the probe a "
                      "coarser key, e.g. ForwardContextProbe(..., key=...))",
    "probe_varies_every_call": "this probe had a different state in every variant (a step "
                               "counter or a timestep in its key?)",
}


@attrs.frozen
class Notice:
    """Something suspicious though not wrong (``ok`` is unaffected), e.g. a
    probe whose key is finer than the graphs it separates."""

    reason: str = attrs.field(validator=attrs.validators.in_(NOTICES))
    scope: str | None = None
    probe: str | None = None
    count: int = 0
    names: tuple[str, ...] = ()

    @property
    def message(self) -> str:
        where = ", ".join(x for x in (self.scope, self.probe and f"probe {self.probe!r}") if x)
        return (f"{where}: " if where else "") + NOTICES[self.reason] + \
            (f" ({self.count}x)" if self.count else "")

    def to_json(self) -> dict[str, Any]:
        return {"reason": self.reason, "scope": self.scope, "probe": self.probe,
                "count": self.count, "names": list(self.names)}
