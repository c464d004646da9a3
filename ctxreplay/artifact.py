"""Self-contained artifacts on disk: a ``.pt2`` plus a metadata-only sidecar.

``Capture.save(path)`` writes ``path`` (``torch.export.save``) and
``path + ".json"``: the snapshot the capture was replayed under and the
input / output signatures.  ``load_sidecar`` reads the sidecar back with
strict validation, so another process can replay the snapshot around the
loaded program, materialise inputs for it, and check its outputs.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import attrs
import torch

from ._environment import full_environment
from ._json import loads, read_bool, read_int, read_list, read_mapping, read_pairs, read_str
from .compare import SpecMismatch, compare_specs
from .materialize import inputs_for, materialize
from .passes import has_wrapper_hops, lower_wrappers
from .probe import ContextProbe
from .signature import CallSpec, SeqSpec, Spec, TensorSpec, spec_of
from .snapshot import ContextSnapshot, UnknownProbeWarning
from .specjson import (
    call_to_json,
    resolve_opaque,
    spec_from_json,
    spec_to_json,
    tensor_from_json,
)
from .verify import Fidelity, Mismatch, flat_tensor_spec, neutral_replay

__all__ = ["SIDECAR_SCHEMA", "ArtifactError", "ArtifactSidecar", "SavableCapture",
           "SavedArtifact", "artifact_inputs", "load_sidecar", "read_sidecar", "save_capture",
           "sidecar_path", "warn_unknown"]

SIDECAR_SCHEMA = "ctxreplay.artifact/1"


class SavableCapture(Protocol):
    """What saving needs of a capture (``ctxreplay.Capture`` has it all)."""

    @property
    def scope(self) -> str: ...
    @property
    def variant(self) -> int: ...
    @property
    def backend(self) -> str: ...
    @property
    def artifact(self) -> Any: ...
    @property
    def binding(self) -> str: ...
    @property
    def fingerprint(self) -> str: ...
    @property
    def embedded(self) -> tuple[str, ...]: ...
    @property
    def ambient_only(self) -> tuple[str, ...]: ...
    @property
    def snapshot(self) -> ContextSnapshot: ...
    @property
    def signature(self) -> CallSpec: ...
    @property
    def outputs(self) -> Spec | None: ...
    @property
    def fidelity(self) -> Fidelity: ...


class ArtifactError(RuntimeError):
    """A capture could not be saved (or a saved one could not be used).

    ``reason`` is a code: ``backend_not_savable``, ``no_artifact``,
    ``serialize_failed`` or ``not_rebuildable``.
    """

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


@attrs.frozen
class SavedArtifact:
    """What ``Capture.save`` wrote.

    ``fidelity`` is the check of the file itself: it is loaded back,
    executed on fresh inputs outside any replay and compared with the live
    call (level ``"saved"``; ``checked`` is empty when the check was skipped).
    """

    path: Path
    sidecar: Path
    lowered: bool
    fidelity: Fidelity


def sidecar_path(path: str | os.PathLike[str]) -> Path:
    """The sidecar written beside an artifact: ``<path>.json``."""
    return Path(os.fspath(path) + ".json")


# -- saving ----------------------------------------------------------------------

def save_capture(capture: SavableCapture, path: str | os.PathLike[str], *,
                 verify: bool = True) -> SavedArtifact:
    """Write ``capture``'s artifact to ``path`` and its sidecar beside it.

    Only ``torch.export`` artifacts can be written; others raise
    :class:`ArtifactError` naming the backend.

    A program that recorded embedded contexts as wrapper higher-order ops
    (``wrap_with_autocast``) is lowered first: ``run_decompositions({})``
    turns them into explicit casts, which every consumer of a ``.pt2``
    understands and older torch needs to serialise it at all (DESIGN.md
    fact 4).  Lowering can lose a cast, though: autocast registered on a
    composite op (``nll_loss`` under ``nll_loss_nd``, ``mkldnn_rnn_layer``
    under ``lstm``) acts inside a decomposition the retrace never records.
    So with ``verify`` the written file is loaded back and run on fresh
    inputs; if the lowered program disagrees with the live call, the program
    is written with its wrappers kept (they re-enter autocast when it runs),
    and the result that agrees is kept.  A program without wrappers is
    written as captured, and lowered only if the serialiser refuses it (or,
    with ``verify``, if the file disagrees with the live call).
    """
    from torch.export import ExportedProgram

    if not isinstance(capture.artifact, ExportedProgram):
        raise ArtifactError(
            f"Capture.save: {capture.scope}#{capture.variant} was captured by the "
            f"{capture.backend!r} backend, whose artifact cannot be written as a .pt2; "
            f"capture with backend='export' (or 'auto' where export succeeds) to save it",
            "backend_not_savable")
    target = Path(os.fspath(path))
    if not target.parent.is_dir():
        raise FileNotFoundError(f"Capture.save: no directory {str(target.parent)!r}")
    ep = capture.artifact
    # (lowered?, program) in order of preference
    if has_wrapper_hops(ep.graph_module):
        order = ((True, lambda: lower_wrappers(ep)), (False, lambda: ep))
    else:
        order = ((False, lambda: ep), (True, lambda: lower_wrappers(ep)))
    result: tuple[bool, Any, Fidelity] | None = None
    written: Any = None  # the program the file holds now
    errors: list[BaseException] = []
    for lowered, build in order:
        try:
            program = build()
            torch.export.save(program, target)
        except Exception as exc:  # the serialiser refused this form; try the next
            errors.append(exc)
            continue
        written = program
        fidelity = _check_saved(capture, target) if verify else Fidelity("off", True, (), ())
        if result is None or fidelity.ok:
            result = (lowered, program, fidelity)
        if fidelity.ok:
            break
    if result is None:
        raise ArtifactError(
            f"Capture.save: torch.export.save refused {capture.scope}#{capture.variant}, "
            f"lowered or not ({', '.join(type(e).__name__ for e in errors)})",
            "serialize_failed") from errors[-1]
    lowered, program, fidelity = result
    if program is not written:  # neither form agreed: keep the preferred one
        torch.export.save(program, target)
    doc = sidecar_json(capture, target, lowered=lowered, fidelity=fidelity)
    side = sidecar_path(target)
    side.write_text(json.dumps(doc, indent=2, sort_keys=True))
    return SavedArtifact(target, side, lowered, fidelity)


def artifact_inputs(capture: SavableCapture) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Fresh inputs in the form the capture's artifact takes them."""
    return inputs_for(capture.signature, capture.binding)


