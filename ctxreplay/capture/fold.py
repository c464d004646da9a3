"""Folding size variants: the variants of one member identity and context
that differ in tensor sizes only, captured as one graph with dynamic sizes.

A family (``families``) is the variants whose requests agree on everything
but sizes: scope, identity, context, training flags, and the size-free key
of inputs and outputs (``specs.dims.size_free``).  ``FamilyFold`` traces
one of them with the dimensions that vary marked ``Dim.AUTO`` -- torch.export
then decides itself how they relate and where the forward needs a fixed
size (a branch on a size narrows the symbol's range, a ``%`` becomes a guard
of the graph) -- reads the graph's rule for every input dimension, and runs
the graph at every other variant's sizes whose rule it meets, by value,
against the member itself on the same inputs, with each member's weights.
A fold is kept only when every one of those runs agrees; the range it
claims per symbol is the smallest and largest size it was run at, never
wider.  Variants it does not take are folded again from another example
(a size branch: one graph per side), at most ``MAX_FOLDS`` times; the rest
are captured one by one.

torch.export specialises sizes 0 and 1 (a dimension it takes dynamic holds
sizes >= 2), so a variant with such a size where the family's sizes vary is
captured on its own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch
from torch import nn

from .._base.torchcaps import CAPS
from ..fidelity.levels import checked_by, level
from ..fidelity.verify import Fidelity
from ..specs.dims import (
    DynamicDim,
    Folding,
    SymbolRange,
    parse_expr,
    size_free,
    symbols,
    varying_dims,
)
from ..specs.signature import CallSpec
from .checker import GUARD_FAILED, Checker
from .mutation import with_mutations
from .options import CaptureOptions, VariantRequest
from .reads import Reads
from .results import Capture

__all__ = ["MAX_FOLDS", "FamilyFold", "Trial", "families", "folds", "not_folding",
           "rules_from_json", "rules_of", "rules_to_json"]

#: graphs tried per family before the rest are captured one by one
MAX_FOLDS = 3
#: a symbol's upper bound where the graph sets none
UNBOUNDED = 2**62

def folds(options: CaptureOptions) -> bool:
    """Whether a session folds: asked for, a backend that traces dynamic
    sizes, and a verification that runs graphs (a fold is only kept once
    run at every size).  In a distributed finalize each rank folds the
    variants it was given to capture: a family spread over ranks folds once
    per rank, the ranks tracing at the same time."""
    return not_folding(options) is None


def not_folding(options: CaptureOptions) -> str | None:
    """Why a session does not fold, in words (``None``: it does)."""
    if not options.fold:
        return "fold=False"
    if not getattr(options.backend, "folds", False):
        return f"backend {options.backend.name!r} traces fixed sizes"
    if options.verify == "off":
        return "verify='off' (a fold is kept only once run at every size)"
    if not CAPS.export_guards_sizes:
        # an exported program of this torch does not check its trace's size
        # guards: a size inside a fold's range that the trace sent down
        # another path would run the traced path silently
        return f"size_guards=False (torch {'.'.join(map(str, CAPS.version))})"
    return None


def _family_key(r: VariantRequest) -> Any:
    if r.identity_number < 0:  # an identity not known: a family of its own
        return ("alone", id(r))
    return (r.scope, r.identity_number, r.identity, r.snapshot, r.training,
            size_free(r.inputs), size_free(r.outputs))


def families(requests: Sequence[VariantRequest]) -> list[list[VariantRequest]]:
    """``requests`` grouped by family, in the order of each family's first."""
    groups: dict[Any, list[VariantRequest]] = {}
    for r in requests:
        try:
            key = _family_key(r)
            hash(key)
        except Exception:  # a constant that cannot be hashed: on its own
            key = ("alone", id(r))
        groups.setdefault(key, []).append(r)
    return list(groups.values())


