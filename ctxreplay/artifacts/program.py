"""What every document of a capture records of its program -- the report and
the manifest (``Capture.to_json``), the sidecar beside a saved artifact, the
capture cache's record -- held in one record with one codec.

``ProgramMeta.to_json`` writes every field; a document that holds only part
of them keeps the keys it names (``program_json(meta, keys)``: the sidecar
holds ``BRIEF_KEYS``).  ``ProgramMeta.from_json`` reads the fields a document
holds strictly -- a malformed one raises ``ValueError`` naming its JSON path --
and gives the others their "not known" value, so a document that never held
them (a sidecar, an older manifest) still reads.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import attrs

from .._base.jsonread import read_list, read_mapping, read_pairs, read_str
from ..specs.baked import Baked
from ..specs.materialize import BINDINGS
from ..specs.signature import Spec
from ..specs.specjson import resolve_opaque, spec_from_json, spec_to_json
from .roles import OutputRole, roles_from_json, roles_to_json

__all__ = ["BRIEF_KEYS", "PROGRAM_KEYS", "SIDECAR_PROGRAM_KEYS", "BriefFields",
           "ProgramFields", "ProgramMeta", "program_json"]

#: the fields every document of a capture holds (a sidecar holds these only)
BRIEF_KEYS = ("backend", "binding", "fingerprint", "embedded", "ambient_only")

#: the fields a saved artifact's sidecar holds: those and the state its
#: program baked in, which whoever installs it guards
SIDECAR_PROGRAM_KEYS = (*BRIEF_KEYS, "baked")

#: every field of ``ProgramMeta.to_json``, in its order
PROGRAM_KEYS = (*BRIEF_KEYS, "graph_outputs", "constants", "ops", "op_args", "graph_digest",
                "output_roles", "baked")

# a graph of a whole model can hold far more nodes than a signature holds leaves
_MAX_OPS = 1_000_000
_MAX_NAME = 4096


def _names(value: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    return tuple(value)


def _roles(value: tuple[OutputRole, ...] | list[OutputRole] | None
           ) -> tuple[OutputRole, ...] | None:
    return None if value is None else tuple(value)


@attrs.frozen
class ProgramMeta:
    """What a capture's documents record of its program (metadata only): the
    backend that made it, how it takes its inputs, the probes it carries or
    needs around it, what its graph says of its outputs, its ops and digests.
    Every document of a capture writes and reads these through this record's
    codec (``to_json`` / ``from_json``)."""

    backend: str
    """The backend that produced the artifact (``"export"``, ``"dynamo"``,
    ``"symbolic"`` or a custom backend's name)."""
    binding: str = attrs.field(validator=attrs.validators.in_(BINDINGS))
    """How the artifact takes its inputs: ``"native"`` (the module's own
    arguments) or ``"flattened"`` (the call's tensor leaves, positionally)."""
    fingerprint: str
    """A digest of ops, input signature, context and backend: equal
    fingerprints, the same capture."""
    embedded: tuple[str, ...] = attrs.field(converter=_names)
    """Probes whose state the artifact carries itself (embedded replay)."""
    ambient_only: tuple[str, ...] = attrs.field(converter=_names)
    """Probes with a non-neutral state the artifact does not carry: whoever
    runs it must re-establish these (``snapshot.replay()`` does)."""
    graph_outputs: Spec | None = None
    """The specs the captured graph's metadata gives for its outputs
    (``None``: not known)."""
    constants: tuple[str, ...] = attrs.field(default=(), converter=_names)
    """Argument paths bound into the graph as constants (objects torch's
    pytree does not know, such as a KV cache)."""
    ops: tuple[tuple[str, str | None], ...] = attrs.field(repr=False, default=())
    """``(op, result dtype)`` of every call node of the graph, subgraphs
    included (empty: not known)."""
    op_args: tuple[str, ...] = attrs.field(repr=False, default=(), converter=_names)
    """Per op of ``ops``, a digest of its non-tensor arguments."""
    graph_digest: str = ""
    """A digest of the graph's code (nested graphs and constants included):
    equal digests, equal computation for the same inputs and weights
    (``""``: not known)."""
    output_roles: tuple[OutputRole, ...] | None = attrs.field(default=None, converter=_roles)
    """What each output of the graph is, in the order of its outputs: the
    call's own output (and where in what the call returns) or a write of
    state -- a tensor the forward assigns to an argument object, a buffer
    or input written in place (``None``: not known)."""
    baked: Baked | None = None
    """The places outside its arguments and weights its trace read state
    from -- a plain tensor attribute, a dict entry, a module global, a class
    attribute -- each with a digest of what it held (``None``: not known).
    ``install`` looks each up again before running the program."""

    def to_json(self) -> dict[str, Any]:
        """Every field, in ``PROGRAM_KEYS`` order (metadata only)."""
        return {
            "backend": self.backend,
            "binding": self.binding,
            "fingerprint": self.fingerprint,
            "embedded": list(self.embedded),
            "ambient_only": list(self.ambient_only),
            "graph_outputs": None if self.graph_outputs is None
            else spec_to_json(self.graph_outputs),
            "constants": list(self.constants),
            "ops": [list(o) for o in self.ops],
            "op_args": list(self.op_args),
            "graph_digest": self.graph_digest,
            "output_roles": roles_to_json(self.output_roles),
            "baked": None if self.baked is None else self.baked.to_json(),
        }

    @classmethod
    def from_json(cls, value: object, path: str = "$", *,
                  rebuild_outputs: bool = True) -> ProgramMeta:
        """The record in the document ``value`` (found at ``path``), which may
        hold other keys beside its fields.  ``BRIEF_KEYS`` are required; a
        field the document does not hold reads as not known (``None``,
        empty).  Every field present is validated: a malformed one raises
        ``ValueError`` naming its path (``$.capture.binding: 'x' is not one
        of [...]``).

        ``graph_outputs`` holds the graph's output structure, which JSON may
        not carry whole (a model-output class, a string constant):
        ``rebuild_outputs`` refuses such a document (``ValueError`` naming
        the part); ``False`` reads such outputs as ``None`` (not known)."""
        doc = read_mapping(value, path, required=set(BRIEF_KEYS))
        return cls(
            backend=read_str(doc["backend"], f"{path}.backend"),
            binding=read_str(doc["binding"], f"{path}.binding", choices=set(BINDINGS)),
            fingerprint=read_str(doc["fingerprint"], f"{path}.fingerprint"),
            embedded=_read_names(doc["embedded"], f"{path}.embedded"),
            ambient_only=_read_names(doc["ambient_only"], f"{path}.ambient_only"),
            graph_outputs=_read_outputs(doc.get("graph_outputs"), f"{path}.graph_outputs",
                                        rebuild_outputs),
            constants=_read_names(doc.get("constants", []), f"{path}.constants"),
            ops=tuple(read_pairs(doc.get("ops", []), f"{path}.ops", "[op, dtype]",
                                 lambda v, p: read_str(v, p, max_len=_MAX_NAME),
                                 _read_dtype_name, max_len=_MAX_OPS)),
            op_args=_read_names(doc.get("op_args", []), f"{path}.op_args", _MAX_OPS),
            graph_digest=read_str(doc.get("graph_digest", ""), f"{path}.graph_digest"),
            output_roles=roles_from_json(doc.get("output_roles"), f"{path}.output_roles"),
            baked=None if doc.get("baked") is None
            else Baked.from_json(doc["baked"], f"{path}.baked"),
        )


def program_json(meta: ProgramMeta, keys: Collection[str] = PROGRAM_KEYS) -> dict[str, Any]:
    """``meta.to_json()`` restricted to ``keys`` (a document that holds part of
    the record), in ``PROGRAM_KEYS`` order.  Raises ``ValueError`` naming a
    key that is not a field, and the fields."""
    unknown = sorted(set(keys) - set(PROGRAM_KEYS))
    if unknown:
        raise ValueError(f"program_json: {unknown} are not fields of ProgramMeta; "
                         f"expected some of {list(PROGRAM_KEYS)}")
    return {k: v for k, v in meta.to_json().items() if k in keys}


def _read_names(value: object, path: str, max_len: int = 10_000) -> tuple[str, ...]:
    return tuple(read_str(v, f"{path}[{i}]", max_len=_MAX_NAME)
                 for i, v in enumerate(read_list(value, path, max_len=max_len)))


def _read_dtype_name(value: object, path: str) -> str | None:
    return None if value is None else read_str(value, path)


def _read_outputs(value: object, path: str, rebuild: bool) -> Spec | None:
    if value is None:
        return None
    node = spec_from_json(value, path)  # validated whole, whatever is kept
    if rebuild:
        return resolve_opaque(node, ValueError, advice="the graph's outputs are not known")
    try:
        return resolve_opaque(node, ValueError)
    except ValueError:
        return None


class BriefFields:
    """The fields every document of a capture holds of its program
    (``BRIEF_KEYS``), read under their own names from the record's ``meta``."""

    __slots__ = ()

    @property
    def meta(self) -> ProgramMeta:
        """What the record holds of the program."""
        raise NotImplementedError

    @property
    def backend(self) -> str:
        """The backend that produced the artifact (``"export"``, ``"dynamo"``,
        ``"symbolic"`` or a custom backend's name)."""
        return self.meta.backend

    @property
    def binding(self) -> str:
        """How the artifact takes its inputs: ``"native"`` (the module's own
        arguments) or ``"flattened"`` (the call's tensor leaves, positionally)."""
        return self.meta.binding

    @property
    def fingerprint(self) -> str:
        """A digest of ops, input signature, context and backend: equal
        fingerprints, the same capture."""
        return self.meta.fingerprint

    @property
    def embedded(self) -> tuple[str, ...]:
        """Probes whose state the artifact carries itself (embedded replay)."""
        return self.meta.embedded

    @property
    def ambient_only(self) -> tuple[str, ...]:
        """Probes with a non-neutral state the artifact does not carry: whoever
        runs it must re-establish these (``snapshot.replay()`` does)."""
        return self.meta.ambient_only


class ProgramFields(BriefFields):
    """Every field of the record's ``meta``, read under its own name."""

    __slots__ = ()

    @property
    def graph_outputs(self) -> Spec | None:
        """The specs the captured graph's metadata gives for its outputs."""
        return self.meta.graph_outputs

    @property
    def constants(self) -> tuple[str, ...]:
        """Argument paths bound into the graph as constants (objects torch's
        pytree does not know, such as a KV cache)."""
        return self.meta.constants

    @property
    def ops(self) -> tuple[tuple[str, str | None], ...]:
        """``(op, result dtype)`` of every call node of the graph, subgraphs
        included."""
        return self.meta.ops

    @property
    def op_args(self) -> tuple[str, ...]:
        """Per op of ``ops``, a digest of its non-tensor arguments."""
        return self.meta.op_args

    @property
    def graph_digest(self) -> str:
        """A digest of the graph's code (nested graphs and constants included):
        equal digests, equal computation for the same inputs and weights."""
        return self.meta.graph_digest

    @property
    def output_roles(self) -> tuple[OutputRole, ...] | None:
        """What each output of the graph is, in the order of its outputs:
        the call's own output or a write of state (``None``: not known)."""
        return self.meta.output_roles

    @property
    def baked(self) -> Baked | None:
        """The places beside its arguments and weights its trace read state
        from, each with a digest of what it held (``None``: not known)."""
        return self.meta.baked
