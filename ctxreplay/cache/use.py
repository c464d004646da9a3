"""Answering a variant from the capture cache, and filling it.

``CaptureCache.capture(request, ..., run)`` looks the variant's key up: on a
hit the stored program is checked at the session's verify level before it
is used -- at ``"signature"`` (and ``"off"``) against the record's graph
output metadata, its program left on disk until ``Capture.artifact`` is
first read; at the levels that run the artifact, loaded with the member's
own weights and checked exactly as a traced artifact is (``run`` given the
program as its source).  A hit that fails its check is discarded with a
warning and the variant is traced again; a traced capture that passed its
check is stored.  The cache never makes a report worse than none would.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import torch
from torch import nn

from ..artifacts.formats import ArtifactFormat, format_for, get_format
from ..artifacts.saving import collector_paused
from ..artifacts.sidecar import ArtifactError
from ..backends import Backend, get_backend
from ..capture.checker import Checker
from ..capture.options import CaptureOptions, VariantRequest
from ..capture.results import Capture, Deferred, capture_of
from ..capture.variant import CaptureFailed, Source
from ..core.probe import ContextProbe
from ..fidelity.levels import checked_by
from ..specs.signature import Spec, is_native
from ..specs.specjson import resolve_opaque, spec_from_json, spec_to_json
from .keys import KEY_SCHEMA, cache_key
from .store import CacheDir, CacheWarning, StoredEntry

__all__ = ["NOT_STORED_REASONS", "CaptureCache", "Stored", "deferred_capture", "fill_record",
           "program_source", "read_entry", "run_entry"]

Run = Callable[[Source | None], Capture]


@attrs.frozen
class Stored:
    """What an entry's record says of its capture (metadata only)."""

    format: str
    backend: str
    binding: str
    flatten_out: bool
    graph_outputs: Spec | None
    embedded: tuple[str, ...]
    ambient_only: tuple[str, ...]
    carried: tuple[str, ...]
    constants: tuple[str, ...]
    ops: tuple[tuple[str, str | None], ...]
    op_args: tuple[str, ...]
    graph_digest: str
    fingerprint: str
    verify: str

    @classmethod
    def read(cls, doc: Mapping[str, Any]) -> Stored:
        c = doc["capture"]
        outputs = c["graph_outputs"]
        return cls(str(c["format"]), str(c["backend"]), str(c["binding"]),
                   bool(c["flatten_out"]),
                   None if outputs is None else resolve_opaque(spec_from_json(outputs)),
                   _names(c["embedded"]), _names(c["ambient_only"]), _names(c["carried"]),
                   _names(c["constants"]), tuple((str(o), None if d is None else str(d))
                                                 for o, d in c["ops"]),
                   _names(c["op_args"]), str(c["graph_digest"]), str(c["fingerprint"]),
                   str(doc["about"]["verify"]))

    def to_json(self) -> dict[str, Any]:
        return {"format": self.format, "backend": self.backend, "binding": self.binding,
                "flatten_out": self.flatten_out,
                "graph_outputs": None if self.graph_outputs is None
                else spec_to_json(self.graph_outputs),
                "embedded": list(self.embedded), "ambient_only": list(self.ambient_only),
                "carried": list(self.carried), "constants": list(self.constants),
                "ops": [list(o) for o in self.ops], "op_args": list(self.op_args),
                "graph_digest": self.graph_digest, "fingerprint": self.fingerprint}


def _names(value: Any) -> tuple[str, ...]:
    return tuple(str(v) for v in value)


@attrs.define(eq=False)
class CaptureCache:
    """One finalize's use of a cache directory."""

    store: CacheDir

    @classmethod
    def at(cls, path: str | Path) -> CaptureCache:
        return cls(CacheDir(Path(path)))

    def capture(self, request: VariantRequest, modules: Mapping[str, nn.Module],
                options: CaptureOptions, baseline: tuple[ContextProbe[Any], ...],
                run: Run) -> Capture:
        """``request``'s capture: from the cache where an entry passes its
        check, else ``run(None)`` (a trace), stored when it passed its own."""
        module = modules.get(request.traced.name)
        if module is None:
            return run(None)
        try:
            keyed = cache_key(request, module, options)
        except Exception:  # what cannot be keyed is captured, never guessed
            keyed = None
        if keyed is None:
            return run(None)
        key = keyed[0]
        entry = self.store.read(key)
        if entry is not None:
            hit = self._use(entry, request, module, modules, options, baseline, run)
            if hit is not None:
                return hit
        capture = run(None)
        return self._fill(key, capture, request, module, options)

    def _use(self, entry: StoredEntry, request: VariantRequest, module: nn.Module,
             modules: Mapping[str, nn.Module], options: CaptureOptions,
             baseline: tuple[ContextProbe[Any], ...], run: Run) -> Capture | None:
        """The capture ``entry`` holds, checked; ``None`` (the entry
        discarded) where it cannot be read or does not pass."""
        read = read_entry(self, entry, request)
        if read is None:
            return None
        stored, fmt, backend = read
        if set(checked_by(options.verify)) <= {"signature"}:
            capture = deferred_capture(entry, stored, fmt, backend, request, module, modules,
                                        options, baseline)
        else:
            ran = run_entry(self, entry, stored, fmt, backend, run)
            if ran is None:
                return None
            capture = ran
        if not capture.fidelity.ok:
            self.store.discard(entry.key, "a program that does not reproduce the live calls "
                               f"at verify={options.verify!r}")
            return None
        return capture

    def _fill(self, key: str, capture: Capture, request: VariantRequest, module: nn.Module,
              options: CaptureOptions) -> Capture:
        """Store ``capture`` when it passed its check (``fill_record``); returns it,
        with why it was not stored where it could not be."""
        if not capture.fidelity.ok:
            return capture
        return self.kept(capture, fill_record(self, key, capture, request, module, options,
                                              {}))

    def kept(self, capture: Capture, refused: tuple[str, str] | None) -> Capture:
        """``capture``, told why the cache could not keep it (``refused``: a code
        of ``NOT_STORED_REASONS`` and the cause in words), and the user too:
        once, a ``CacheWarning`` naming the capture and the cause."""
        if refused is None:
            return capture
        code, why = refused
        if why:
            warnings.warn(f"capture cache {self.store.root}: {capture.scope}#{capture.variant} "
                          f"is not stored: {why}; later runs trace it again", CacheWarning,
                          stacklevel=2)
        return capture.evolve(not_cached=code)