def _foldable(family: Sequence[VariantRequest]) -> tuple[list[VariantRequest],
                                                          list[VariantRequest]]:
    """``(variants a dynamic graph can take, those captured one by one)``: a
    size of 0 or 1 where the family's sizes vary specialises the trace."""
    dims = varying_dims([r.inputs for r in family])
    good: list[VariantRequest] = []
    alone: list[VariantRequest] = []
    for r in family:
        shapes = [s.shape for _, s in r.inputs.leaves()]
        small = any(shapes[i][d] < 2 for i, ds in dims.items() for d in ds)
        (alone if small else good).append(r)
    return good, alone


def _example(family: Sequence[VariantRequest]) -> VariantRequest:
    """The variant to trace: among those with the most distinct varying sizes
    (sizes equal by chance are not taken for a relation), the median by
    total size."""
    dims = varying_dims([r.inputs for r in family])

    def score(r: VariantRequest) -> tuple[int, int]:
        shapes = [s.shape for _, s in r.inputs.leaves()]
        sizes = [shapes[i][d] for i, ds in dims.items() for d in ds]
        return len(set(sizes)), sum(sizes)

    # the median of the most distinct: a forward that branches on a size
    # takes one side of it, and the variants left are folded from the other
    best = max(score(r)[0] for r in family)
    ranked = sorted((r for r in family if score(r)[0] == best), key=lambda r: score(r)[1])
    return ranked[len(ranked) // 2]


@attrs.define
class _Rules:
    """What the graph expects of each input dimension."""

    dims: tuple[DynamicDim, ...]
    #: symbol -> (low, high) the graph itself takes (``high`` None: unbounded)
    bounds: dict[str, tuple[int, int | None]]

    def folding(self, ranges: Mapping[str, tuple[int, int]], sizes: int) -> Folding:
        return Folding(self.dims, tuple(SymbolRange(n, lo, hi)
                                        for n, (lo, hi) in sorted(ranges.items())), sizes)

    def wide(self) -> Folding:
        """The rules as a ``Folding`` over the graph's own bounds."""
        return self.folding({n: (lo, UNBOUNDED if hi is None else hi)
                             for n, (lo, hi) in self.bounds.items()}, 0)

    def takes(self, example: CallSpec, call: CallSpec) -> bool:
        try:
            return self.wide().accepts(example, call)
        except ValueError:
            return False


def _bound(value: Any) -> int | None:
    try:
        return int(value) if bool(value.is_finite) else None
    except Exception:  # a sympy bound that does not convert: unbounded
        return None


def rules_of(artifact: Any, inputs: CallSpec) -> _Rules | None:
    """Each input tensor dimension the program left symbolic, with the
    expression it follows, and each symbol's range in the program; ``None``
    when the program's inputs cannot be lined up with ``inputs`` or a
    dimension follows something other than integer arithmetic."""
    if not isinstance(artifact, torch.export.ExportedProgram):
        return None
    from torch.export.graph_signature import InputKind, TensorArgument

    names = [s.arg.name for s in artifact.graph_signature.input_specs
             if s.kind == InputKind.USER_INPUT and isinstance(s.arg, TensorArgument)]
    nodes = {n.name: n for n in artifact.graph.nodes if n.op == "placeholder"}
    leaves = list(inputs.leaves())
    if len(names) != len(leaves):
        return None
    dims: list[DynamicDim] = []
    for i, ((path, spec), name) in enumerate(zip(leaves, names)):
        val = nodes[name].meta.get("val") if name in nodes else None
        shape = getattr(val, "shape", None)
        if shape is None or len(shape) != len(spec.shape):
            return None
        for d, size in enumerate(shape):
            if type(size) is int:
                if size != spec.shape[d]:
                    return None
                continue
            try:
                expr = str(size.node.expr)
                parse_expr(expr)
            except Exception:  # sympy's printer may raise anything: no fold
                return None
            dims.append(DynamicDim(i, path, d, expr))
    used = {n for d in dims for n in symbols(d.expr)}
    bounds = {}
    for sym, vr in artifact.range_constraints.items():
        if str(sym) in used:
            bounds[str(sym)] = (max(0, _bound(vr.lower) or 0), _bound(vr.upper))
    if used - set(bounds):
        return None
    return _Rules(tuple(dims), bounds)


def rules_to_json(rules: _Rules) -> dict[str, Any]:
    """A fold's rules as JSON (the capture cache keeps them): a ``Folding``'s,
    its ranges the graph's own bounds (``UNBOUNDED`` for none)."""
    return rules.wide().to_json()


def rules_from_json(doc: Any) -> _Rules:
    """The inverse of ``rules_to_json``; ``ValueError`` naming the bad field."""
    folding = Folding.from_json(doc, "$.fold.rules")
    return _Rules(folding.dims, {r.name: (r.low, None if r.high >= UNBOUNDED else r.high)
                                 for r in folding.ranges})


@attrs.define
class Trial:
    """One fold being tried: the example traced with ``dims`` dynamic, the
    variants its graph may take, the graph's rules and each variant's check.

    ``others``: the variants of other member identities among ``pending``,
    each with the (submodule path, attribute) pairs its identity differs in
    from the example's (``None``: not comparable); the graph runs at their
    sizes only where the trace, recorded in ``reads``, read none of them."""

    example: VariantRequest
    pending: list[VariantRequest]
    options: CaptureOptions
    dims: Mapping[int, tuple[int, ...]] = attrs.Factory(dict)
    rules: _Rules | None = None
    checked: dict[int, Fidelity] = attrs.Factory(dict)
    others: Mapping[int, frozenset[tuple[str, str]] | None] | None = None
    reads: Reads | None = None

    def reset(self) -> None:
        """Forget a trial's results (a cache hit that did not pass)."""
        self.rules = None
        self.checked.clear()

    def agreed(self) -> bool:
        """The graph's rules were read and every size it was run at agreed."""
        return self.rules is not None and all(f.ok for f in self.checked.values())

    def __call__(self, artifact: Any, checker_for: Callable[[VariantRequest], Checker],
                 modules: Mapping[str, nn.Module]) -> None:
        """Run as the capture's check ends, its view alive: the graph at the
        sizes of every variant whose rules it meets (the example too, unless
        the session's own check already ran it)."""
        if self.others is not None:
            # a list of its own: the fold's stays whole
            self.pending = [r for r in self.pending if self._may_serve(r)]
        self.rules = rules_of(artifact, self.example.inputs)
        if self.rules is None:
            return
        verify = self.options.verify
        steps = ("execute", verify) if level(verify).retains else ("execute",)
        last: Checker | None = None
        for r in self.pending:
            if r is self.example and level(self.options.verify).executes:
                continue
            if not self.rules.takes(self.example.inputs, r.inputs):
                continue
            checker = checker_for(r)
            if last is not None:  # one artifact: unlifted once for every size it runs at
                checker.share_program(last)
            last = checker
            fid = checker.run_steps(modules, steps)
            if _refused(fid):  # the graph's own guard (a ``%``): not this fold's size
                continue
            self.checked[r.variant] = with_mutations(fid, checker.watch.found)

    def _may_serve(self, r: VariantRequest) -> bool:
        """Whether the graph may run for ``r``: of the example's identity, or
        of one differing only in plain attributes the trace never read
        (another ``forward`` set on a submodule runs other code)."""
        if r.identity_number == self.example.identity_number:
            return True
        changed = None if self.others is None else self.others.get(id(r))
        return changed is not None and all(n != "forward" for _, n in changed) \
            and self.reads is not None and self.reads.untouched(changed)


def _refused(fid: Fidelity) -> bool:
    """Every mismatch is the graph refusing the sizes before it ran
    (torch.export's input guards raise ``AssertionError: Guard failed``):
    the variant is left to another fold, not counted against this one."""
    return not fid.ok and all(m.field == "execution" and m.live == "ran"
                              and m.captured == GUARD_FAILED for m in fid.mismatches)


class FamilyFold:
    """Folding one family: its trials one after the other, each the capture
    of an example with the family's varying dimensions dynamic, which the
    caller makes (``Ask(trial.example, fold=trial)``) and hands back to
    ``took``.  ``made``: the folded captures kept so far; ``rest()``: the
    variants left to capture one by one."""

    def __init__(self, family: Sequence[VariantRequest], options: CaptureOptions) -> None:
        self.options = options
        self.pending, self.alone = _foldable(family)
        if not varying_dims([r.inputs for r in family]):  # nothing but sizes may differ
            self.pending, self.alone = [], list(family)
        self.made: list[Capture] = []
        self._tries = 0
        self._over = False

    def next(self) -> Trial | None:
        """The next trial, or ``None`` when the family is done."""
        if self._over or self._tries >= MAX_FOLDS or len(self.pending) < 2:
            return None
        self._tries += 1
        return Trial(_example(self.pending), self.pending, self.options,
                     varying_dims([r.inputs for r in self.pending]))

    def took(self, trial: Trial, capture: Capture | None) -> None:
        """What ``trial``'s capture gave (``None``: it failed, and the rest
        are captured one by one)."""
        taken = None if capture is None else _taken(trial, capture, self.pending)
        if capture is None or taken is None:  # a size the graph mis-computes: no fold
            self._over = True
            return
        self.made.append(_folded(capture, taken, trial))
        self.pending = [r for r in self.pending if all(r is not t for t in taken)]

    def rest(self) -> list[VariantRequest]:
        return [*self.pending, *self.alone]


def _taken(trial: Trial, capture: Capture,
           pending: Sequence[VariantRequest]) -> list[VariantRequest] | None:
    """The variants the fold stands for (the example's alone: the graph
    takes no other size observed, and stands for its own), or ``None`` when
    it must not be kept: a variant it takes but does not reproduce, or a
    graph whose rules cannot be read."""
    if trial.rules is None or not capture.fidelity.ok:
        return None
    if any(not f.ok for f in trial.checked.values()):
        return None
    return [r for r in pending if r is trial.example or r.variant in trial.checked]


def _folded(capture: Capture, taken: Sequence[VariantRequest], trial: Trial) -> Capture:
    """``capture`` (of the example) standing for every variant in ``taken``
    (its own alone: a capture of fixed sizes)."""
    assert trial.rules is not None
    rules = trial.rules
    ranges: dict[str, tuple[int, int]] = {}
    wide = rules.wide()
    for r in taken:
        values = wide.values([s.shape for _, s in r.inputs.leaves()]) or {}
        for n, v in values.items():
            lo, hi = ranges.get(n, (v, v))
            ranges[n] = (min(lo, v), max(hi, v))
    calls: dict[str, int] = {}
    for r in taken:
        for m in r.members:
            calls[m.name] = calls.get(m.name, 0) + m.calls
    checks = [capture.fidelity, *trial.checked.values()]
    done = tuple(dict.fromkeys(s for f in checks for s in f.checked))
    order = checked_by("values")
    done = tuple(sorted(done, key=lambda s: order.index(s) if s in order else len(order)))
    fid = attrs.evolve(capture.fidelity, checked=done, members=len(calls),
                       by_value=sum(f.by_value for f in checks),
                       calls=sum(calls.values()),
                       not_retained=sum(f.not_retained for f in checks))
    identities = tuple(dict.fromkeys(i for r in taken for i in _identities(r)))
    return capture.evolve(members=tuple(calls), member_calls=tuple(calls.items()),
                        calls=sum(r.calls for r in taken), fidelity=fid,
                        folding=rules.folding(ranges, len(taken)) if len(taken) > 1 else None,
                        folded=tuple(r.variant for r in taken if r is not trial.example),
                        identities=identities)


def _identities(r: VariantRequest) -> list[tuple[str, str]]:
    return [(m.name, r.identity) for m in r.members if r.identity]

