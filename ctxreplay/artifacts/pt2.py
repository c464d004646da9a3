"""The built-in artifact format: a ``torch.export`` program as a ``.pt2``
archive (``torch.export.save`` / ``torch.export.load``), registered as ``pt2``.
"""

from __future__ import annotations

import copy
import io
from pathlib import Path
from typing import Any

import torch

from ..backends.passes import (
    WRAPPER_HOPS,
    drop_empty_wrappers,
    graph_form,
    graph_nodes,
    lower_wrappers,
)
from .formats import ArtifactFormat, Form, register_format

__all__ = ["Pt2Format"]


class Pt2Format(ArtifactFormat):
    """A ``torch.export.ExportedProgram`` in a ``.pt2`` archive; what the
    ``export`` backend (and ``auto``, where export succeeds) captures."""

    name = "pt2"
    suffix = ".pt2"

    @property
    def description(self) -> str:
        """``.pt2 archive``: ``torch.export.save`` writes a zip archive."""
        return f"{self.suffix} archive"

    def can_save(self, artifact: Any) -> str | None:
        """Only a ``torch.export`` program fits."""
        if isinstance(artifact, torch.export.ExportedProgram):
            return None
        return (f"a {self.suffix} holds a torch.export program; capture with "
                "backend='export' (or 'auto' where export succeeds) to save it")

    def save(self, artifact: Any, path: Path) -> None:
        """``torch.export.save``."""
        torch.export.save(artifact, path)

    def load(self, path: Path) -> Any:
        """``torch.export.load``."""
        return torch.export.load(path)

    def detect(self, path: Path) -> bool:
        """A zip archive: what ``torch.export.save`` writes."""
        with path.open("rb") as f:
            return f.read(4) == b"PK\x03\x04"

    def module(self, artifact: Any) -> Any:
        """``program.module()``."""
        return artifact.module()

    def forms(self, artifact: Any) -> tuple[Form, ...]:
        """The program as captured, then lowered.

        As captured, the file holds the program ``finalize()`` traced and
        checked, and it costs no re-trace: lowering the context wrappers
        (``run_decompositions``) costs several times the export itself.  A
        program that recorded embedded contexts keeps them as wrapper
        higher-order ops (``wrap_with_autocast``), which re-enter the context
        when the program runs and which torch's serialiser accepts from 2.6
        on; a wrapper over no op is dropped first (``drop_empty_wrappers``:
        the serialiser writes it in a form its loader refuses).  The lowered
        program (explicit casts, the form older torch needs to serialise it
        at all) comes second, where the serialiser refuses the first or its
        file disagrees with the live call.  Lowering can lose a cast, though:
        autocast registered on a composite op (``nll_loss`` under
        ``nll_loss_nd``, ``mkldnn_rnn_layer`` under ``lstm``) acts inside a
        decomposition the re-trace never records."""
        return ((False, lambda: _without_empty_wrappers(artifact)),
                (True, lambda: lower_wrappers(artifact)))

    def same_program(self, written: Any, loaded: Any) -> bool:
        """Whether the file's program computes what ``written`` does: the same
        graph form (``graph_form``: names left out), input and output specs,
        and equal weights and constants."""
        return bool(_signature_form(written) == _signature_form(loaded)
                    and graph_form(written.graph_module) == graph_form(loaded.graph_module)
                    and _same_tensors(written.state_dict, loaded.state_dict)
                    and _same_tensors(written.constants, loaded.constants))

    def to_bytes(self, artifact: Any) -> bytes:
        """``torch.export.save`` into memory."""
        buf = io.BytesIO()
        torch.export.save(artifact, buf)
        return buf.getvalue()

    def from_bytes(self, data: bytes) -> Any:
        """``torch.export.load`` from memory."""
        return torch.export.load(io.BytesIO(data))


def _without_empty_wrappers(program: Any) -> Any:
    """``program``, or a copy of it whose graph lost its empty context wrappers."""
    if not any(n.op == "call_function" and not n.users and
               getattr(n.target, "__name__", "") in WRAPPER_HOPS
               for n in graph_nodes(program.graph_module)):
        return program
    gm = copy.deepcopy(program.graph_module)  # the graph alone: the weights are not in it
    if not drop_empty_wrappers(gm):
        return program
    return program._update(gm, program.graph_signature)


def _same_tensors(a: Any, b: Any) -> bool:
    if set(a) != set(b):
        return False
    for k, x in a.items():
        y = b[k]
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if isinstance(x, torch.Tensor) and (x.dtype != y.dtype or x.shape != y.shape or
                                            not torch.equal(x.detach().cpu(), y.detach().cpu())):
            return False
    return True


def _signature_form(program: Any) -> tuple[Any, ...]:
    sig = program.graph_signature
    return (tuple((s.kind.name, s.target, type(s.arg).__name__) for s in sig.input_specs),
            tuple((s.kind.name, s.target, type(s.arg).__name__) for s in sig.output_specs))


register_format(Pt2Format())
