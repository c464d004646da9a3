"""The built-in artifact format: a ``torch.export`` program as a ``.pt2``
archive (``torch.export.save`` / ``torch.export.load``), registered as ``pt2``.
"""

from __future__ import annotations

import copy
import io
import json
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

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

    def program_bytes(self, artifact: Any) -> bytes | None:
        """The program's serialised graph and its own tensor constants, with
        every parameter and buffer (persistent or not) left out: a shallow
        copy whose module tensors are ``meta`` placeholders of the same shape
        and dtype is serialised, and the example inputs are dropped."""
        if not isinstance(artifact, torch.export.ExportedProgram):
            return None
        from torch._export.serde.serialize import serialize

        held = set(artifact.graph_signature.non_persistent_buffers)
        shallow = copy.copy(artifact)
        shallow._state_dict = {k: _placeholder(v) for k, v in artifact.state_dict.items()}
        shallow._constants = {k: _placeholder(v) if k in held else v
                              for k, v in artifact.constants.items()}
        shallow._example_inputs = None
        done = serialize(shallow)
        head = json.dumps({"state": sorted(artifact.state_dict), "held": sorted(held)}).encode()
        return b"".join((struct.pack("<III", len(head), len(done.exported_program),
                                     len(done.constants)), head, done.exported_program,
                         done.constants))

    def program_from_bytes(self, data: bytes, weights: Mapping[str, Any]) -> Any:
        """Rebuilt with ``torch._export.serde.serialize.deserialize`` from the
        graph alone: no archive, no weights read (cheaper than
        ``torch.export.load``); ``weights`` become its state."""
        from torch._export.serde.serialize import SerializedArtifact, deserialize

        n_head, n_program, n_consts = struct.unpack_from("<III", data)
        at = struct.calcsize("<III")
        if len(data) != at + n_head + n_program + n_consts:
            raise ValueError(f"a cached program of {len(data)} bytes is truncated or padded")
        head = json.loads(data[at:at + n_head])
        program = data[at + n_head:at + n_head + n_program]
        consts = data[at + n_head + n_program:]
        constants = torch.load(io.BytesIO(consts), weights_only=True) if consts else {}
        for name in head["held"]:
            constants[name] = weights[name]
        state = {name: weights[name] for name in head["state"]}
        return deserialize(SerializedArtifact(program, state, constants, b""))  # type: ignore[arg-type]


def _placeholder(t: Any) -> Any:
    """A ``meta`` tensor of ``t``'s shape and dtype (a parameter stays one)."""
    if not isinstance(t, torch.Tensor):
        return t
    meta = t.detach().to("meta")
    return nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) \
        else meta


register_format(Pt2Format())