def read_entry(cache: CaptureCache, entry: StoredEntry, request: VariantRequest
               ) -> tuple[Stored, ArtifactFormat, Backend] | None:
    """What ``entry``'s record says, its format and backend; ``None`` (the
    entry discarded) where it cannot be read or binds ``request``'s call
    another way."""
    try:
        stored = Stored.read(entry.record)
        fmt = get_format(stored.format)
        backend = get_backend(stored.backend)
    except Exception as exc:
        cache.store.discard(entry.key, f"unreadable ({type(exc).__name__})")
        return None
    if stored.binding != _binding(request):
        cache.store.discard(entry.key, "for another calling convention of the variant")
        return None
    return stored, fmt, backend


def run_entry(cache: CaptureCache, entry: StoredEntry, stored: Stored, fmt: ArtifactFormat,
              backend: Backend, run: Run) -> Capture | None:
    """``run`` given ``entry``'s program as its source (checked as a traced
    artifact is); ``None`` (the entry discarded) where it cannot be used."""
    try:
        capture = run(program_source(fmt, entry.program, stored, backend))
    except CaptureFailed as failed:
        cache.store.discard(entry.key, f"not usable ({failed.failure.reason})")
        return None
    return capture.evolve(graph_digest=stored.graph_digest,
                        fingerprint=stored.fingerprint)


#: why the cache did not keep a capture that passed its check, as
#: ``CaptureReport.cache["not_stored"]`` names it (the warning says more)
NOT_STORED_REASONS = ("collective", "no_artifact", "no_format", "not_serialisable",
                      "unwritable")


def fill_record(cache: CaptureCache, key: str, capture: Capture, request: VariantRequest,
                module: nn.Module, options: CaptureOptions,
                extra: Mapping[str, Any]) -> tuple[str, str] | None:
    """Write ``capture`` (which passed its check) under ``key``, with
    ``extra`` fields in its record, where its format can keep the program
    without weights; returns why it was not written, as a code of
    ``NOT_STORED_REASONS`` and in words (``None``: written, or another
    process wrote the key first).  A graph holding collectives is not
    stored: it is checked with the other ranks, after this."""
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
    if not cache.store.write(key, record, program) and not cache.store.entry_path(key).is_dir():
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
    return Stored(fmt.name if fmt else "", capture.backend, capture.binding,
                  _flatten_out(request), capture.graph_outputs, capture.embedded,
                  capture.ambient_only, capture.embedded + pinned, capture.constants,
                  capture.ops, capture.op_args, capture.graph_digest, capture.fingerprint,
                  options.verify)


def _about(capture: Capture, module: nn.Module, options: CaptureOptions) -> dict[str, Any]:
    """What ``ctxreplay cache list`` shows of an entry (metadata only)."""
    from ..specs.specjson import call_to_json

    return {"scope": capture.scope, "variant": capture.variant,
            "class": type(module).__qualname__, "inputs": call_to_json(capture.signature),
            "backend": capture.backend, "replay": options.replay, "verify": options.verify,
            "torch": str(torch.__version__), "nodes": len(capture.ops)}


def _flatten_out(request: VariantRequest) -> bool:
    return not (request.outputs is None or is_native(request.outputs))


def _binding(request: VariantRequest) -> str:
    """How capture binds the variant's call (as ``capture.variant`` does)."""
    return "native" if request.inputs.is_pytree_native() and not _flatten_out(request) \
        else "flattened"


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
        except Exception as exc:
            raise ArtifactError(f"the cached program of {self.where} cannot be rebuilt "
                                f"({type(exc).__name__}: {exc})", "not_rebuildable") from exc


def deferred_capture(entry: StoredEntry, stored: Stored, fmt: ArtifactFormat, backend: Backend,
                      request: VariantRequest, module: nn.Module,
                      modules: Mapping[str, nn.Module], options: CaptureOptions,
                      baseline: tuple[ContextProbe[Any], ...]) -> Capture:
    """A hit checked by the record's output metadata: no program in memory."""
    t0 = time.perf_counter()
    checker = Checker(request, options, backend, None, module, stored.graph_outputs,
                      binding=stored.binding, flatten_out=stored.flatten_out,
                      carried=stored.carried, baseline=baseline,
                      ambient_only=stored.ambient_only)
    fidelity = checker.run(modules)
    weights = _weights(module, _prefix(stored.binding), copy_buffers=True)
    return capture_of(
        request, options.ignore_attributes,
        graph_outputs=stored.graph_outputs, backend=stored.backend,
        artifact=_OnDisk(fmt, entry.program, weights, entry.path), fidelity=fidelity,
        fingerprint=stored.fingerprint, embedded=stored.embedded,
        ambient_only=stored.ambient_only, binding=stored.binding, constants=stored.constants,
        attempts=(), seconds=time.perf_counter() - t0, ops=stored.ops,
        graph_digest=stored.graph_digest, op_args=stored.op_args, from_cache=True)