def _check_saved(capture: SavableCapture, target: Path) -> Fidelity:
    """Run the file as a consumer would: loaded fresh, on fresh inputs, from a
    neutral state plus only what no artifact can carry (``neutral_replay``)."""
    if capture.outputs is None:  # no live outputs to hold the file to
        return Fidelity("off", True, (), ())
    try:
        program = torch.export.load(target)
    except Exception as exc:
        return Fidelity("saved", False, (Mismatch("out", "execution", "loaded",
                                                  type(exc).__name__, "saved"),), ("saved",))
    found = _run_saved(capture, program, ())
    with_needs = None
    if found and capture.ambient_only:
        with_needs = not _run_saved(capture, program, capture.ambient_only)
    hint = None
    if found and capture.ambient_only:
        hint = "not carried by the artifact: " + ", ".join(capture.ambient_only)
    return Fidelity("saved", not found, tuple(Mismatch.of(m, "saved", hint) for m in found),
                    ("saved",), ok_with_needs=with_needs)


def _run_saved(capture: SavableCapture, program: Any,
               needs: tuple[str, ...]) -> list[SpecMismatch]:
    try:
        args, kwargs = artifact_inputs(capture)
        with neutral_replay(capture.snapshot, needs=needs):
            produced = spec_of(program.module()(*args, **kwargs))
    except Exception as exc:
        return [SpecMismatch("out", "execution", "ran", type(exc).__name__)]
    assert capture.outputs is not None
    return list(compare_specs(flat_tensor_spec(capture.outputs), flat_tensor_spec(produced)))


def sidecar_json(capture: SavableCapture, artifact: Path, *, lowered: bool,
                 fidelity: Fidelity) -> dict[str, Any]:
    """The sidecar document: metadata only (no tensor values, no source).
    ``members`` / ``weights_from`` (whose parameters the file holds) and the
    ``environment`` are written where the capture has them."""
    leaves = [[p, spec_to_json(s)] for p, s in capture.signature.leaves()]
    members = getattr(capture, "members", ())
    return {
        "schema": SIDECAR_SCHEMA,
        "artifact": artifact.name,
        "torch": str(torch.__version__),
        "environment": full_environment(),
        "scope": capture.scope,
        "members": list(members),
        "weights_from": str(getattr(capture, "weights_from", "") or
                            (members[0] if members else "")),
        "identities": [list(i) for i in getattr(capture, "identities", ())],
        "ignore_attributes": list(getattr(capture, "ignore_attributes", ())),
        "variant": capture.variant,
        "backend": capture.backend,
        "binding": capture.binding,
        "fingerprint": capture.fingerprint,
        "lowered": lowered,
        "embedded": list(capture.embedded),
        "ambient_only": list(capture.ambient_only),
        "snapshot": capture.snapshot.to_json(),
        "context": capture.snapshot.describe(),
        "inputs": {**call_to_json(capture.signature), "leaves": leaves},
        "outputs": None if capture.outputs is None else spec_to_json(capture.outputs),
        "output_leaves": None if capture.outputs is None else [
            spec_to_json(s) for s in flat_tensor_spec(capture.outputs).items],
        "fidelity": capture.fidelity.to_json(),
        "saved_fidelity": fidelity.to_json(),
    }


# -- loading ---------------------------------------------------------------------

_Node = Any  # Spec | Opaque, nested


