"""A capture cache entry read back and checked, or a checked capture written as one.

An entry holds a program without weights and a metadata-only record:
``Stored`` is what the record says of the capture.  ``read_entry`` reads it
(an entry that binds the call another way is discarded), ``deferred_capture``
checks it by the record's output metadata alone (its program left on disk
until first used), ``run_entry`` runs it through ``capture_variant`` with
the member's own weights, checked exactly as a traced artifact is, and
``fill_record`` writes a capture that passed its check.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import torch
from torch import nn

from ..artifacts.formats import ArtifactFormat, format_for, get_format
from ..artifacts.saving import collector_paused
from ..artifacts.sidecar import ArtifactError
from ..backends import Backend, get_backend
from ..capture.asking import Ask, Source, Tracing
from ..capture.checker import Checker, Program
from ..capture.failed import CaptureFailed
from ..capture.options import CaptureOptions, VariantRequest
from ..capture.results import Capture, Deferred, capture_of
from ..capture.variant import capture_variant
from ..specs.signature import Spec
from .keys import KEY_SCHEMA
from .store import CacheDir, StoredEntry
from .stored import Stored

__all__ = ["NOT_STORED_REASONS", "EntryRead", "Stored", "deferred_capture", "fill_record",
           "program_source", "read_entry", "run_entry"]


@attrs.frozen(eq=False)
class EntryRead:
    """An entry read back: what its record says, its format and its backend."""

    entry: StoredEntry
    stored: Stored
    format: ArtifactFormat
    backend: Backend

    def program(self, graph_outputs: Spec | None) -> Program:
        """The entry's program as a ``Checker`` runs it: by its output
        metadata alone (``graph_outputs``: those of the size checked)."""
        s = self.stored
        return Program(self.backend, None, graph_outputs, s.binding, s.flatten_out,
                       s.carried, s.ambient_only)


def read_entry(store: CacheDir, entry: StoredEntry, request: VariantRequest
               ) -> EntryRead | None:
    """What ``entry``'s record says, its format and backend; ``None`` (the
    entry discarded) where it cannot be read or binds ``request``'s call
    another way."""
    try:
        stored = Stored.read(entry.record)
        fmt = get_format(stored.format)
        backend = get_backend(stored.backend)
        # nothing it holds runs: a payload that needs more than tensors is
        # refused now, even where its program is rebuilt only later
        fmt.check_program_bytes(entry.program)
    except Exception as exc:  # torch's payload check may raise anything: discarded
        store.discard(entry.key, f"unreadable ({type(exc).__name__})")
        return None
    if stored.binding != request.binding:
        store.discard(entry.key, "for another calling convention of the variant")
        return None
    return EntryRead(entry, stored, fmt, backend)


def run_entry(store: CacheDir, read: EntryRead, ask: Ask, tracing: Tracing) -> Capture | None:
    """``ask`` captured with the entry's program as its source (checked as a
    traced artifact is); ``None`` (the entry discarded) where it cannot be used."""
    stored = read.stored
    source = program_source(read.format, read.entry.program, stored, read.backend)
    try:
        capture = capture_variant(attrs.evolve(ask, source=source), tracing)
    except CaptureFailed as failed:
        store.discard(read.entry.key, f"not usable ({failed.failure.reason})")
        return None
    return capture.evolve(graph_digest=stored.graph_digest, fingerprint=stored.fingerprint,
                          baked=stored.meta.baked)


#: why the cache did not keep a capture that passed its check, as
#: ``CaptureReport.cache["not_stored"]`` names it (the warning says more)
NOT_STORED_REASONS = ("collective", "no_artifact", "no_format", "not_serialisable",
                      "unwritable")


def fill_record(store: CacheDir, key: str, capture: Capture, request: VariantRequest,
                tracing: Tracing, extra: Mapping[str, Any]) -> tuple[str, str] | None:
    """Write ``capture`` (which passed its check) under ``key``, with
    ``extra`` fields in its record, where its format can keep the program
    without weights; returns why it was not written, as a code of
    ``NOT_STORED_REASONS`` and in words (``None``: written, or another
    process wrote the key first).  A graph holding collectives is not
    stored: it is checked with the other ranks, after this."""
    options = tracing.options
    module = tracing.modules[request.traced.name]
    if capture.collective:
        return "collective", "its graph holds collectives, checked with the other ranks"
    if capture.artifact is None:
        return "no_artifact", "it holds no artifact"
    if capture.assigned is not None:
        # the record keeps no assignment paths: loaded back, the program's
        # extra outputs would read as outputs of the call
        return "not_serialisable", ("its program returns what its forward assigns to "
                                    "argument objects, which the cache's record does not keep")
    fmt, _ = format_for(capture.artifact)
    if fmt is None:
        return "no_format", f"no artifact format keeps a {type(capture.artifact).__name__}"
    try:
        with collector_paused():  # torch's serialiser, as save_all holds it off
            program = fmt.program_bytes(capture.artifact)
        stored = _stored(capture, request, options, fmt)
        Stored.read({"capture": stored.to_json(), "about": {"verify": options.verify}})
    except Exception as exc:  # what cannot be written back faithfully is not kept
        return "not_serialisable", (f"its program cannot be serialised: "
                                    f"{type(exc).__name__}: {_short(exc)}")
    if program is None:
        return "no_format", f"the {fmt.name} format keeps no program of it"
    record = {"schema": KEY_SCHEMA, "key": key, "created": time.time(),
              "about": _about(capture, module, options), "capture": stored.to_json(), **extra}
    if not store.write(key, record, program) and not store.entry_path(key).is_dir():
        # (the store warns of that once per directory, not once per capture)
        return "unwritable", ""
    return None


def _short(exc: BaseException, limit: int = 160) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _stored(capture: Capture, request: VariantRequest, options: CaptureOptions,
            fmt: ArtifactFormat | None) -> Stored:
    pinned = tuple(p.name for p in request.snapshot.probes
                   if options.pin_factories and p.pinnable)
    return Stored(fmt.name if fmt else "", request.flatten_out, capture.embedded + pinned,
                  options.verify, capture.meta)


def _about(capture: Capture, module: nn.Module, options: CaptureOptions) -> dict[str, Any]:
    """What ``ctxreplay cache list`` shows of an entry (metadata only)."""
    from ..specs.specjson import call_to_json

    return {"scope": capture.scope, "variant": capture.variant,
            "class": type(module).__qualname__, "inputs": call_to_json(capture.signature),
            "backend": capture.backend, "replay": options.replay, "verify": options.verify,
            "torch": str(torch.__version__), "nodes": len(capture.ops)}


def _weights(module: nn.Module, prefix: str, *, copy_buffers: bool) -> dict[str, Any]:
    """``module``'s parameters (the same tensors) and buffers by qualified
    name, under ``prefix``; buffers copied where the capture outlives the
    finalize (a traced capture holds its isolated view's copies)."""
    out: dict[str, Any] = {prefix + n: p for n, p in
                           module.named_parameters(remove_duplicate=False)}
    for n, b in module.named_buffers(remove_duplicate=False):
        out[prefix + n] = b.detach().clone() if copy_buffers else b
    return out


def _prefix(binding: str) -> str:
    return "inner." if binding == "flattened" else ""  # capture's ``_Flattened`` wrapper


def program_source(fmt: ArtifactFormat, data: bytes, stored: Stored, backend: Backend) -> Source:
    def load(view: nn.Module, binding: str) -> tuple[Any, Spec | None, Backend]:
        weights = _weights(view, _prefix(binding), copy_buffers=False)
        # torch's deserialiser builds tens of thousands of small objects: with the
        # collector on, a full collection of the whole heap may fall inside it
        with collector_paused():
            program = fmt.program_from_bytes(data, weights)
        return program, stored.graph_outputs, backend

    return load


class _OnDisk(Deferred):
    """A cached program read (and checksummed) at the hit, rebuilt with the
    member's weights when first used."""

    def __init__(self, fmt: ArtifactFormat, data: bytes, weights: dict[str, Any],
                 where: Path) -> None:
        self.fmt, self.data, self.weights, self.where = fmt, data, weights, where

    def load(self) -> Any:
        try:
            with collector_paused():  # as for a hit checked by execution
                return self.fmt.program_from_bytes(self.data, self.weights)
        except Exception as exc:  # torch's deserialiser may raise anything
            raise ArtifactError(f"the cached program of {self.where} cannot be rebuilt "
                                f"({type(exc).__name__}: {exc})", "not_rebuildable") from exc


def deferred_capture(read: EntryRead, request: VariantRequest, tracing: Tracing) -> Capture:
    """A hit checked by the record's output metadata: no program in memory."""
    t0 = time.perf_counter()
    stored, options = read.stored, tracing.options
    module = tracing.modules[request.traced.name]
    checker = Checker(request, options, read.program(stored.graph_outputs), module,
                      tracing.neutral_probes)
    fidelity = checker.run(tracing.modules)
    weights = _weights(module, _prefix(stored.binding), copy_buffers=True)
    return capture_of(
        request, options.ignore_attributes,
        graph_outputs=stored.graph_outputs, backend=stored.backend,
        artifact=_OnDisk(read.format, read.entry.program, weights, read.entry.path),
        fidelity=fidelity, fingerprint=stored.fingerprint, embedded=stored.embedded,
        ambient_only=stored.ambient_only, binding=stored.binding, constants=stored.constants,
        attempts=(), seconds=time.perf_counter() - t0, ops=stored.ops,
        graph_digest=stored.graph_digest, op_args=stored.op_args,
        output_roles=stored.output_roles, from_cache=True)
