"""Checking a compiled program against the capture's uncompiled one.

A saved directory holds no values of the live calls (metadata only), so
the reference is the capture's own program -- checked against those calls
when it was made -- run on the same fresh inputs: floats uniform in
[0, 1), integers zero, bools false (the values its own checks use), with
the program's own weights, inside what the capture needs around it
(``LoadedCapture.replay``).  A folded capture is checked at its example
sizes and at each end of its ranges.

The error of an output is ``max |compiled - uncompiled| / max |uncompiled|``,
held to a tolerance per dtype (``TOLERANCES``): that of the output's dtype
or of the least precise floating dtype the program computes in, whichever
is looser -- a float32 residual stream that adds bfloat16 block outputs
(autocast) carries bfloat16's rounding.  Inductor fuses
elementwise chains and reorders reductions (its own tiling and
accumulation order), and keeps fused intermediates in float32 where eager
rounds each op's result to bfloat16 or float16: the results are not
bit-exact, and the difference is a few units in the last place at the
output's peak.  Integer and bool outputs must be equal.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import attrs
import torch

from ..loading.compiled import OutputError
from ..specs.dims import Folding, _evaluate, contiguous, parse_expr
from ..specs.materialize import tensor
from ..specs.signature import TensorSpec

__all__ = ["TOLERANCES", "compare", "compute_tolerance", "size_points"]

#: dtype -> the largest ``max |compiled - uncompiled| / max |uncompiled|``
#: a compiled output may have: about three units in the last place at the
#: output's peak for bfloat16 (2**-7 = 7.8e-3 a unit) and four for float16
#: (2**-10), where fused kernels round once instead of per op; float32 and
#: float64 leave room only for reordered reductions.  Other dtypes: exact.
TOLERANCES: dict[torch.dtype, float] = {
    torch.bfloat16: 2e-2,
    torch.float16: 4e-3,
    torch.float32: 1e-4,
    torch.float64: 1e-9,
}

#: the error recorded for an output whose values cannot be compared (NaN where
#: the other has a number, another shape or dtype): JSON holds no infinity
_BROKEN = 1e300


def size_points(folding: Folding | None, specs: Sequence[TensorSpec]
                ) -> list[tuple[str, list[TensorSpec]]]:
    """The input specs a folded capture is checked at besides its example
    sizes: every symbol at its low end, then every symbol at its high end
    (with a label naming the sizes); empty for fixed sizes, or where a
    dynamic leaf is not contiguous (its strides follow no rule)."""
    if folding is None:
        return []
    out = []
    for end in ("low", "high"):
        values = {r.name: getattr(r, end) for r in folding.ranges}
        made = list(specs)
        for d in folding.dims:
            s = made[d.leaf]
            if not contiguous(s.shape, s.stride):  # its strides follow no rule
                return []
            shape = list(s.shape)
            shape[d.dim] = _evaluate(parse_expr(d.expr), values)
            made[d.leaf] = attrs.evolve(s, shape=tuple(shape), stride=_strides(shape))
        out.append((describe(made), made))
    return out


def describe(specs: Sequence[TensorSpec]) -> str:
    """``"4x7x32, 4"``: the leaves' sizes, for the record."""
    return ", ".join("x".join(map(str, s.shape)) or "scalar" for s in specs)


def _strides(shape: Sequence[int]) -> tuple[int, ...]:
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= max(n, 1)
    return tuple(reversed(out))


def inputs_of(specs: Sequence[TensorSpec]) -> list[torch.Tensor]:
    """Fresh tensors of ``specs`` (the materialiser's values)."""
    return [tensor(attrs.evolve(s, requires_grad=False)) for s in specs]


def compute_tolerance(program: Any) -> float:
    """The loosest tolerance of the floating dtypes ``program``'s graph computes
    in (its nodes' values, its regions' bodies included: an autocast region's
    ops hold its dtype); 0 where it names none."""
    found: set[torch.dtype] = set()
    for module in program.graph_module.modules():
        graph = getattr(module, "graph", None)
        if not isinstance(graph, torch.fx.Graph):
            continue
        for node in graph.nodes:
            found.update(_region_dtype(node))
            val = node.meta.get("val")
            for v in val if isinstance(val, (list, tuple)) else (val,):
                if isinstance(v, torch.Tensor):
                    found.add(v.dtype)
    return max((TOLERANCES.get(d, 0.0) for d in found), default=0.0)


def _region_dtype(node: torch.fx.Node) -> tuple[torch.dtype, ...]:
    """The dtype an enabled autocast region computes in, from its
    ``wrap_with_autocast(device, dtype, enabled, cache, body, ...)`` call:
    torch 2.7 leaves the body's nodes without their values (``meta["val"]``)."""
    if node.op != "call_function" or getattr(node.target, "__name__", "") != "wrap_with_autocast":
        return ()
    dtype = node.args[1] if len(node.args) > 2 else None
    return (dtype,) if isinstance(dtype, torch.dtype) and node.args[2] else ()


def compare(got: Sequence[Any], want: Sequence[Any], floor: float = 0.0,
            of: str = "output") -> list[OutputError]:
    """Each value's error (see the module docstring); a value that is not a
    tensor must be equal.  ``floor``: the tolerance of the program's least
    precise compute dtype (``compute_tolerance``), for floating values;
    ``of``: what the values are (``OutputError.of``)."""
    out = []
    if len(got) != len(want):
        return [OutputError(0, "count", _BROKEN, 0.0, of)]
    for i, (g, w) in enumerate(zip(got, want)):
        if not isinstance(w, torch.Tensor):
            out.append(OutputError(i, type(w).__name__, 0.0 if g == w else _BROKEN, 0.0, of))
            continue
        tol = TOLERANCES.get(w.dtype, 0.0)
        if tol:
            tol = max(tol, floor)
        name = str(w.dtype).removeprefix("torch.")
        if not isinstance(g, torch.Tensor) or g.shape != w.shape or g.dtype != w.dtype:
            out.append(OutputError(i, name, _BROKEN, tol, of))
            continue
        out.append(OutputError(i, name, _error(g.detach(), w.detach()), tol, of))
    return out


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    if not (want.is_floating_point() or want.is_complex()):
        return 0.0 if torch.equal(got, want) else _BROKEN
    if got.numel() == 0:
        return 0.0
    g, w = got.double(), want.double()
    if not torch.equal(torch.isnan(g), torch.isnan(w)):
        return _BROKEN
    finite = ~torch.isnan(w)
    g, w = g[finite], w[finite]
    if g.numel() == 0:
        return 0.0
    if not torch.equal(torch.isinf(g), torch.isinf(w)) or \
            not torch.equal(g[torch.isinf(w)], w[torch.isinf(w)]):
        return _BROKEN
    fin = ~torch.isinf(w)
    diff = float((g[fin] - w[fin]).abs().max()) if bool(fin.any()) else 0.0
    peak = float(w[fin].abs().max()) if bool(fin.any()) else 0.0
    if diff == 0.0:
        return 0.0
    err = diff / peak if peak > 0 else _BROKEN
    return err if math.isfinite(err) else _BROKEN