@attrs.frozen(eq=False)
class ArtifactSidecar:
    """A sidecar read back by :func:`load_sidecar`.

    ``snapshot`` is the context the capture was replayed under (replay it
    around the loaded program with ``snapshot.replay()``; the program
    already carries ``embedded`` itself).  ``inputs`` are the tensor leaves
    of the captured call as ``(path, TensorSpec)``, ``outputs`` the live
    call's output leaves: the signatures, never values.
    """

    path: Path
    artifact: Path
    scope: str
    variant: int
    backend: str
    binding: str
    fingerprint: str
    torch_version: str
    lowered: bool
    embedded: tuple[str, ...]
    ambient_only: tuple[str, ...]
    snapshot: ContextSnapshot
    inputs: tuple[tuple[str, TensorSpec], ...]
    outputs: tuple[TensorSpec, ...] | None
    document: Mapping[str, Any] = attrs.field(repr=False)
    _args: tuple[_Node, ...] = attrs.field(repr=False, alias="args")
    _kwargs: tuple[tuple[str, _Node], ...] = attrs.field(repr=False, alias="kwargs")
    #: the blocks the capture stands for and the one whose weights the file
    #: holds (empty in a sidecar written before they were recorded)
    members: tuple[str, ...] = ()
    weights_from: str = ""
    #: ``(member, identity digest)`` and the attributes left out of it
    #: (``Capture.identities``; empty in older sidecars)
    identities: tuple[tuple[str, str], ...] = ()
    ignore_attributes: tuple[str, ...] = ()

    def load_program(self) -> Any:
        """``torch.export.load`` of the artifact beside this sidecar."""
        return torch.export.load(self.artifact)

    def example_inputs(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Fresh ``(args, kwargs)`` for ``program.module()``: floats uniform in
        [0, 1), integers zero (DESIGN.md fact 11).  A flattened capture takes
        its tensor leaves positionally.  Raises :class:`ArtifactError` when the
        signature holds a value JSON cannot rebuild."""
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
        call's outputs, leaf by leaf; empty when they agree."""
        if self.outputs is None:
            return ()
        live = SeqSpec(list, tuple(self.outputs))
        found = compare_specs(live, flat_tensor_spec(spec_of(outputs)))
        return tuple(Mismatch.of(m, "saved", None) for m in found)


class _NotRebuildable(ArtifactError):
    def __init__(self, message: str) -> None:
        super().__init__(message, "not_rebuildable")


def _buildable(node: _Node) -> Spec:
    return resolve_opaque(node, _NotRebuildable)


_SIDECAR_KEYS = {"schema", "artifact", "torch", "scope", "variant", "backend", "binding",
                 "fingerprint", "lowered", "embedded", "ambient_only", "snapshot", "context",
                 "inputs", "outputs", "output_leaves", "fidelity", "saved_fidelity",
                 "environment", "members", "weights_from", "identities", "ignore_attributes"}
_REQUIRED = _SIDECAR_KEYS - {"context", "fidelity", "saved_fidelity", "torch", "lowered",
                             "environment", "members", "weights_from", "identities",
                             "ignore_attributes"}


def load_sidecar(path: str | os.PathLike[str],
                 probes: Mapping[str, ContextProbe[Any]] | None = None, *,
                 unknown: str = "opaque") -> ArtifactSidecar:
    """Read the sidecar of an artifact written by ``Capture.save``.

    ``path`` is the ``.pt2`` or its ``.json`` sidecar.  Every field is
    validated; malformed input raises ``ValueError`` naming the path inside
    the document.  ``probes`` supplies instances for probe names the registry
    does not hold (as in :meth:`ContextSnapshot.from_json`).  A probe neither
    holds (``unknown="opaque"``, the default) loads as an opaque state that
    cannot be replayed, with one :class:`ctxreplay.UnknownProbeWarning`
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
                 unknown: str = "opaque") -> ArtifactSidecar:
    """:func:`load_sidecar` without the warning (the caller gives one for
    everything it loads): unknown probes are in ``snapshot.unknown``."""
    given = Path(os.fspath(path))
    side = given if given.suffix == ".json" and not given.name.endswith(".pt2") \
        else sidecar_path(given)
    data = loads(side.read_bytes(), "$", source=str(side))
    doc = read_mapping(data, "$", keys=_SIDECAR_KEYS, required=_REQUIRED)
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
        backend=read_str(doc["backend"], "$.backend"),
        binding=read_str(doc["binding"], "$.binding", choices={"native", "flattened"}),
        fingerprint=read_str(doc["fingerprint"], "$.fingerprint"),
        torch_version=read_str(doc.get("torch", "?"), "$.torch"),
        lowered=read_bool(doc.get("lowered", False), "$.lowered"),
        embedded=_read_names(doc["embedded"], "$.embedded"),
        ambient_only=_read_names(doc["ambient_only"], "$.ambient_only"),
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
        args=args,
        kwargs=tuple(kwargs),
    )


def _read_names(value: object, path: str, max_len: int = 256) -> tuple[str, ...]:
    return tuple(read_str(v, f"{path}[{i}]", max_len=max_len)
                 for i, v in enumerate(read_list(value, path)))
