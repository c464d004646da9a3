"""Self-contained artifacts on disk: the artifact in its format (a ``.pt2`` for a
torch.export program) plus a metadata-only sidecar.

``Capture.save(path)`` writes ``path`` (the format's ``save``) and
``path + ".json"`` (``sidecar``): the snapshot the capture was replayed
under and the input / output signatures; with ``verify`` the written file
is loaded back and checked against the live call.
"""

from __future__ import annotations

import gc
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

import attrs
import torch

from .._base.environment import full_environment
from .._base.safefiles import file_digest, write_inside, written_inside
from ..core.snapshots import ContextSnapshot
from ..fidelity.compare import SpecMismatch, compare_specs
from ..fidelity.levels import at_least, level_names
from ..fidelity.verify import Fidelity, Mismatch, flat_tensor_spec, neutral_replay
from ..specs.materialize import inputs_for
from ..specs.signature import CallSpec, SeqSpec, Spec, spec_of
from ..specs.specjson import (
    call_to_json,
    spec_to_json,
)
from .formats import ArtifactFormat, format_for
from .program import SIDECAR_PROGRAM_KEYS, ProgramMeta, program_json
from .roles import OutputRole, program_roles, roles_to_json
from .sidecar import SIDECAR_SCHEMA, ArtifactError, sidecar_path

__all__ = ["SavableCapture", "SavedArtifact", "artifact_inputs", "collector_paused",
           "save_capture", "sidecar_json"]

