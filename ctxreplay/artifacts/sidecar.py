"""A capture's sidecar: the metadata-only document written beside its
artifact file (``saving.save_capture``), read back with strict validation so
another process can replay the snapshot around the loaded program,
materialise inputs for it, and check its outputs.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from .._base.jsonread import (
    loads,
    read_bool,
    read_int,
    read_list,
    read_mapping,
    read_pairs,
    read_str,
)
from ..core.probe import ContextProbe
from ..core.snapshots import ContextSnapshot, UnknownProbeWarning
from ..errors import Error
from ..fidelity.compare import compare_specs
from ..fidelity.verify import Mismatch, flat_tensor_spec
from ..specs.dims import Folding
from ..specs.materialize import fresh_draws, materialize
from ..specs.signature import CallSpec, SeqSpec, Spec, TensorSpec, spec_of
from ..specs.specjson import resolve_opaque, spec_from_json, tensor_from_json
from .formats import get_format
from .program import BRIEF_KEYS, BriefFields, ProgramMeta
from .pt2 import Pt2Format
from .roles import OutputRole

__all__ = ["ARTIFACT_ERRORS", "SIDECAR_SCHEMA", "ArtifactError", "ArtifactSidecar",
           "load_sidecar", "read_sidecar", "sidecar_path", "warn_unknown"]

SIDECAR_SCHEMA = "ctxreplay.artifact/1"

#: every ``ArtifactError.reason``: no registered artifact format can hold the
#: artifact (the built-in ``.pt2`` holds ``torch.export`` programs); its format
#: refused the program in every form; a loaded capture's inputs or outputs
#: cannot be rebuilt from its sidecar
ARTIFACT_ERRORS = ("backend_not_savable", "serialize_failed", "not_rebuildable")


class ArtifactError(Error, RuntimeError):
    """A capture could not be saved (or a saved one could not be used).

    Args:
        message: what went wrong, in words.
        reason: a code, one of ``ARTIFACT_ERRORS``: ``backend_not_savable``,
            ``serialize_failed`` or ``not_rebuildable``.
    """

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason
        """One of ``ARTIFACT_ERRORS``."""


def sidecar_path(path: str | os.PathLike[str]) -> Path:
    """The sidecar written beside an artifact: ``<path>.json``."""
    return Path(os.fspath(path) + ".json")


_Node = Any  # Spec | Opaque, nested


@attrs.frozen(eq=False)
class ArtifactSidecar(BriefFields):
    """A sidecar read back by :func:`load_sidecar`.

    ``snapshot`` is the context the capture was replayed under (replay it
    around the loaded program with ``snapshot.replay()``; the program
    already carries ``embedded`` itself).  ``inputs`` are the tensor leaves
    of the captured call as ``(path, TensorSpec)``, ``outputs`` the live
    call's output leaves: the signatures, never values.
    """

    path: Path
    """The sidecar file."""
    artifact: Path
    """The artifact file it describes."""
    scope: str
    """The capture's variant table."""
    variant: int
    """The capture's variant number."""
    meta: ProgramMeta
    """What the sidecar records of the program (``Capture.meta``'s codec; a
    sidecar holds its ``BRIEF_KEYS``: backend, binding, fingerprint,
    embedded, ambient_only -- and ``output_roles``; the rest reads as not
    known)."""
    torch_version: str
    """The torch version the file was written with."""
    lowered: bool
    """Whether the saved program was lowered to explicit casts."""
    snapshot: ContextSnapshot
    """The context the capture was replayed under (states that JSON cannot carry are unresolved)."""
    inputs: tuple[tuple[str, TensorSpec], ...]
    """``(path, TensorSpec)`` of each tensor leaf of the captured call."""
    outputs: tuple[TensorSpec, ...] | None
    """The live call's output leaves (``None``: not recorded)."""
    document: Mapping[str, Any] = attrs.field(repr=False)
    """The sidecar's JSON document, as read."""
    _args: tuple[_Node, ...] = attrs.field(repr=False, alias="args")
    _kwargs: tuple[tuple[str, _Node], ...] = attrs.field(repr=False, alias="kwargs")
    members: tuple[str, ...] = ()
    """The blocks the capture stands for (empty in a sidecar written before they were
    recorded)."""
    weights_from: str = ""
    """The member whose weights the file holds."""
    identities: tuple[tuple[str, str], ...] = ()
    """``(member, identity digest)`` of each member (``Capture.identities``; empty in older
    sidecars)."""
    ignore_attributes: tuple[str, ...] = ()
    """Attributes left out of the members' identities."""
    folding: Folding | None = None
    """The dynamic sizes of a folded capture (``Capture.folding``), else ``None``."""
    format: str = Pt2Format.name
    """The name of the artifact's format (``ctxreplay.artifacts.get_format``); a sidecar
    written before formats were recorded describes a ``.pt2``."""

    @property
    def output_roles(self) -> tuple[OutputRole, ...] | None:
        """What each output of the saved program's graph is, in order: the
        call's own output or a write of state (``None``: a sidecar written
        before roles were recorded)."""
        return self.meta.output_roles

    def load_program(self) -> Any:
        """The artifact beside this sidecar, read by its format (for a ``.pt2``,
        ``torch.export.load``).  Raises ``UnknownFormatError`` for a format
        this process has not registered."""
        return get_format(self.format).load(self.artifact)

    def example_inputs(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Fresh ``(args, kwargs)`` for ``program.module()``: floats uniform in
        [0, 1), integers zero, bools false -- values inside the domains of the ops
        tried (``binary_cross_entropy``, embeddings).  A flattened capture takes
        its tensor leaves positionally.  Raises :class:`ArtifactError` when the
        signature holds a value JSON cannot rebuild."""
        fresh_draws()  # the same inputs whatever was drawn before
        if self.binding == "flattened":
            return tuple(materialize(s) for _, s in self.inputs), {}
        args = tuple(materialize(_buildable(a)) for a in self._args)
        kwargs = {k: materialize(_buildable(v)) for k, v in self._kwargs}
        return args, kwargs

    def signature(self) -> CallSpec:
        """The captured call's signature, rebuilt from the document (what a
        live call must equal to be this capture's call).  Raises
        :class:`ArtifactError` (``not_rebuildable``) naming the first part
        JSON does not carry fully (an object, a string constant's value)."""
        return CallSpec(tuple(_buildable(a) for a in self._args),
                        tuple((k, _buildable(v)) for k, v in self._kwargs))

    def check(self, outputs: Any) -> tuple[Mismatch, ...]:
        """Differences between ``outputs`` (of the loaded program) and the live
        call's outputs, leaf by leaf; empty when they agree.  A program that
        returns what its forward assigns to argument objects (``assigned``
        in the document) returns those tensors last: they are left out."""
        if self.outputs is None:
            return ()
        live = SeqSpec(list, tuple(self.outputs))
        produced = flat_tensor_spec(spec_of(outputs))
        assigned = self.document.get("assigned")
        paths = assigned.get("tensors") if isinstance(assigned, Mapping) else None
        n = len(paths) if isinstance(paths, list) else 0
        if n and isinstance(produced, SeqSpec):
            produced = SeqSpec(produced.kind, produced.items[:-n])
        found = compare_specs(live, produced)
        return tuple(Mismatch.of(m, "saved", None) for m in found)


class _NotRebuildable(ArtifactError):
    def __init__(self, message: str) -> None:
        super().__init__(message, "not_rebuildable")


def _buildable(node: _Node) -> Spec:
    return resolve_opaque(node, _NotRebuildable)


_SIDECAR_KEYS = {"schema", "artifact", "torch", "scope", "variant", *BRIEF_KEYS,
                 "lowered", "snapshot", "context",
                 "inputs", "outputs", "output_leaves", "fidelity", "saved_fidelity",
                 "environment", "members", "weights_from", "identities", "ignore_attributes",
                 "format", "calls", "checked", "dynamic", "assigned", "artifact_digest",
                 "output_roles", "baked"}
_REQUIRED = _SIDECAR_KEYS - {"context", "fidelity", "saved_fidelity", "torch", "lowered",
                             "environment", "members", "weights_from", "identities",
                             "ignore_attributes", "format", "calls", "checked", "dynamic",
                             "assigned", "artifact_digest", "output_roles", "baked"}


def load_sidecar(path: str | os.PathLike[str],
                 probes: Mapping[str, ContextProbe[Any]] | None = None, *,
                 unknown: str = "opaque") -> ArtifactSidecar:
    """Read the sidecar of an artifact written by ``Capture.save``.

    ``path`` is the ``.pt2`` or its ``.json`` sidecar.  Every field is
    validated; malformed input raises ``ValueError`` naming the path inside
    the document.  ``probes`` supplies instances for probe names the registry
    does not hold (as in :meth:`ContextSnapshot.from_json`).  A probe neither
    holds (``unknown="opaque"``, the default) loads as an opaque state that
    cannot be replayed, with one :class:`ctxreplay.probes.UnknownProbeWarning`
    naming them; ``unknown="error"`` refuses it.
    """
    side = read_sidecar(path, probes, unknown=unknown)
    warn_unknown(side.snapshot.unknown, str(side.path.name))
    return side


def warn_unknown(names: tuple[str, ...] | list[str], where: str) -> None:
    """One warning naming every unknown probe of a loaded document."""
    if names:
        shown = ", ".join(sorted(set(names)))
        warnings.warn(f"{where}: probe(s) {shown} are not registered in this process; "
                      "their states were loaded as opaque and cannot be replayed",
                      UnknownProbeWarning, stacklevel=3)


def read_sidecar(path: str | os.PathLike[str],
                 probes: Mapping[str, ContextProbe[Any]] | None = None, *,
                 unknown: str = "opaque", data: bytes | None = None) -> ArtifactSidecar:
    """:func:`load_sidecar` without the warning (the caller gives one for
    everything it loads): unknown probes are in ``snapshot.unknown``.
    ``data``: the sidecar's bytes, where the caller has read (and checked) them."""
    given = Path(os.fspath(path))
    side = given if given.suffix == ".json" and not given.name.endswith(".pt2") \
        else sidecar_path(given)
    parsed = loads(side.read_bytes() if data is None else data, "$", source=str(side))
    doc = read_mapping(parsed, "$", keys=_SIDECAR_KEYS, required=_REQUIRED)
    schema = read_str(doc["schema"], "$.schema")
    if schema != SIDECAR_SCHEMA:
        raise ValueError(f"$.schema: unsupported schema {schema!r}; expected {SIDECAR_SCHEMA!r}")
    name = read_str(doc["artifact"], "$.artifact", max_len=1024)
    if Path(name).name != name or name in ("", ".", ".."):
        raise ValueError(f"$.artifact: {name!r} must be a bare file name")
    snap = ContextSnapshot.from_json(doc["snapshot"], probes, path="$.snapshot",
                                     unknown=unknown)
    if "environment" in doc:
        read_mapping(doc["environment"], "$.environment")
    inputs = read_mapping(doc["inputs"], "$.inputs", keys={"args", "kwargs", "leaves"},
                          required={"args", "kwargs", "leaves"})
    args = tuple(spec_from_json(a, f"$.inputs.args[{i}]")
                 for i, a in enumerate(read_list(inputs["args"], "$.inputs.args")))
    kwargs = read_pairs(inputs["kwargs"], "$.inputs.kwargs", "[name, spec]",
                         lambda v, p: read_str(v, p),
                         lambda v, p: spec_from_json(v, p))
    leaves = read_pairs(inputs["leaves"], "$.inputs.leaves", "[path, tensor spec]",
                         lambda v, p: read_str(v, p, max_len=4096), tensor_from_json)
    outputs = None
    if doc["output_leaves"] is not None:
        outputs = tuple(tensor_from_json(s, f"$.output_leaves[{i}]") for i, s in
                        enumerate(read_list(doc["output_leaves"], "$.output_leaves")))
    if doc["outputs"] is not None:
        spec_from_json(doc["outputs"], "$.outputs")
    return ArtifactSidecar(
        path=side,
        artifact=side.parent / name,
        scope=read_str(doc["scope"], "$.scope", max_len=4096),
        variant=read_int(doc["variant"], "$.variant", lo=0),
        meta=ProgramMeta.from_json(doc, "$"),
        torch_version=read_str(doc.get("torch", "?"), "$.torch"),
        lowered=read_bool(doc.get("lowered", False), "$.lowered"),
        snapshot=snap,
        inputs=tuple(leaves),
        outputs=outputs,
        document=doc,
        members=_read_names(doc.get("members", []), "$.members", max_len=4096),
        weights_from=read_str(doc.get("weights_from", ""), "$.weights_from", max_len=4096),
        identities=tuple(read_pairs(doc.get("identities", []), "$.identities",
                                    "[member, digest]",
                                    lambda v, p: read_str(v, p, max_len=4096),
                                    lambda v, p: read_str(v, p, max_len=64))),
        ignore_attributes=_read_names(doc.get("ignore_attributes", []),
                                      "$.ignore_attributes"),
        format=read_str(doc.get("format", Pt2Format.name), "$.format"),
        folding=None if doc.get("dynamic") is None
        else Folding.from_json(doc["dynamic"], "$.dynamic"),
        args=args,
        kwargs=tuple(kwargs),
    )


def _read_names(value: object, path: str, max_len: int = 256) -> tuple[str, ...]:
    return tuple(read_str(v, f"{path}[{i}]", max_len=max_len)
                 for i, v in enumerate(read_list(value, path)))
