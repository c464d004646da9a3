"""The fold's part of a capture cache entry.

A fold's entry is keyed by its example variant's key (``keys.cache_key``),
the signatures of every variant it was asked to fold and the dimensions
traced as dynamic: the same family of sizes, observed again, hits.  Beside
the program (no weights) the entry holds the graph's rules for its inputs
(``fold.rules_of``) and, per size it was run at, the live output metadata
the run agreed with.

A hit is checked at the session's verify level before use: at
``"signature"`` every size's live outputs against what the entry recorded
for that size; at the levels that run graphs, the program is run at every
size, exactly as a traced fold is (the trial runs inside the capture).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

from ..capture.asking import Tracing
from ..capture.checker import Checker
from ..capture.fold import Trial, rules_from_json, rules_to_json
from ..capture.options import VariantRequest
from ..specs.signature import Spec
from ..specs.specjson import call_to_json, resolve_opaque, spec_from_json, spec_to_json
from .entries import EntryRead
from .store import StoredEntry

__all__ = ["FoldEntry"]


def _digest(doc: Any) -> str:
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()


def _sig(r: VariantRequest) -> str:
    return _digest(call_to_json(r.inputs))


class FoldEntry:
    """What a fold's entry adds to a plain one, for the trial it answers."""

    #: what the cache's warning calls an entry that does not pass
    noun = "a fold"

    def __init__(self, trial: Trial) -> None:
        self.trial = trial
        #: the variants the fold was asked to take (the trial may narrow its own)
        self.pending: Sequence[VariantRequest] = list(trial.pending)
        self._sizes: Mapping[str, Spec] = {}
        self._rules: Any = None

    def key(self, example_key: str) -> str:
        return _digest({"example": example_key,
                        "sizes": sorted(_sig(r) for r in self.pending),
                        "dims": sorted((i, list(d)) for i, d in self.trial.dims.items())})

    def read(self, entry: StoredEntry) -> None:
        """Read the entry's fold: its rules and each size's live outputs."""
        fold = entry.record["fold"]
        self._rules = rules_from_json(fold["rules"])
        self._sizes = {str(s["inputs"]): resolve_opaque(spec_from_json(s["outputs"]))
                       for s in fold["sizes"]}

    def deferred(self, read: EntryRead, tracing: Tracing) -> None:
        """Each size the entry recorded checked by its output metadata."""
        example = self.trial.example
        self.trial.rules = self._rules
        module = tracing.modules[example.traced.name]
        for r in self.pending:
            if r is not example and _sig(r) in self._sizes:
                checker = Checker(r, tracing.options, read.program(self._sizes[_sig(r)]),
                                  module, tracing.neutral_probes)
                self.trial.checked[r.variant] = checker.run(tracing.modules)

    def agreed(self) -> bool:
        return self.trial.agreed()

    def reset(self) -> None:
        self.trial.reset()

    def record(self) -> dict[str, Any]:
        """The entry's ``fold`` field: the rules, and what each size's live
        outputs were (a later signature-level hit compares against them)."""
        trial = self.trial
        assert trial.rules is not None
        taken = [r for r in self.pending if r is not trial.example and r.variant in trial.checked]
        return {"fold": {"rules": rules_to_json(trial.rules),
                         "sizes": [{"inputs": _sig(r), "outputs": spec_to_json(r.outputs)}
                                   for r in taken if r.outputs is not None]}}
