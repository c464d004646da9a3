"""Size-polymorphic signatures: which dimensions of a call's tensors a folded
capture takes at any size, the rule each follows, and the range it was
checked over.

A folded capture is one graph traced with dynamic dimensions for calls that
differ in sizes only.  Its ``Folding`` says, per dynamic dimension of an
input tensor, the expression the graph expects it to equal (``"s0"``, or
``"s0 + 1"`` where the trace found a relation), and per symbol the range the
capture was verified over: the smallest and largest size observed -- never
wider, even where the graph itself would accept more.  ``size_free`` is the
key of a call with its sizes left out: calls fold only when it is equal.

Expressions are evaluated by a small arithmetic interpreter (integers,
symbols, ``+ - * //`` and ``%``); a graph whose dimensions follow anything
else is not folded.
"""

from __future__ import annotations

import ast
import functools
import operator
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import torch

from .._base.jsonread import read_int, read_list, read_mapping, read_str
from .signature import (
    CallSpec,
    ConstSpec,
    DataclassSpec,
    DictSpec,
    ObjectSpec,
    PytreeSpec,
    SeqSpec,
    Spec,
    TensorSpec,
    children,
    map_leaves,
)

__all__ = ["DynamicDim", "Folding", "SymbolRange", "concrete", "contiguous", "parse_expr",
           "size_free", "size_free_key", "symbols", "varying_dims"]


