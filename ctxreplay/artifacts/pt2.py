"""The built-in artifact format: a ``torch.export`` program as a ``.pt2``
archive (``torch.export.save`` / ``torch.export.load``), registered as ``pt2``.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch

from ..backends.passes import has_wrapper_hops, lower_wrappers
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
        """The program as captured and lowered, the preferred first.

        A program that recorded embedded contexts as wrapper higher-order ops
        (``wrap_with_autocast``) is lowered first: ``run_decompositions({})``
        turns them into explicit casts, which every consumer of a ``.pt2``
        understands and older torch needs to serialise it at all (its
        verifier rejected the wrappers).  Lowering can lose a cast, though:
        autocast registered on a composite op (``nll_loss`` under
        ``nll_loss_nd``, ``mkldnn_rnn_layer`` under ``lstm``) acts inside a
        decomposition the retrace never records; so the program with its
        wrappers kept (they re-enter autocast when it runs) comes second.  A
        program without wrappers comes as captured first, lowered second
        (where the serialiser refuses it, or its file disagrees with the
        live call)."""
        as_is: Form = (False, lambda: artifact)
        lowered: Form = (True, lambda: lower_wrappers(artifact))
        if has_wrapper_hops(artifact.graph_module):
            return (lowered, as_is)
        return (as_is, lowered)

    def to_bytes(self, artifact: Any) -> bytes:
        """``torch.export.save`` into memory."""
        buf = io.BytesIO()
        torch.export.save(artifact, buf)
        return buf.getvalue()

    def from_bytes(self, data: bytes) -> Any:
        """``torch.export.load`` from memory."""
        return torch.export.load(io.BytesIO(data))


register_format(Pt2Format())
