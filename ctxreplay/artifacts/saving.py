"""Self-contained artifacts on disk: a ``.pt2`` plus a metadata-only sidecar.

``Capture.save(path)`` writes ``path`` (``torch.export.save``) and
``path + ".json"`` (``sidecar``): the snapshot the capture was replayed
under and the input / output signatures; with ``verify`` the written file
is loaded back and checked against the live call.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Protocol

import attrs
import torch

from .._base.environment import full_environment
from ..backends.passes import has_wrapper_hops, lower_wrappers
from ..core.snapshots import ContextSnapshot
from ..fidelity.compare import SpecMismatch, compare_specs
from ..fidelity.verify import Fidelity, Mismatch, flat_tensor_spec, neutral_replay
from ..specs.materialize import inputs_for
from ..specs.signature import CallSpec, Spec, spec_of
from ..specs.specjson import (
    call_to_json,
    spec_to_json,
)
from .sidecar import SIDECAR_SCHEMA, ArtifactError, sidecar_path

__all__ = ["SavableCapture", "SavedArtifact", "artifact_inputs", "save_capture",
           "sidecar_json"]

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


@attrs.frozen
class SavedArtifact:
    """What ``Capture.save`` wrote.

    ``fidelity`` is the check of the file itself: it is loaded back,
    executed on fresh inputs outside any replay and compared with the live
    call (level ``"saved"``; ``checked`` is empty when the check was skipped).
    """

    path: Path
    """The ``.pt2`` written (``torch.export.load`` reads it)."""
    sidecar: Path
    """The metadata-only sidecar written beside it, ``<path>.json``."""
    lowered: bool
    """Whether the program was lowered (``run_decompositions``) before saving, because
    ``torch.export.save`` refused its context wrappers."""
    fidelity: Fidelity
    """The check of the file itself (level ``saved``)."""


# -- saving ----------------------------------------------------------------------

def save_capture(capture: SavableCapture, path: str | os.PathLike[str], *,
                 verify: bool = True) -> SavedArtifact:
    """Write ``capture``'s artifact to ``path`` and its sidecar beside it.

    Only ``torch.export`` artifacts can be written; others raise
    :class:`ArtifactError` naming the backend.

    A program that recorded embedded contexts as wrapper higher-order ops
    (``wrap_with_autocast``) is lowered first: ``run_decompositions({})``
    turns them into explicit casts, which every consumer of a ``.pt2``
    understands and older torch needs to serialise it at all (its verifier
    rejected the wrappers).  Lowering can lose a cast, though: autocast registered on a
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