def contiguous(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """Whether ``stride`` is the row-major layout of ``shape`` (dimensions of
    size 1 may have any stride, as in ``torch.Tensor.is_contiguous``)."""
    expected = 1
    for size, step in zip(reversed(shape), reversed(stride)):
        if size == 0:
            return True
        if size != 1 and step != expected:
            return False
        expected *= size
    return True


def _tensor_key(s: TensorSpec) -> tuple[Any, ...]:
    # the strides of a contiguous tensor follow from its sizes; any other
    # layout (a transposed or expanded view) must be the same in every call
    layout: Any = "contiguous" if s.layout == "strided" and contiguous(s.shape, s.stride) \
        else (s.shape, s.stride)
    return ("tensor", len(s.shape), s.dtype, s.device, s.requires_grad, s.layout, layout)


def _spec_key(spec: Spec) -> Any:
    if isinstance(spec, TensorSpec):
        return _tensor_key(spec)
    if isinstance(spec, ConstSpec):
        return spec
    kids = children(spec)
    if kids is None:
        return spec
    return (type(spec).__name__, getattr(spec, "kind", getattr(spec, "cls", None)),
            tuple((path, _spec_key(c)) for path, c in kids))


def size_free(spec: CallSpec | Spec | None) -> Any:
    """A hashable key of ``spec`` with every tensor's sizes left out (its rank,
    dtype, device, layout, ``requires_grad`` and -- unless it is contiguous --
    its exact shape and strides kept): equal for calls that differ in sizes
    only."""
    if spec is None:
        return None
    if isinstance(spec, CallSpec):
        return tuple((path, _spec_key(s)) for path, s in spec.items())
    return _spec_key(spec)


def size_free_key(key: Any) -> Any:
    """``signature.call_key``'s key of a call with every tensor's sizes left
    out (as ``size_free`` leaves them out of a spec)."""
    t = type(key)
    if t is tuple:
        if len(key) == 5 and type(key[0]) is torch.dtype and type(key[1]) is torch.Size:
            dtype, shape, stride, device, grad = key
            layout = "contiguous" if contiguous(shape, stride) else (tuple(shape), stride)
            return ("tensor", len(shape), dtype, str(device), grad, "strided", layout)
        return tuple([size_free_key(k) for k in key])
    if isinstance(key, TensorSpec):
        return _tensor_key(key)
    if isinstance(key, (SeqSpec, DictSpec, DataclassSpec, ObjectSpec, PytreeSpec)):
        return _spec_key(key)
    return key


def varying_dims(signatures: Sequence[CallSpec]) -> dict[int, tuple[int, ...]]:
    """Leaf index -> the dimensions whose size differs between ``signatures``
    (calls of one ``size_free`` key)."""
    shapes = [[s.shape for _, s in sig.leaves()] for sig in signatures]
    out: dict[int, tuple[int, ...]] = {}
    for i, first in enumerate(shapes[0]):
        dims = tuple(d for d in range(len(first))
                     if any(other[i][d] != first[d] for other in shapes[1:]))
        if dims:
            out[i] = dims
    return out


def _hint(d: Any) -> int:
    if type(d) is int:
        return d
    hint = getattr(getattr(d, "node", None), "hint", None)
    return int(hint) if hint is not None else int(d)


def _concrete_tensor(spec: Spec) -> Spec:
    if not isinstance(spec, TensorSpec) or \
            all(type(d) is int for d in (*spec.shape, *spec.stride)):
        return spec
    return attrs.evolve(spec, shape=tuple(_hint(d) for d in spec.shape),
                        stride=tuple(_hint(d) for d in spec.stride))


def concrete(spec: Spec) -> Spec:
    """``spec`` (a traced graph's, whose sizes may be symbols) at the sizes the
    trace ran with."""
    return map_leaves(spec, _concrete_tensor)


# -- expressions -------------------------------------------------------------------

_BINARY: dict[type, Callable[[int, int], int]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}


@functools.lru_cache(maxsize=1024)
def parse_expr(text: str) -> ast.expr:
    """``text`` parsed, or ``ValueError`` when it is more than integer
    arithmetic over symbols."""
    try:
        tree = ast.parse(text, mode="eval").body
    except SyntaxError as exc:
        raise ValueError(f"not a size expression: {text!r}") from exc
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            continue
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            continue
        if isinstance(node, ast.Constant) and type(node.value) is int:
            continue
        if isinstance(node, (ast.Name, ast.operator, ast.unaryop, ast.expr_context)):
            continue
        raise ValueError(f"not a size expression: {text!r}")
    return tree


def _evaluate(node: ast.expr, values: Mapping[str, int]) -> int:
    if isinstance(node, ast.Constant):
        assert type(node.value) is int  # parse_expr admits integer constants only
        return node.value
    if isinstance(node, ast.Name):
        return values[node.id]
    if isinstance(node, ast.UnaryOp):
        return -_evaluate(node.operand, values)
    assert isinstance(node, ast.BinOp)
    return _BINARY[type(node.op)](_evaluate(node.left, values), _evaluate(node.right, values))


def symbols(expr: str) -> set[str]:
    """The symbols a size expression names."""
    return set(_symbols(parse_expr(expr)))


def _symbols(node: ast.expr) -> Iterator[str]:
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            yield n.id


# -- the folding -------------------------------------------------------------------

@attrs.frozen
class DynamicDim:
    """One dynamic dimension of an input tensor: leaf ``leaf`` of the call
    (``CallSpec.leaves()`` order, at ``path``), dimension ``dim``, which the
    graph expects to equal ``expr``."""

    leaf: int
    path: str
    dim: int
    expr: str = attrs.field(validator=lambda _i, _a, v: parse_expr(v) and None)


@attrs.frozen
class SymbolRange:
    """The sizes a symbol was verified over, inclusive."""

    name: str
    low: int
    high: int


@attrs.frozen
class Folding:
    """The dynamic dimensions of a folded capture and the ranges they were
    verified over; every other dimension is the signature's."""

    dims: tuple[DynamicDim, ...]
    ranges: tuple[SymbolRange, ...]
    #: distinct observed sizes (variants) the capture was verified at
    sizes: int = 0

    def __attrs_post_init__(self) -> None:
        known = {r.name for r in self.ranges}
        for d in self.dims:
            missing = set(_symbols(parse_expr(d.expr))) - known
            if missing:
                raise ValueError(f"folding: symbol {sorted(missing)[0]!r} of {d.path} "
                                 f"dim {d.dim} has no range")

    def values(self, shapes: Sequence[Sequence[int]]) -> dict[str, int] | None:
        """Each symbol's value in a call whose leaves have ``shapes``, read
        from a dimension that is the symbol alone; ``None`` when one cannot
        be read."""
        out: dict[str, int] = {}
        for d in self.dims:
            node = parse_expr(d.expr)
            if isinstance(node, ast.Name) and node.id not in out:
                if d.leaf >= len(shapes) or d.dim >= len(shapes[d.leaf]):
                    return None
                out[node.id] = int(shapes[d.leaf][d.dim])
        return out if len(out) == len(self.ranges) else None

    def accepts(self, signature: CallSpec, call: CallSpec) -> bool:
        """Whether ``call`` is ``signature`` but for sizes this folding takes:
        the same size-free key, every other dimension equal, every dynamic
        one equal to its expression, every symbol in its range."""
        if size_free(call) != size_free(signature):
            return False
        want = [s.shape for _, s in signature.leaves()]
        got = [s.shape for _, s in call.leaves()]
        if len(want) != len(got):
            return False
        dynamic = {(d.leaf, d.dim) for d in self.dims}
        for i, (w, g) in enumerate(zip(want, got)):
            if len(w) != len(g) or any(w[k] != g[k] for k in range(len(w))
                                       if (i, k) not in dynamic):
                return False
        return self.within(got)

    def within(self, shapes: Sequence[Sequence[int]]) -> bool:
        """Whether the dynamic dimensions of ``shapes`` follow the folding's
        expressions within its ranges."""
        values = self.values(shapes)
        if values is None:
            return False
        for r in self.ranges:
            if not r.low <= values[r.name] <= r.high:
                return False
        try:
            return all(_evaluate(parse_expr(d.expr), values) == shapes[d.leaf][d.dim]
                       for d in self.dims)
        except (KeyError, ZeroDivisionError):
            return False

    def describe(self) -> list[str]:
        """``path[dim] = expr in [low, high]`` lines for the report."""
        ranges = {r.name: r for r in self.ranges}
        out = []
        for d in self.dims:
            names = sorted(set(_symbols(parse_expr(d.expr))))
            bounds = ", ".join(f"{n} in [{ranges[n].low}, {ranges[n].high}]" for n in names)
            out.append(f"{d.path}[{d.dim}] = {d.expr} ({bounds})")
        return out

    def to_json(self) -> dict[str, Any]:
        return {"dims": [{"leaf": d.leaf, "path": d.path, "dim": d.dim, "expr": d.expr}
                         for d in self.dims],
                "ranges": [{"name": r.name, "low": r.low, "high": r.high}
                           for r in self.ranges],
                "sizes": self.sizes}

    @classmethod
    def from_json(cls, value: object, path: str = "$") -> Folding:
        """The inverse of ``to_json``; ``ValueError`` naming the bad field."""
        doc = read_mapping(value, path, keys={"dims", "ranges", "sizes"},
                           required={"dims", "ranges"})
        dims = []
        for i, d in enumerate(read_list(doc["dims"], f"{path}.dims")):
            where = f"{path}.dims[{i}]"
            m = read_mapping(d, where, keys={"leaf", "path", "dim", "expr"},
                             required={"leaf", "path", "dim", "expr"})
            expr = read_str(m["expr"], f"{where}.expr")
            try:
                parse_expr(expr)
            except ValueError as exc:
                raise ValueError(f"{where}.expr: {exc}") from None
            dims.append(DynamicDim(read_int(m["leaf"], f"{where}.leaf", lo=0),
                                   read_str(m["path"], f"{where}.path", max_len=4096),
                                   read_int(m["dim"], f"{where}.dim", lo=0), expr))
        ranges = []
        for i, r in enumerate(read_list(doc["ranges"], f"{path}.ranges")):
            where = f"{path}.ranges[{i}]"
            m = read_mapping(r, where, keys={"name", "low", "high"},
                             required={"name", "low", "high"})
            ranges.append(SymbolRange(read_str(m["name"], f"{where}.name"),
                                      read_int(m["low"], f"{where}.low", lo=0),
                                      read_int(m["high"], f"{where}.high", lo=0)))
        sizes = read_int(doc.get("sizes", 0), f"{path}.sizes", lo=0)
        try:
            return cls(tuple(dims), tuple(ranges), sizes)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None
