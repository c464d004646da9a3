"""The engine's results: captures, failures and the report-level problems
and notices (what capture is asked to do is in ``capture.options``).

Records hold data and import no behaviour above them: a capture saves
itself through ``artifacts.saving`` (a layer below), and the modules that
make captures (``capture.variant``, ``capture.merge``, the engine) import
this one, never the reverse.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from ..artifacts import saving as _artifact
from ..artifacts.program import ProgramFields, ProgramMeta
from ..artifacts.saving import SavedArtifact
from ..backends.base import BACKEND_REASONS
from ..core.probe import CONTRACT_RULES
from ..core.snapshots import ContextSnapshot
from ..fidelity.verify import Fidelity
from ..specs.dims import Folding
from ..specs.signature import CallSpec, Spec
from ..specs.specjson import call_to_json, spec_to_json
from .assigned import Assigned
from .details import CacheDetails, DistributedDetails, FoldDetails
from .options import VariantRequest

__all__ = ["FAILURE_REASONS", "NOTICES", "PROBLEMS", "Capture", "CaptureFailure", "Deferred",
           "Notice", "Problem", "capture_of", "make_capture"]

#: every ``CaptureFailure.reason`` the package gives: a built-in backend's
#: codes, then the engine's own (a custom backend may add its
#: ``BackendError.reason``)
FAILURE_REASONS = (*BACKEND_REASONS, "replay_failed", "timeout", "no_artifact", "bad_artifact",
                   "materialize_failed", "verify_failed", "module_released",
                   "isolation_failed", "internal_error", "interrupted", "state_leak",
                   "unsupported_layout", "state_not_restorable", "hooked_weights")

#: report-level reasons ``ok`` is False although no capture failed
PROBLEMS = {
    "no_captures": "the session saw calls but made no capture",
    "nothing_observed": "no call of a targeted module was observed",
    "variant_limit": "variants past max_variants were dropped, never captured",
    "scope_limit": "structures past max_scopes were never observed",
    "observation_error": "observing some calls failed, so they are not covered",
    "not_observed": "calls ran inside a compiled region, where blocks are not observed",
    "control_flow": "blocks ran inside a branch of torch.cond (or another control-flow "
                    "operator), which torch traces into a graph, where blocks are not observed",
    "transformed": "calls ran under a torch.func transform (vmap, grad), whose tensors "
                   "observation cannot key or copy",
    "never_completed": "no call of a variant had returned by finalize(), so there is "
                       "nothing to capture",
    "observation_lost": "another tool set a block's forward anew while observed, so calls "
                        "observed before ran a forward capture no longer sees",
    "member_changed": "a block's attributes changed in place (no assignment) while "
                      "observed, so its calls may have run another graph",
    "stateful_member": "a block's forward writes Python state it keeps, so a later capture "
                       "may take another path than its calls did",
}


class Deferred:
    """A program not loaded yet: ``load()`` returns it (the capture cache's
    entries are these until first used)."""

    def load(self) -> Any:
        raise NotImplementedError


@attrs.frozen(eq=False)
class Capture(ProgramFields):
    """One captured variant and the live calls it stands for.

    ``members`` are the blocks that ran it (``member_calls`` their call
    counts); ``weights_from`` is the member whose parameters the artifact holds
    -- run it for another member with that member's weights (see
    ``ctxreplay.install``).  ``embedded`` probes are carried by the
    artifact itself; ``ambient_only`` ones must be re-established around it
    wherever it runs.

    The record is a core and four parts: ``meta``, what every document of
    the capture records of its program (backend, binding, fingerprint, ops,
    ...); ``distributed``, ``caching`` and ``fold``, the details only some
    captures have.  Each of their fields also reads under its own name
    (``capture.backend``, ``capture.rank``); ``evolve`` changes any of them
    by that name."""

    # (Each field's docstring is the string after it: the API page shows it.)
    scope: str
    """The variant table it belongs to: the first member's qualified name
    (``"blocks.0"``), or the module's class name for a whole-module capture."""
    members: tuple[str, ...]
    """Qualified names of the blocks that ran this variant."""
    variant: int
    """Its number within ``scope`` (``scope#variant`` labels it)."""
    signature: CallSpec
    """The input signature it was captured for: shape, stride, dtype, device
    and ``requires_grad`` of every tensor argument, Python scalars by value."""
    outputs: Spec | None
    """The specs of what the live call returned (``None``: not known)."""
    snapshot: ContextSnapshot
    """The ambient state the variant ran under, one state per probe."""
    calls: int
    """Live calls this capture stands for, over all its members."""
    meta: ProgramMeta
    """What every document of this capture (report, manifest, sidecar, the
    capture cache's record) records of its program, written and read by one
    codec (:class:`ctxreplay.artifacts.ProgramMeta`)."""
    _artifact: Any = attrs.field(repr=False, alias="artifact")
    # the field behind ``artifact``: a capture the capture cache answered
    # holds a ``Deferred`` here until its program is first used
    fidelity: Fidelity
    """How it was checked against the live calls, and what disagreed."""
    attempts: tuple[tuple[str, str, str], ...]
    """``(backend, reason code, exception type)`` of each backend that failed
    before the one that succeeded (``backend="auto"``)."""
    seconds: float
    """Wall time of this capture, check included."""
    member_calls: tuple[tuple[str, int], ...] = ()
    """``(member, calls)``: each member's share of ``calls``."""
    weights_from: str = ""
    """The member whose parameters and buffers the artifact holds; run it for
    another member with that member's weights."""
    merged: tuple[int, ...] = ()
    """Variants of other member identities whose graphs turned out identical
    to this one's, merged into this record (their members are listed here)."""
    identities: tuple[tuple[str, str], ...] = ()
    """``(member, digest)``: each member's identity (class, shapes,
    ``training``, plain attributes) when it ran the variant -- what
    ``install`` holds a member to."""
    ignore_attributes: tuple[str, ...] = ()
    """Attributes left out of the members' identities (``capture_with(...,
    ignore_attributes=...)``)."""
    assigned: Assigned | None = None
    """What its forward assigns to its argument objects (a ``DynamicCache``
    layer's new ``keys``), which the program returns after its outputs and
    ``install`` writes to the live call's objects; ``None``: nothing."""
    distributed: DistributedDetails = attrs.field(factory=DistributedDetails)
    """Its ranks in a distributed finalize (``rank``, ``observed_on``,
    ``rank_calls``, ``collective``, ``shared``); empty in a single process."""
    caching: CacheDetails = attrs.field(factory=CacheDetails)
    """What the capture cache did with it (``from_cache``, ``not_cached``)."""
    fold: FoldDetails = attrs.field(factory=FoldDetails)
    """The size variants its graph was folded over (``folding``, ``folded``)."""

    # -- the details some captures have, by name ------------------------------------

    @property
    def rank(self) -> int | None:
        """In a distributed finalize: the rank that captured it (and holds the
        artifact); ``None`` in a single process."""
        return self.distributed.rank

    @property
    def observed_on(self) -> tuple[int, ...]:
        """In a distributed finalize: the ranks that observed it."""
        return self.distributed.observed_on

    @property
    def rank_calls(self) -> tuple[tuple[int, int], ...]:
        """In a distributed finalize: ``(rank, calls)`` for each observing rank."""
        return self.distributed.rank_calls

    @property
    def collective(self) -> bool:
        """Its graph holds collectives: executing it waits for the other ranks."""
        return self.distributed.collective

    @property
    def shared(self) -> tuple[str, bytes] | None:
        """On a rank that did not capture it (``artifact`` is ``None``): its
        program's graph without weights, as the capturing rank sent it --
        what ``install`` rebuilds with each member's own weights; ``None``
        where the program could not be sent (not a ``torch.export``
        program) or this rank holds the artifact itself."""
        return self.distributed.shared

    @property
    def from_cache(self) -> bool:
        """It came from the capture cache (``capture_with(..., cache=...)``):
        loaded instead of traced, and checked at the session's verify level."""
        return self.caching.from_cache

    @property
    def not_cached(self) -> str:
        """Why the capture cache could not keep it, a code of
        ``cache.use.NOT_STORED_REASONS`` (its program could not be serialised:
        ``not_serialisable``), warned once as a ``CacheWarning``; ``""``: kept,
        or no cache."""
        return self.caching.not_cached

    @property
    def folding(self) -> Folding | None:
        """For a graph traced with dynamic sizes (size variants folded into one
        capture): its dynamic dimensions, the rule each follows and the range
        every symbol was verified over; ``None`` for a graph of fixed sizes."""
        return self.fold.folding

    @property
    def folded(self) -> tuple[int, ...]:
        """Variants of the same member identity and context that differ from
        this one in sizes only, folded into this capture (verified by value at
        each of their sizes)."""
        return self.fold.folded

    # -- derived ---------------------------------------------------------------------

    @property
    def artifact(self) -> Any:
        """The captured program: a ``torch.export.ExportedProgram`` for the
        export backend, a ``GraphModule`` for the others; ``None`` on a rank
        that did not capture it.  A capture from the cache loads it here, the
        first time it is asked for."""
        held = self._artifact
        if isinstance(held, Deferred):
            held = held.load()
            object.__setattr__(self, "_artifact", held)
        return held

    @property
    def artifact_loaded(self) -> bool:
        """Whether the program is in memory (a cached capture's is loaded on
        first use of ``artifact``)."""
        return not isinstance(self._artifact, Deferred)

    @property
    def checked(self) -> int:
        """Live calls checked by value, of ``calls`` (``verify="values"``: the
        retained calls of every member -- first, last and a sample between --
        each run through the artifact with that member's weights; 0 at the
        other levels)."""
        return self.fidelity.by_value

    @property
    def verdict(self) -> str:
        """The fidelity in words, with what was checked: e.g. ``"ok
        (signature+execute+values; 5 of 8 calls checked by value)"``; a
        folded capture adds the sizes it was run at, e.g. ``"; folded: 6
        sizes, each run, args[0][1] = s0 (s0 in [5, 20])"``."""
        words = self.fidelity.verdict(self.calls)
        if self.folding is None:
            return words
        return (f"{words}; folded: {self.folding.sizes} sizes, each run, "
                + "; ".join(self.folding.describe()))

    def evolve(self, **changes: Any) -> Capture:
        """A copy with ``changes``, each given by its name on the record --
        a field of the core (``calls=3``) or of a part (``rank=0``,
        ``folding=...``, ``not_cached="collective"``), which goes into that
        part.  An unknown name raises ``TypeError`` listing the names."""
        return attrs.evolve(self, **_routed(changes, self))

    def save(self, path: str | Path, *, verify: bool = True) -> SavedArtifact:
        """Write the artifact in its artifact format, and a metadata-only
        sidecar ``<path>.json`` (snapshot, signatures and the format's name;
        read it with :func:`ctxreplay.load_sidecar`).

        The format is the registered one whose suffix ends ``path``'s name,
        else the first that can hold the artifact: the built-in ``.pt2``
        (``torch.export.save``, read back by ``torch.export.load``) holds a
        ``torch.export`` program, and ``ctxreplay.artifacts.register_format``
        adds others.  An artifact no format holds raises
        :class:`ctxreplay.ArtifactError` naming its backend.  Context wrappers
        the ``.pt2`` serialiser rejects are lowered to explicit casts first.
        ``verify`` loads the file back and checks it: a file holding the very
        program this capture's own check stands behind is compared with it
        graph to graph and by its weights (vouched for as far as
        ``fidelity.checked`` goes, no further); any other runs on fresh inputs
        from a neutral state and is compared with the live call.  The result
        is the returned ``SavedArtifact.fidelity`` (also stored in the
        sidecar).

        Args:
            path: where to write the artifact (``x.pt2``); the sidecar goes beside it.
            verify: load the file back and check it against the live call.

        Raises:
            ArtifactError: ``backend_not_savable`` or ``serialize_failed``.
        """
        # looked up on the module, so a wrapper installed there (an audit) applies
        return _artifact.save_capture(self, path, verify=verify)

    def to_json(self) -> dict[str, Any]:
        """Metadata only: the program's fields as ``meta``'s codec writes them,
        its op list summarised under ``graph``."""
        program = self.meta.to_json()
        return {
            "scope": self.scope,
            "members": list(self.members),
            "member_calls": [list(m) for m in self.member_calls],
            "weights_from": self.weights_from,
            "variant": self.variant,
            "merged": list(self.merged),
            "folded": list(self.folded),
            "dynamic": None if self.folding is None else self.folding.to_json(),
            "calls": self.calls,
            "checked": self.checked,
            "rank": self.rank,
            "observed_on": list(self.observed_on),
            "rank_calls": [list(r) for r in self.rank_calls],
            "collective": self.collective,
            "graph_digest": program["graph_digest"],
            "identities": [list(i) for i in self.identities],
            "ignore_attributes": list(self.ignore_attributes),
            "backend": program["backend"],
            "binding": program["binding"],
            "constants": program["constants"],
            "embedded": program["embedded"],
            "ambient_only": program["ambient_only"],
            "attempts": [list(a) for a in self.attempts],
            "fingerprint": program["fingerprint"],
            "seconds": round(self.seconds, 6),
            "from_cache": self.from_cache,
            "assigned": None if self.assigned is None else self.assigned.to_json(),
            "inputs": call_to_json(self.signature),
            "outputs": None if self.outputs is None else spec_to_json(self.outputs),
            "graph_outputs": program["graph_outputs"],
            "output_roles": program["output_roles"],
            "baked": program["baked"],
            "snapshot": self.snapshot.to_json(),
            "context": self.snapshot.describe(),
            "fidelity": self.fidelity.to_json(),
            "graph": {"nodes": len(self.ops), "ops": sorted({op for op, _ in self.ops})},
        }


