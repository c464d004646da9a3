"""Comparing a live call's output spec with a captured one: dtype, shape,
stride, device, ``requires_grad`` and nesting, leaf by leaf."""

from __future__ import annotations

from typing import Any

import attrs
import torch

from .._base.jsonread import dtype_name
from ..specs.signature import ConstSpec, DictSpec, SeqSpec, Spec, TensorSpec, children

__all__ = ["SpecMismatch", "compare_specs", "symbolic_dims"]


@attrs.frozen
class SpecMismatch:
    """One difference between a live and a captured output."""

    path: str
    field: str
    live: str
    captured: str


def compare_specs(live: Spec, captured: Spec, path: str = "out", *,
                  requires_grad: bool = True, strides: bool = True,
                  free_dims: dict[str, frozenset[int]] | None = None) -> list[SpecMismatch]:
    """Structured differences (dtype, shape, stride, device, requires_grad,
    nesting).

    ``requires_grad``: report a live output that required grad where the
    captured one does not (autograd was lost).  The reverse is not a
    mismatch: an artifact run with grad enabled may track what a live
    no-grad call did not.  ``False`` skips the field: traced graph metadata
    is functional and says nothing about autograd.  ``strides``: compare the
    strides of tensors whose shapes agree.  ``free_dims``: per path,
    dimensions not compared (those the captured graph left symbolic)."""
    out: list[SpecMismatch] = []
    _compare(live, captured, path, out, requires_grad, strides, free_dims or {})
    return out


def _kind(spec: Spec) -> str:
    if isinstance(spec, TensorSpec):
        return "tensor"
    if isinstance(spec, ConstSpec):
        return spec.type_name
    if isinstance(spec, (SeqSpec, DictSpec)):
        n = len(spec.keys) if isinstance(spec, DictSpec) else len(spec.items)
        return f"{spec.kind.__name__}[{n}]"
    return f"{spec.cls.__name__}"


def _differ(a: tuple[Any, ...], b: tuple[Any, ...], free: frozenset[int]) -> bool:
    if len(a) != len(b):
        return True
    # A symbolic dimension (data-dependent or dynamic) matches any size, and
    # so does a dimension the captured graph declared symbolic.
    return any(i not in free and type(x) is int and type(y) is int and x != y
               for i, (x, y) in enumerate(zip(a, b)))


def _stride_free(shape: tuple[Any, ...], free: frozenset[int]) -> frozenset[int]:
    # a stride over a dimension of size 0 or 1 is arbitrary, and one of a
    # symbolic dimension is symbolic too
    return free | {i for i, n in enumerate(shape) if type(n) is not int or n <= 1}


def symbolic_dims(spec: Spec, path: str = "out") -> dict[str, frozenset[int]]:
    """Per tensor path, the dimensions a captured spec leaves symbolic."""
    out: dict[str, frozenset[int]] = {}
    if isinstance(spec, TensorSpec):
        free = frozenset(i for i, d in enumerate(spec.shape) if type(d) is not int)
        if free:
            out[path] = free
        return out
    for sub, child in children(spec) or []:
        out.update(symbolic_dims(child, path + sub))
    return out


def _compare(a: Spec, b: Spec, path: str, out: list[SpecMismatch], rg: bool, st: bool,
             free: dict[str, frozenset[int]]) -> None:
    if isinstance(a, TensorSpec) and isinstance(b, TensorSpec):
        dims = free.get(path, frozenset())
        if a.dtype != b.dtype:
            out.append(SpecMismatch(path, "dtype", dtype_name(a.dtype), dtype_name(b.dtype)))
        if _differ(a.shape, b.shape, dims):
            out.append(SpecMismatch(path, "shape", str(list(a.shape)), str(list(b.shape))))
        elif st and a.stride and b.stride and _differ(a.stride, b.stride,
                                                       _stride_free(a.shape, dims)):
            out.append(SpecMismatch(path, "stride", str(list(a.stride)), str(list(b.stride))))
        if torch.device(a.device).type != torch.device(b.device).type:
            out.append(SpecMismatch(path, "device", a.device, b.device))
        if rg and a.requires_grad and not b.requires_grad:
            out.append(SpecMismatch(path, "requires_grad", str(a.requires_grad),
                                    str(b.requires_grad)))
        return
    la, lb = children(a), children(b)
    if la is None or lb is None or len(la) != len(lb):
        if _kind(a) != _kind(b):
            out.append(SpecMismatch(path, "structure", _kind(a), _kind(b)))
        return
    for (sub, ca), (_, cb) in zip(la, lb):
        _compare(ca, cb, f"{path}{sub}", out, rg, st, free)
