"""The built-in artifact format: a ``torch.export`` program as a ``.pt2``
archive (``torch.export.save`` / ``torch.export.load``), registered as ``pt2``.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import io
import json
import struct
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

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

    def program_bytes(self, artifact: Any) -> bytes | None:
        """The program's serialised graph and its own tensor constants, with
        every parameter and buffer (persistent or not) left out: a shallow
        copy whose module tensors are ``meta`` placeholders of the same shape
        and dtype is serialised, and the example inputs are dropped."""
        if not isinstance(artifact, torch.export.ExportedProgram):
            return None
        from torch._export.serde.serialize import serialize

        artifact = _without_empty_wrappers(artifact)  # torch's deserialiser rejects them
        held = set(artifact.graph_signature.non_persistent_buffers)
        shallow = copy.copy(artifact)
        shallow._state_dict = {k: _placeholder(v) for k, v in artifact.state_dict.items()}
        shallow._constants = {k: _placeholder(v) if k in held else v
                              for k, v in artifact.constants.items()}
        shallow._example_inputs = None
        done = serialize(shallow)
        program = done.exported_program
        head = json.dumps({"state": sorted(artifact.state_dict), "held": sorted(held)}).encode()
        data = b"".join((struct.pack("<III", len(head), len(program), len(done.constants)),
                         head, program, done.constants))
        try:  # what cannot be read back is not kept: rebuilt once, on placeholders
            self.program_from_bytes(data, {**shallow._state_dict, **shallow._constants})
        except Exception:
            return None
        return data

    def program_from_bytes(self, data: bytes, weights: Mapping[str, Any]) -> Any:
        """Rebuilt with ``torch._export.serde.serialize.deserialize`` from the
        graph alone: no archive, no weights read (cheaper than
        ``torch.export.load``); ``weights`` become its state."""
        from torch._export.serde.schema import ExportedProgram as Schema
        from torch._export.serde.serialize import ExportedProgramDeserializer

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
        serialized = _decode(Schema, json.loads(program))
        return ExportedProgramDeserializer(None).deserialize(serialized, state, constants, None)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    from torch._export.serde import schema

    return typing.get_type_hints(cls, globalns=vars(schema))


def _decode(cls: Any, data: Any) -> Any:
    """torch's JSON-to-schema decoding (``serialize._dict_to_dataclass``),
    with each class's type hints resolved once instead of at every node --
    most of what loading a small program costs."""
    from torch._export.serde import schema
    from torch._export.serde.union import _Union

    if isinstance(cls, typing.ForwardRef):
        cls = cls.__forward_arg__
    if isinstance(cls, str):
        cls = getattr(schema, cls)
    origin = typing.get_origin(cls)
    if origin is typing.Annotated:
        return _decode(cls.__origin__, data)
    if origin in (typing.Union, types.UnionType) and type(None) in typing.get_args(cls):
        return None if data is None else _decode(typing.get_args(cls)[0], data)
    if isinstance(cls, type) and issubclass(cls, _Union):
        cls = typing.cast(Any, cls)
        (name, value), = data.items()
        create: Any = cls.create
        return create(**{name: _decode(_hints(cls)[name], value)})
    if dataclasses.is_dataclass(cls):
        hints = _hints(cls)  # type: ignore[arg-type]
        return cls(**{f.name: _decode(hints[f.name], data[f.name])  # type: ignore[operator]
                      for f in dataclasses.fields(cls) if f.name in data})
    if isinstance(data, list):
        return [_decode(typing.get_args(cls)[0], d) for d in data] if data else data
    if isinstance(data, dict):
        v_type = typing.get_args(cls)[1]
        return {k: _decode(v_type, v) for k, v in data.items()}
    return float(data) if cls is float else data


def _placeholder(t: Any) -> Any:
    """A ``meta`` tensor of ``t``'s shape and dtype (a parameter stays one)."""
    if not isinstance(t, torch.Tensor):
        return t
    meta = t.detach().to("meta")
    return nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) \
        else meta


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
