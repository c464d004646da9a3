"""The built-in artifact format: a ``torch.export`` program as a ``.pt2``
archive (written by ``torch.export.save``, read by ``pt2read``), registered as ``pt2``.
"""

from __future__ import annotations

import base64
import copy
import dataclasses
import io
import json
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from ..backends.passes import (
    WRAPPER_HOPS,
    drop_empty_wrappers,
    graph_form,
    graph_nodes,
    lower_wrappers,
)
from ..specs.storage import same_data
from .formats import ArtifactFormat, Form, register_format
from .pt2read import decode, read_program, tensor_payload

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
        """``torch.export.save`` of the program, its example inputs as meta
        placeholders (``_placeholder_inputs``)."""
        torch.export.save(_placeholder_inputs(artifact), path)

    def load(self, path: Path) -> Any:
        """The program, read with nothing in the file run (``pt2read``:
        every payload a tensor, read ``weights_only``)."""
        return read_program(path.read_bytes(), str(path))

    def load_bytes(self, data: bytes, name: str) -> Any:
        """``load`` of the file's bytes (``pt2read.read_program``)."""
        return read_program(data, name)

    def reload(self, path: Path) -> Any:
        """The program just written, read back as ``load`` reads it: torch's
        archive reader and graph deserialiser, its JSON decoded with each
        schema class's type hints resolved once (``pt2read.decode``) rather
        than at every node as ``torch.export.load`` does -- the larger part
        of what loading a small program costs."""
        return self.load(path)

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
        """``torch.export.save`` into memory, the example inputs as meta
        placeholders (a context wrapper over no op left out too: torch's
        loader refuses the form the serialiser gives it)."""
        buf = io.BytesIO()
        torch.export.save(_placeholder_inputs(_without_empty_wrappers(artifact)), buf)
        return buf.getvalue()

    def from_bytes(self, data: bytes) -> Any:
        """``load`` from memory."""
        return read_program(data, "a .pt2 archive in memory")

    def program_bytes(self, artifact: Any) -> bytes | None:
        """The program's serialised graph and its own tensor constants, with
        every parameter and buffer (persistent or not) left out: a shallow
        copy whose module tensors are ``meta`` placeholders of the same shape
        and dtype is serialised, its example inputs too (``_placeholder_inputs``:
        torch builds a folded program's size guard from their structure)."""
        if not isinstance(artifact, torch.export.ExportedProgram):
            return None
        from torch._export.serde.serialize import serialize

        artifact = _without_empty_wrappers(artifact)  # torch's deserialiser rejects them
        held = set(artifact.graph_signature.non_persistent_buffers)
        shallow = _placeholder_inputs(artifact)
        shallow._state_dict = {k: _placeholder(v) for k, v in artifact.state_dict.items()}
        shallow._constants = {k: _placeholder(v) if k in held else v
                              for k, v in artifact.constants.items()}
        done = serialize(shallow)
        program = done.exported_program
        head = json.dumps({"state": sorted(artifact.state_dict), "held": sorted(held),
                           "inputs": base64.b64encode(done.example_inputs).decode()}).encode()
        data = b"".join((struct.pack("<III", len(head), len(program), len(done.constants)),
                         head, program, done.constants))
        try:  # what cannot be read back is not kept: rebuilt once, on placeholders
            self.program_from_bytes(data, {**shallow._state_dict, **shallow._constants})
        except Exception:  # torch's deserialiser may raise anything: not kept
            return None
        return data

    def check_program_bytes(self, data: bytes) -> None:
        """Its constants and example inputs read ``weights_only``
        (``pt2read.tensor_payload``): ``UnsafeFileError`` where one holds
        more than tensors.  The graph is JSON, read by the schema alone."""
        head, _, consts = _parts(data)
        if consts:
            tensor_payload(consts, "a cached program's constants")
        if "inputs" in head:
            tensor_payload(base64.b64decode(head["inputs"]), "a cached program's example inputs")

    def program_from_bytes(self, data: bytes, weights: Mapping[str, Any]) -> Any:
        """Rebuilt with ``torch._export.serde.serialize.deserialize`` from the
        graph alone: no archive, no weights read (cheaper than
        ``torch.export.load``); ``weights`` become its state.  Bytes an
        older ctxreplay wrote hold no example inputs: a program of them whose
        sizes are symbolic is refused (``ValueError``), since torch would make
        its module without the size guard."""
        from torch._export.serde.schema import ExportedProgram as Schema
        from torch._export.serde.serialize import ExportedProgramDeserializer

        head, program, consts = _parts(data)
        constants = dict(tensor_payload(consts, "a cached program's constants")) \
            if consts else {}
        for name in head["held"]:
            constants[name] = weights[name]
        state = {name: weights[name] for name in head["state"]}
        serialized = decode(Schema, json.loads(program))
        inputs = base64.b64decode(head["inputs"]) if "inputs" in head else None
        # read here, weights_only: torch's deserialiser unpickles bytes it is
        # given with weights_only=False where the weights_only read fails
        examples = tensor_payload(inputs, "a cached program's example inputs") \
            if inputs else None
        rebuilt = ExportedProgramDeserializer(None).deserialize(serialized, state, constants,
                                                                examples)
        if not inputs and rebuilt.range_constraints:
            raise ValueError("a cached program with symbolic sizes holds no example inputs "
                             "(written by an older ctxreplay): its size guard cannot be rebuilt")
        return rebuilt