def capture_of(request: VariantRequest, ignore_attributes: tuple[str, ...],
               **graph: Any) -> Capture:
    """The ``Capture`` of ``request``'s variant: what the request says of it
    (scope, members and their calls, signature, live outputs, context, the
    member whose weights the artifact holds, the members' identity digest
    where known) beside what its graph says (``graph``: backend, artifact,
    check, binding, summary...), however the graph was made -- traced, or
    read from the capture cache.  ``graph`` gives each field by its name on
    the record (``backend=...``, ``from_cache=True``), or a part whole
    (``meta=...``)."""
    return make_capture(
        scope=request.scope, members=tuple(m.name for m in request.members),
        variant=request.variant, signature=request.inputs, outputs=request.outputs,
        snapshot=request.snapshot, calls=request.calls,
        member_calls=tuple((m.name, m.calls) for m in request.members),
        weights_from=request.traced.name,
        identities=tuple((m.name, request.identity) for m in request.members
                         if request.identity),
        ignore_attributes=ignore_attributes, **graph)


def make_capture(**fields: Any) -> Capture:
    """A ``Capture`` of ``fields``, each given by its name on the record: a
    field of the core, or of a part (``backend``, ``rank``, ``folding``...),
    which goes into that part (a part given whole is kept as given)."""
    return Capture(**_routed(fields, None))