class SavableCapture(Protocol):
    """What saving needs of a capture (``ctxreplay.Capture`` has it all): its
    program's metadata (``meta``, written through its codec), the artifact,
    the context and signatures, the check.  ``sidecar_json`` also writes
    what a capture has of ``members``, ``weights_from``, ``identities``,
    ``ignore_attributes``, ``calls``, ``checked``, ``folding`` and
    ``assigned``."""

    @property
    def scope(self) -> str: ...
    @property
    def variant(self) -> int: ...
    @property
    def meta(self) -> ProgramMeta: ...
    @property
    def artifact(self) -> Any: ...
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

    ``fidelity`` is the check of the file itself (level ``"saved"``): it is
    loaded back and, where it holds the very program the capture's own check
    stands behind, compared with it graph to graph and weight by weight
    (``checked == ("graph",)``: the file is vouched for as far as
    ``Capture.fidelity`` is, no further); otherwise executed on fresh inputs
    outside any replay and compared with the live call (``checked ==
    ("saved",)``); ``checked`` is empty when the check was skipped.
    """

    path: Path
    """The artifact file written (its format's ``load`` reads it)."""
    sidecar: Path
    """The metadata-only sidecar written beside it, ``<path>.json``."""
    lowered: bool
    """Whether the program was lowered before saving (``ArtifactFormat.forms``: for a
    ``.pt2``, ``run_decompositions``, because ``torch.export.save`` refused its context
    wrappers)."""
    fidelity: Fidelity
    """The check of the file itself (level ``saved``)."""
    digest: str = ""
    """The artifact file's content digest, ``sha256:<hex>`` (recorded in its
    sidecar and in the manifest; checked before the file is read)."""


# -- saving ----------------------------------------------------------------------

def save_capture(capture: SavableCapture, path: str | os.PathLike[str], *,
                 verify: bool = True) -> SavedArtifact:
    """Write ``capture``'s artifact to ``path`` and its sidecar beside it.

    The artifact format is the one whose suffix ends ``path``'s name, else
    the first registered that can hold the artifact (``formats.format_for``);
    an artifact it cannot hold raises :class:`ArtifactError`
    (``backend_not_savable``) naming the backend.  The format's forms of the
    artifact (``ArtifactFormat.forms``: for a ``.pt2``, the program as
    captured and lowered) are written in order of preference; with
    ``verify`` each written file is loaded back and checked (``_check_saved``:
    compared with the program the capture's check stands behind, else run on
    fresh inputs), and the first that agrees with the live call is kept --
    or, where none agrees, the first the format accepted.
    """
    target = Path(os.fspath(path))
    fmt, why = format_for(capture.artifact, target)
    if fmt is None:
        raise ArtifactError(
            f"Capture.save: {capture.scope}#{capture.variant} was captured by the "
            f"{capture.meta.backend!r} backend, whose artifact {why}", "backend_not_savable")
    if not target.parent.is_dir():
        raise FileNotFoundError(f"Capture.save: no directory {str(target.parent)!r}")
    result: tuple[bool, Any, Fidelity] | None = None
    written: Any = None  # the program the file holds now
    errors: list[BaseException] = []
    for lowered, build in fmt.forms(capture.artifact):
        with collector_paused():
            try:
                program = build()
                _save_file(fmt, program, target)
            except Exception as exc:  # the serialiser refused this form; try the next
                errors.append(exc)
                continue
            written = program
            fidelity = _check_saved(capture, fmt, target, program, lowered) if verify else \
                Fidelity("off", True, (), ())
        if result is None or fidelity.ok:
            result = (lowered, program, fidelity)
        if fidelity.ok:
            break
    if result is None:
        raise ArtifactError(
            f"Capture.save: the {fmt.name} format refused {capture.scope}#{capture.variant} "
            f"in every form ({', '.join(type(e).__name__ for e in errors)})",
            "serialize_failed") from (errors[-1] if errors else None)
    lowered, program, fidelity = result
    if program is not written:  # neither form agreed: keep the preferred one
        _save_file(fmt, program, target)
    doc = sidecar_json(capture, target, lowered=lowered, fidelity=fidelity,
                       artifact_format=fmt.name, program=program)
    doc["artifact_digest"] = file_digest(target.parent, target.name)
    side = sidecar_path(target)
    write_inside(side, json.dumps(doc, indent=2, sort_keys=True).encode())
    return SavedArtifact(target, side, lowered, fidelity, doc["artifact_digest"])


def _save_file(fmt: ArtifactFormat, program: Any, target: Path) -> None:
    """``fmt.save`` to a fresh name in ``target``'s directory, renamed over
    ``target`` (``safefiles.written_inside``): a symlink planted at
    ``target`` is replaced, never written through."""
    written_inside(target, lambda tmp: fmt.save(program, tmp))


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector held off while one artifact is
    written and read back, then left as it was (off stays off).  The switch
    is process-wide: a thread that turns the collector off while a file is
    written finds it on again after that file.

    torch's serialiser deep-copies the program's schema (tens of thousands
    of small objects for one transformer block), and the loader builds as
    many: enough allocations to start full collections, each of which
    scans every live object of the process (hundreds of thousands after
    ``import torch``, millions with a model library loaded) and finds
    next to nothing to free.  Measured on a 2-core host, ``torch.export.save``
    of a small block took 36-40 ms with the collector off and 70-85 ms
    whenever a full collection fell inside it.  Nothing is leaked: what
    reference counting frees is freed at once, and the collector's next
    run after the block sees any cycle made inside it.  torch's
    distributed checkpointing holds the collector off the same way around
    its state-dict walks."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def artifact_inputs(capture: SavableCapture) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Fresh inputs in the form the capture's artifact takes them."""
    return inputs_for(capture.signature, capture.meta.binding)


def _check_saved(capture: SavableCapture, fmt: ArtifactFormat, target: Path, written: Any,
                 lowered: bool) -> Fidelity:
    """The file against the live call, at the least cost that still proves it.

    The file is loaded back.  Where it holds the program ``finalize()``
    already checked (the form as captured, and the format sees the same
    program in the file: ``ArtifactFormat.same_program``, graph and weights),
    that check stands for the file (``checked == ("graph",)``) and nothing
    runs: the file is vouched for exactly as far as the capture's own
    fidelity is -- run on fresh inputs where its ``checked`` holds
    ``execute`` or ``values``, its graph's output metadata held to the live
    outputs where it holds ``signature`` only -- never further.  A capture
    no check stands behind (``verify="off"``) or whose check failed, and a
    file that is not that program, run instead: on fresh inputs with the live call's strides
    (``materialize.tensor``) from a neutral state plus only what no artifact
    can carry (``neutral_replay``), as a consumer in another process runs
    it; and a file whose program is not the one ``finalize()`` traced (a
    lowered one) runs again inside the live call's whole context, as
    ``install`` runs it: which kernel a composite op picks can hang on that
    context (on CPU ``scaled_dot_product_attention`` runs its flash kernel
    under ``no_grad``, its math kernel with grad enabled, and their outputs
    have different strides), so a re-traced file can run in one and fail
    in the other."""
    if capture.outputs is None:  # no live outputs to hold the file to
        return Fidelity("off", True, (), ())
    try:
        loaded = fmt.reload(target)
        same = not lowered and fmt.same_program(written, loaded)
        if same and capture.fidelity.ok and _checked(capture.fidelity):
            return Fidelity("saved", True, (), ("graph",))
        module = fmt.module(loaded)
    except Exception as exc:  # torch's loader may raise anything: a mismatch
        return Fidelity("saved", False, (Mismatch("out", "execution", "loaded",
                                                  type(exc).__name__, "saved"),), ("saved",))
    found = _run_saved(capture, module, ())
    live_context = not found and not same
    if live_context:
        found = _run_saved(capture, module, (), full=True)
    with_needs = None
    hint = None
    if found and live_context:
        hint = "in the live call's context (where install runs it)"
    elif found and capture.meta.ambient_only:
        with_needs = not _run_saved(capture, module, capture.meta.ambient_only)
        hint = "not carried by the artifact: " + ", ".join(capture.meta.ambient_only)
    return Fidelity("saved", not found, tuple(Mismatch.of(m, "saved", hint) for m in found),
                    ("saved",), ok_with_needs=with_needs)


def _checked(fidelity: Fidelity) -> bool:
    """Whether a verification level (``signature``, ``execute``, ``values``)
    stands behind ``fidelity`` -- not merely the argument walk the trace ran
    (``verify="off"``)."""
    known = set(level_names())
    return any(at_least(c, "signature") for c in fidelity.checked if c in known)


def _run_saved(capture: SavableCapture, module: Any, needs: tuple[str, ...], *,
               full: bool = False) -> list[SpecMismatch]:
    try:
        args, kwargs = artifact_inputs(capture)
        with neutral_replay(capture.snapshot, needs=needs, full=full):
            produced = spec_of(module(*args, **kwargs))
    except Exception as exc:  # the program may raise anything: a mismatch
        return [SpecMismatch("out", "execution", "ran", type(exc).__name__)]
    assert capture.outputs is not None
    flat = flat_tensor_spec(produced)
    assigned = getattr(capture, "assigned", None)
    n = 0 if assigned is None else len(assigned.tensors)
    if n and isinstance(flat, SeqSpec):  # what the forward assigns, returned last
        flat = SeqSpec(flat.kind, flat.items[:-n])
    return list(compare_specs(flat_tensor_spec(capture.outputs), flat))


def _saved_roles(capture: SavableCapture, program: Any,
                 leaves: list[list[Any]]) -> tuple[OutputRole, ...] | None:
    """The roles of the saved program's outputs: what the capture's program
    returns, with the writes in place the saved form's own specs name (a
    lowered program returns them first)."""
    roles = capture.meta.output_roles
    returned = None if roles is None else [r for r in roles if r.returned]
    return program_roles(capture.artifact if program is None else program, returned,
                         capture.meta.binding, [p for p, _ in leaves])


def _folding_json(capture: SavableCapture) -> Any:
    folding = getattr(capture, "folding", None)
    return None if folding is None else folding.to_json()


def sidecar_json(capture: SavableCapture, artifact: Path, *, lowered: bool,
                 fidelity: Fidelity, artifact_format: str,
                 program: Any = None) -> dict[str, Any]:
    """The sidecar document: metadata only (no tensor values, no source).
    ``members`` / ``weights_from`` (whose parameters the file holds) and the
    ``environment`` are written where the capture has them.  ``program``:
    the program the file holds (default: the capture's artifact), whose
    outputs ``output_roles`` describes."""
    leaves = [[p, spec_to_json(s)] for p, s in capture.signature.leaves()]
    members = getattr(capture, "members", ())
    doc = {
        "schema": SIDECAR_SCHEMA,
        "artifact": artifact.name,
        "format": artifact_format,
        "torch": str(torch.__version__),
        "environment": full_environment(),
        "scope": capture.scope,
        "members": list(members),
        "weights_from": str(getattr(capture, "weights_from", "") or
                            (members[0] if members else "")),
        "identities": [list(i) for i in getattr(capture, "identities", ())],
        "ignore_attributes": list(getattr(capture, "ignore_attributes", ())),
        "variant": capture.variant,
        "calls": getattr(capture, "calls", None),
        "checked": getattr(capture, "checked", None),
        **program_json(capture.meta, SIDECAR_PROGRAM_KEYS),
        "lowered": lowered,
        "snapshot": capture.snapshot.to_json(),
        "context": capture.snapshot.describe(),
        "inputs": {**call_to_json(capture.signature), "leaves": leaves},
        "dynamic": _folding_json(capture),
        "outputs": None if capture.outputs is None else spec_to_json(capture.outputs),
        "output_leaves": None if capture.outputs is None else [
            spec_to_json(s) for s in flat_tensor_spec(capture.outputs).items],
        "fidelity": capture.fidelity.to_json(),
        "saved_fidelity": fidelity.to_json(),
        "output_roles": roles_to_json(_saved_roles(capture, program, leaves)),
    }
    assigned = getattr(capture, "assigned", None)
    if assigned is not None:  # what the program returns after its outputs (written when
        # present only: a reader that predates it refuses the key, and so the file)
        doc["assigned"] = assigned.to_json()
    return doc
