"""Answering a fold from the capture cache, and filling it.

A fold's entry is keyed by its example variant's key (``keys.cache_key``),
the signatures of every variant it was asked to fold and the dimensions
traced as dynamic: the same family of sizes, observed again, hits.  The
entry holds the program (no weights), the graph's rules for its inputs
(``fold.rules_of``) and, per size it was run at, the live output metadata
the run agreed with.

A hit is checked at the session's verify level before use: at
``"signature"`` every size's live outputs against what the entry recorded
for that size (the program left on disk until first used); at the levels
that run graphs, the program is loaded and run at every size, exactly as a
traced fold is.  A hit that does not pass is discarded with a warning and
the fold is traced again.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import nn

from ..capture.checker import Checker
from ..capture.fold import Trial, rules_from_json, rules_to_json
from ..capture.options import CaptureOptions, VariantRequest
from ..capture.results import Capture
from ..capture.variant import Source
from ..core.probe import ContextProbe
from ..fidelity.levels import checked_by
from ..specs.specjson import call_to_json, resolve_opaque, spec_from_json, spec_to_json
from .keys import cache_key
from .store import StoredEntry
from .use import CaptureCache, deferred_capture, fill_record, read_entry, run_entry

__all__ = ["cached_fold"]

FoldRun = Callable[[Source | None], Capture]


def _digest(doc: Any) -> str:
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()


def _sig(r: VariantRequest) -> str:
    return _digest(call_to_json(r.inputs))


def fold_key(example_key: str, pending: Sequence[VariantRequest],
             dims: Mapping[int, tuple[int, ...]]) -> str:
    return _digest({"example": example_key, "sizes": sorted(_sig(r) for r in pending),
                    "dims": sorted((i, list(d)) for i, d in dims.items())})


def cached_fold(cache: CaptureCache, example: VariantRequest,
                pending: Sequence[VariantRequest], dims: Mapping[int, tuple[int, ...]],
                trial: Trial, modules: Mapping[str, nn.Module], options: CaptureOptions,
                baseline: tuple[ContextProbe[Any], ...], run: FoldRun) -> Capture:
    """The fold of ``pending`` from ``example``: from ``cache`` where an
    entry passes its checks (``trial`` filled as a traced fold fills it),
    else ``run(None)`` -- a trace -- stored when every size agreed."""
    module = modules.get(example.traced.name)
    key = None
    if module is not None:
        try:
            keyed = cache_key(example, module, options)
            key = None if keyed is None else fold_key(keyed[0], pending, dims)
        except Exception:  # what cannot be keyed is captured, never guessed
            key = None
    if key is None or module is None:
        return run(None)
    entry = cache.store.read(key)
    if entry is not None:
        hit = _use(cache, entry, example, pending, trial, module, modules, options,
                   baseline, run)
        if hit is not None:
            return hit
        trial.reset()
    capture = run(None)
    return _fill(cache, key, capture, trial, pending, example, module, options)


def _use(cache: CaptureCache, entry: StoredEntry, example: VariantRequest,
         pending: Sequence[VariantRequest], trial: Trial, module: Any,
         modules: Mapping[str, nn.Module], options: CaptureOptions,
         baseline: tuple[ContextProbe[Any], ...], run: FoldRun) -> Capture | None:
    read = read_entry(cache, entry, example)
    if read is None:
        return None
    stored, fmt, backend = read
    try:
        fold = entry.record["fold"]
        rules = rules_from_json(fold["rules"])
        sizes = {str(s["inputs"]): resolve_opaque(spec_from_json(s["outputs"]))
                 for s in fold["sizes"]}
    except Exception as exc:
        cache.store.discard(entry.key, f"unreadable ({type(exc).__name__})")
        return None
    if set(checked_by(options.verify)) <= {"signature"}:
        capture = deferred_capture(entry, stored, fmt, backend, example, module, modules,
                                   options, baseline)
        trial.rules = rules
        for r in pending:
            if r is not example and _sig(r) in sizes:
                checker = Checker(r, options, backend, None, module, sizes[_sig(r)],
                                  binding=stored.binding, flatten_out=stored.flatten_out,
                                  carried=stored.carried, baseline=baseline,
                                  ambient_only=stored.ambient_only)
                trial.checked[r.variant] = checker.run(modules)
    else:
        ran = run_entry(cache, entry, stored, fmt, backend, run)
        if ran is None:
            return None
        capture = ran
    if not capture.fidelity.ok or not trial.agreed():
        cache.store.discard(entry.key, "a fold that does not reproduce the live calls at "
                            f"verify={options.verify!r}")
        return None
    return capture


def _fill(cache: CaptureCache, key: str, capture: Capture, trial: Trial,
          pending: Sequence[VariantRequest], example: VariantRequest, module: nn.Module,
          options: CaptureOptions) -> Capture:
    """Store a fold whose every size agreed, with what each size's live
    outputs were (a later signature-level hit compares against them);
    returns the capture, with why it was not stored where it could not be."""
    if trial.rules is None or not capture.fidelity.ok or not trial.agreed():
        return capture
    taken = [r for r in pending if r is not example and r.variant in trial.checked]
    try:
        fold = {"rules": rules_to_json(trial.rules),
                "sizes": [{"inputs": _sig(r), "outputs": spec_to_json(r.outputs)}
                          for r in taken if r.outputs is not None]}
    except Exception as exc:  # what cannot be written back faithfully is not kept
        return cache.kept(capture, ("not_serialisable", "its size rules cannot be written: "
                                                        f"{type(exc).__name__}"))
    return cache.kept(capture, fill_record(cache, key, capture, example, module, options,
                                           {"fold": fold}))