#: the parts of a Capture, by attribute: their fields read under their own names
_PARTS: dict[str, type] = {"meta": ProgramMeta, "distributed": DistributedDetails,
                           "caching": CacheDetails, "fold": FoldDetails}
_PART_OF = {f.name: part for part, cls in _PARTS.items() for f in attrs.fields(cls)}
_CORE = {f.alias or f.name for f in attrs.fields(Capture)}


def _routed(fields: Mapping[str, Any], base: Capture | None) -> dict[str, Any]:
    """``fields`` as ``Capture`` takes them: each part's fields gathered into
    that part (``base``'s part with them changed, or a new one).  Raises
    ``TypeError`` naming an unknown field, or a part given both whole and by
    its fields."""
    out: dict[str, Any] = {}
    parts: dict[str, dict[str, Any]] = {}
    for name, value in fields.items():
        part = _PART_OF.get(name)
        if part is not None:
            parts.setdefault(part, {})[name] = value
        elif name in _CORE:
            out[name] = value
        else:
            raise TypeError(f"Capture: no field {name!r}; the fields are "
                            f"{sorted(_CORE | set(_PART_OF))}")
    for part, given in parts.items():
        if part in out:
            raise TypeError(f"Capture: {part!r} given whole and by its fields "
                            f"{sorted(given)}; give one")
        out[part] = _PARTS[part](**given) if base is None \
            else attrs.evolve(getattr(base, part), **given)
    return out


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
    entering, inside the trace or restoring); ``timeout``
    (``capture_timeout`` passed; the capture thread is abandoned);
    ``no_artifact`` / ``bad_artifact`` (the backend returned ``None``, or
    something its own accessors fail on);
    ``materialize_failed``, ``verify_failed``, ``module_released``,
    ``isolation_failed``, ``internal_error``; ``interrupted`` (a Ctrl-C
    stopped ``finalize()`` before this variant; those captured before it are
    kept); ``unsupported_layout`` (an input is a sparse or nested tensor:
    ``context`` names each such input's path and layout);
    ``state_not_restorable`` (an attribute of the member changed after the
    variant ran and its value then could not be recorded, so the capture
    cannot run in the state the calls ran in; ``context["attribute"]``
    names it).  And ``state_leak``: the
    variant captured, but afterwards the ambient state differed from the
    state ``finalize()`` began with -- the engine put it back; ``context``
    names each probe as ``"was -> left"`` (and ``torch_global_state`` what
    only torch's guard saw, not put back).  ``FAILURE_REASONS`` lists them
    all; the Troubleshooting page says what to do about each.
    """

    scope: str
    """The variant table of the variant that failed."""
    variant: int
    """The variant's number within ``scope``."""
    backend: str
    """The backend that was asked (``"auto"`` when it tried several)."""
    reason: str
    """A reason code: one of ``FAILURE_REASONS``, or a custom backend's."""
    exc_type: str
    """The type name of the exception behind it (``"-"`` when none)."""
    attempts: tuple[tuple[str, str, str], ...] = ()
    """``(backend, reason code, exception type)`` of each backend tried."""
    context: dict[str, str] = attrs.field(factory=dict)
    """Details by name, in words: for ``state_leak`` each probe that leaked
    as ``"was -> left"``; for ``replay_failed`` of a mode, its types."""
    message: str = ""
    """The first line of the exception's message (capped, tensor reprs cut);
    on the record only, never in JSON."""

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
    """A key of ``PROBLEMS``."""
    scope: str | None = None
    """The variant table it concerns (``None``: the whole session)."""
    variants: int = 0
    """Variants not covered."""
    calls: int = 0
    """Calls not covered."""
    names: tuple[str, ...] = ()
    """What it concerns: members, compiled regions, attributes or probes."""
    limit: int | None = None
    """For ``variant_limit`` / ``scope_limit``: the limit that was hit."""
    exact: bool = True
    """``False``: the counts are lower bounds (bookkeeping stays bounded, and
    calls of a block compiled after ``capture_with`` are not countable)."""
    rank: int | None = None
    """In a distributed finalize: the rank it was seen on."""

    @property
    def message(self) -> str:
        """The problem in words, with what to do."""
        return str(_PROBLEM_TEXT[self.reason](self))

    def to_json(self) -> dict[str, Any]:
        """Metadata only."""
        return {"reason": self.reason, "scope": self.scope, "variants": self.variants,
                "calls": self.calls, "names": list(self.names), "limit": self.limit,
                "exact": self.exact, "rank": self.rank}


def _broken_rules(p: Problem) -> str:
    """The probe contract's rules that ``p``'s names show broken
    (``observe:unhashable_state(list)``), in words."""
    rules = [rule for code, rule in CONTRACT_RULES.items()
             if any(f":{code}(" in name for name in p.names)]
    return "".join(f"; a probe broke a rule: {rule}" for rule in rules)


def _n(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _names(p: Problem | Notice) -> str:
    shown = ", ".join(p.names[:5]) + (", ..." if len(p.names) > 5 else "")
    return shown or "-"


def _limit_text(p: Problem) -> str:
    """``variant_limit`` in words, from its names: ``fold:on`` or
    ``fold:off:<why>``, ``dropped:<graphs|sizes>:<calls>``, ``dim:<path>``."""
    fold = next((n[5:] for n in p.names if n.startswith("fold:")), "")
    dims = [n[4:] for n in p.names if n.startswith("dim:")]
    sizes = any(n.startswith("dropped:sizes:") for n in p.names)
    text = (f"{p.scope}: {'' if p.exact else 'at least '}{_n(p.variants, 'variant')} "
            f"({_n(p.calls, 'call')}) past max_variants={p.limit} were never captured")
    if fold == "on":
        text += ("; variants that differ in tensor sizes only count once (they fold into "
                 "one graph), so these differ in context, dtypes, structure or constants")
        if sizes:
            text += "; some were sizes past the limit of one graph's"
    elif fold:
        text += f"; each size counts apart because folding is off ({fold.removeprefix('off:')})"
    if dims:
        text += f"; sizes varied in {', '.join(dims)}"
    return text + "; raise max_variants or give a probe a coarser key"


_PROBLEM_TEXT: dict[str, Any] = {
    "no_captures": lambda p: f"{_n(p.variants, 'variant')} observed and none captured "
                             "(see the failures)",
    "nothing_observed": lambda p: "no call of a targeted module was observed while the "
                                  "session was open",
    "variant_limit": lambda p: _limit_text(p),
    "scope_limit": lambda p: f"{_n(p.variants, 'structure')} ({_names(p)}) past "
                             f"max_scopes={p.limit} were never observed",
    "observation_error": lambda p: f"{_n(p.calls, 'observation')} failed ({_names(p)}); "
                                   "those calls are not covered" + _broken_rules(p),
    "not_observed": lambda p: (f"{_names(p)} ran inside a region compiled after capture_with "
                               "(how often is not countable): the blocks inside were not "
                               "observed. Compile before capture_with and pass the compiled "
                               "module itself -- capture_with(torch.compile(model)), or "
                               "model.compile() first -- which runs uncompiled while observed; "
                               "or compile after finalize()"),
    "control_flow": lambda p: (f"{', '.join(p.names[1:])} ran inside a {p.names[0]} branch "
                               "(how often is not countable): torch traces a branch into a "
                               "graph, so the blocks inside were not observed nor captured. "
                               "Profile a forward that calls them outside it (a Python if on "
                               "the condition's value); installed, a block inside a branch "
                               "runs its own forward"),
    "transformed": lambda p: f"{_n(p.calls, 'call')} of {_names(p)} ran under a torch.func "
                             "transform (vmap, grad, jvp), whose tensors observation cannot "
                             "key or copy: not observed, not captured. Profile the "
                             "untransformed forward (one sample of the batch) instead",
    "never_completed": lambda p: f"{p.scope}: no call of {_n(p.variants, 'variant')} "
                                 f"had returned by finalize() ({_n(p.calls, 'call')} still "
                                 "running, e.g. in another thread), so there is nothing "
                                 "to capture",
    "stateful_member": lambda p: f"{p.scope}: member {p.names[0] if p.names else '?'} writes "
                                 f"state it holds ({', '.join(p.names[1:]) or '?'}) in its "
                                 "forward; a capture made afterwards sees that state as "
                                 "finalize() finds it, not as each call did. List the "
                                 "attributes in ignore_attributes if the graph does not "
                                 "depend on them",
    "observation_lost": lambda p: f"the forward of {_names(p)} was set anew by another tool "
                                  "while observed (e.g. accelerate's "
                                  "remove_hook_from_module): "
                                  f"{_n(p.calls, 'call')} observed before it ran a forward "
                                  "that capture no longer sees, and calls between the change "
                                  "and the next call of the model given to capture_with "
                                  "(where ctxreplay wraps the new forward) were not observed. "
                                  "Add or remove such hooks before capture_with or after "
                                  "finalize()",
    "member_changed": lambda p: f"{p.scope}: member {p.names[0] if p.names else '?'} changed "
                                f"({p.names[1] if len(p.names) > 1 else '?'}) in place while "
                                "observed (an assignment would have split the variant); "
                                "later calls may have run another graph than the one "
                                "recorded. Replace the value instead of changing it in place, "
                                "set it before capture_with, or list the attribute in "
                                "ignore_attributes if the graph does not depend on it",
}

#: notice reasons, in words
NOTICES = {
    "probe_too_fine": "captures with identical graphs differ only in this probe's state: "
                      "its key separates calls that run the same graph (give the probe a "
                      "coarser key, e.g. ForwardContextProbe(..., key=...))",
    "call_raised": "calls of this member raised in its forward (the caller handled the "
                   "exception): they were never calls to reproduce, so they are left out "
                   "of every variant and of the calls counted",
    "probe_varies_every_call": "this probe had a different state in every variant (a step "
                               "counter or a timestep in its key?)",
    "compiled_ran_uncompiled": "these torch.compile'd entry points ran uncompiled while the "
                               "session observed them, so the blocks inside were observed and "
                               "captured; they run compiled again once it closes (a profile "
                               "taken inside the session times the uncompiled code)",
    "step_cache_beneath": "these members carry a diffusers step cache's hooks (named after "
                          "each): they were observed and captured beneath them, so the hooks "
                          "stay Python and decide each step; the steps they compute run the "
                          "captured program, the steps they reuse run no block at all",
    "step_cache_inside": "these targets hold a diffusers step cache's hooks below their own "
                         "level: captured whole, the hooks' per-step decisions would be frozen "
                         "into the graph, so the hooked submodules named were captured beneath "
                         "their hooks instead, and the rest of each target runs eagerly",
}


@attrs.frozen
class Notice:
    """Something suspicious though not wrong (``ok`` is unaffected), e.g. a
    probe whose key is finer than the graphs it separates."""

    reason: str = attrs.field(validator=attrs.validators.in_(NOTICES))
    """A key of ``NOTICES``."""
    scope: str | None = None
    """The variant table it concerns."""
    probe: str | None = None
    """The probe it concerns."""
    count: int = 0
    """How many captures or variants show it."""
    names: tuple[str, ...] = ()
    """What it concerns, by name."""

    @property
    def message(self) -> str:
        """The notice in words."""
        where = ", ".join(x for x in (self.scope, self.probe and f"probe {self.probe!r}") if x)
        return (f"{where}: " if where else "") + NOTICES[self.reason] + \
            (f" ({self.count}x)" if self.count else "")

    def to_json(self) -> dict[str, Any]:
        """Metadata only."""
        return {"reason": self.reason, "scope": self.scope, "probe": self.probe,
                "count": self.count, "names": list(self.names)}