def _parts(data: bytes) -> tuple[dict[str, Any], bytes, bytes]:
    """``program_bytes``'s three parts: its header (parsed), the graph's JSON,
    the constants' payload."""
    n_head, n_program, n_consts = struct.unpack_from("<III", data)
    at = struct.calcsize("<III")
    if len(data) != at + n_head + n_program + n_consts:
        raise ValueError(f"a cached program of {len(data)} bytes is truncated or padded")
    head = json.loads(data[at:at + n_head])
    if not isinstance(head, dict):
        raise ValueError("a cached program's header is not a JSON object")
    return head, data[at + n_head:at + n_head + n_program], data[at + n_head + n_program:]


def _placeholder_inputs(program: Any) -> Any:
    """A shallow copy of ``program`` whose example inputs are ``meta`` tensors
    of their shapes, strides and dtypes (what is not a tensor kept).

    ``torch.export.save`` pickles ``program.example_inputs`` into the archive
    (``sample_inputs/model.pt``; ``serialized_example_inputs.pt`` before the
    ``pt2_archive`` layout): tensors at the traced call's full size --
    measured 130 kB for a 32-token Qwen2 prompt, 1.4 MB for a 256-token Wan
    latent, ~130 MB at 480p video.  Their values are read by nothing that
    loads or runs the program, but their structure is: ``module()`` builds
    the size guard of a program with symbolic sizes from the inputs' pytree
    paths, and makes none where a program has no example inputs (torch 2.13's
    ``_unlift``: ``if check_guards and placeholders and ep.example_inputs``),
    so a file without them would run a size its trace excluded.  A meta
    tensor pickles to ~100 bytes and loads under ``weights_only``.  A copy,
    so the capture's own program keeps its inputs; a tensor with no meta
    form (a subclass that refuses) keeps them all."""
    inputs = getattr(program, "_example_inputs", None)
    if inputs is None:
        return program
    try:
        placeholders = pytree.tree_map_only(torch.Tensor, _meta_like, inputs)
    except Exception:  # a subclass may refuse a meta copy: inputs kept
        return program
    shallow = copy.copy(program)
    shallow._example_inputs = placeholders
    return shallow


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    meta = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
    return meta.requires_grad_() if t.requires_grad else meta


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
    # the copy renames a node whose name shadows a builtin (a forward argument
    # named ``input``, as ``nn.Linear``'s is, becomes ``input_1``), which the
    # signature still names: it follows the copy's names
    renamed = {a.name: b.name for a, b in zip(program.graph_module.graph.nodes, gm.graph.nodes)
               if a.name != b.name}
    if not drop_empty_wrappers(gm):
        return program
    return program._update(gm, renamed_signature(program.graph_signature, renamed))


def renamed_signature(sig: Any, renamed: dict[str, str]) -> Any:
    """``sig`` (an ``ExportGraphSignature``) naming the nodes ``renamed`` maps by
    their new names."""
    if not renamed:
        return sig

    def spec(s: Any) -> Any:
        name = getattr(s.arg, "name", None)
        if name not in renamed:
            return s
        return dataclasses.replace(s, arg=dataclasses.replace(s.arg, name=renamed[name]))

    return type(sig)([spec(s) for s in sig.input_specs], [spec(s) for s in sig.output_specs])


def _same_tensors(a: Any, b: Any) -> bool:
    if set(a) != set(b):
        return False
    for k, x in a.items():
        y = b[k]
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if isinstance(x, torch.Tensor) and not same_data(x, y):  # a quantized weight too
            return False
    return True


def _signature_form(program: Any) -> tuple[Any, ...]:
    sig = program.graph_signature
    return (tuple((s.kind.name, s.target, type(s.arg).__name__) for s in sig.input_specs),
            tuple((s.kind.name, s.target, type(s.arg).__name__) for s in sig.output_specs))


register_format(Pt2Format())
