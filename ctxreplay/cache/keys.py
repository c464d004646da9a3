"""The capture cache's key: everything that can change a variant's graph,
and nothing that cannot.

It covers the members' identity (class, parameter and buffer shapes and
dtypes, ``training``, plain attributes -- never values), the source files
of every class of every submodule (a source edit misses), the input
signature, the replayed snapshot, the backend, the replay mode, the options
that shape the graph, and the torch / Python / ctxreplay versions.  A
variant the key cannot describe fully (a snapshot state JSON cannot carry,
an argument bound as an object constant, a class without source or code)
is not cached: a key that leaves something out could hit a wrong graph.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import threading
import types
from typing import Any

import torch
from torch import nn

from .._base.environment import environment
from ..capture.options import CaptureOptions, VariantRequest
from ..specs.specjson import call_to_json, resolve_opaque, spec_from_json

__all__ = ["KEY_SCHEMA", "source_digest", "cache_key"]

#: bumped whenever what the key covers, or what an entry holds, changes
KEY_SCHEMA = "ctxreplay.cache/1"

_lock = threading.Lock()
#: file path -> ((mtime_ns, size), digest): a file is read again once it changed
_files: dict[str, tuple[tuple[int, int], str]] = {}


def cache_key(request: VariantRequest, module: nn.Module,
                options: CaptureOptions) -> tuple[str, dict[str, Any]] | None:
    """``(key, what it covers)`` for ``request`` traced from ``module``;
    ``None`` where the key could not cover everything that shapes the graph."""
    if not request.identity:
        return None
    sources = source_digest(module)
    snapshot = request.snapshot.to_json()
    if sources is None or not all(p.get("portable") for p in snapshot["probes"].values()):
        return None
    inputs = call_to_json(request.inputs)
    try:  # a constant JSON writes as its type name alone would key objects alike
        for spec in [*inputs["args"], *(s for _, s in inputs["kwargs"])]:
            resolve_opaque(spec_from_json(spec))
    except ValueError:  # an opaque part: not keyed
        return None
    env = environment()
    doc = {"schema": KEY_SCHEMA, "identity": request.identity,
           "training": [list(t) for t in request.training], "sources": sources,
           "inputs": inputs, "snapshot": snapshot, "backend": options.backend.name,
           "replay": options.replay, "pin_factories": options.pin_factories,
           "ignore_attributes": sorted(options.ignore_attributes),
           "torch": env["torch"], "torch_git": getattr(torch.version, "git_version", None),
           "python": env["python"], "ctxreplay": env["ctxreplay"], "cuda": env["cuda"],
           "device": env["device"], "capability": env["capability"]}
    text = json.dumps(doc, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest(), doc


def source_digest(module: nn.Module) -> str | None:
    """A digest of the source of every class in the MRO of every submodule of
    ``module`` -- the whole file each is defined in, so helpers beside the
    class count too -- torch's own classes excepted (the torch version covers
    them); a class without a source file by its code objects.  ``None``: a
    class with neither."""
    parts: set[str] = set()
    for m in module.modules():
        for cls in type(m).__mro__:
            if cls is object or cls.__module__.split(".")[0] == "torch":
                continue
            digest = _class_digest(cls)
            if digest is None:
                return None
            parts.add(f"{cls.__module__}.{cls.__qualname__}:{digest}")
    return hashlib.sha256("\n".join(sorted(parts)).encode()).hexdigest()


def _class_digest(cls: type) -> str | None:
    try:
        path = inspect.getsourcefile(cls)
    except (TypeError, OSError):
        path = None
    if path and os.path.isfile(path):
        return _file_digest(path)
    code = [_code_digest(f.__code__) for f in vars(cls).values()
            if isinstance(f, types.FunctionType)]
    return hashlib.sha256("".join(code).encode()).hexdigest() if code else None


def _file_digest(path: str) -> str:
    st = os.stat(path)
    stamp = (st.st_mtime_ns, st.st_size)
    with _lock:
        known = _files.get(path)
    if known is not None and known[0] == stamp:
        return known[1]
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    with _lock:
        _files[path] = (stamp, digest)
    return digest


def _code_digest(code: types.CodeType) -> str:
    """Bytecode, names and constants, nested code objects included."""
    h = hashlib.sha256(code.co_code)
    h.update(repr(code.co_names).encode())
    for const in code.co_consts:
        h.update(_code_digest(const).encode() if isinstance(const, types.CodeType)
                 else repr(const).encode())
    return h.hexdigest()
