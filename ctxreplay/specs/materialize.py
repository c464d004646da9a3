"""Inputs from specs: fresh tensors with the live call's metadata, bound the
way a capture takes them.

Call these outside the live forward: created inside an inference-mode
forward they would be inference tensors, which export cannot trace outside
inference mode.  Values are drawn from a private generator, so materialising
never moves the user's random state, and its draws start over for every
call's inputs (``fresh_draws``), so a check sees the same inputs whatever
ran before it in the process -- a verdict that depended on the order
captures were checked in would not be one: floats uniform in [0, 1), integers zero,
bools true (masks that keep everything) -- executed ops have domains
(``binary_cross_entropy`` needs [0, 1], embeddings in-range indices), and
these values were safe for every case tried.
Retained copies of a live call's tensors (``verify="values"``) are bound
through the same path with ``leaves=``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.utils._pytree as _pytree

from .frozen import freeze_constants
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
)

__all__ = ["BINDINGS", "bind_call", "build", "fresh_draws", "inputs_for", "materialize",
           "materialize_leaves", "tensor"]

#: ``native``: the module's own arguments; ``flattened``: the call's tensor
#: leaves, positionally (arguments torch's pytree does not know are rebuilt
#: inside the captured callable)
BINDINGS = ("native", "flattened")

Tensor = torch.Tensor
_generators: dict[str, torch.Generator] = {}


def _generator(device: torch.device) -> torch.Generator:
    key = str(device)
    gen = _generators.get(key)
    if gen is None:
        gen = torch.Generator(device=device)
        gen.manual_seed(0)
        _generators[key] = gen
    return gen


def fresh_draws() -> None:
    """Start the private generators over: the inputs made next are those the
    first call of a process gets, whatever was drawn before."""
    for gen in _generators.values():
        gen.manual_seed(0)


def _dense(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Whether every element has its own storage slot and none is skipped."""
    expected = 1
    for n, s in sorted(zip(shape, stride), key=lambda p: p[1]):
        if n == 1:
            continue
        if s != expected:
            return False
        expected *= n
    return True


def _fill(t: Tensor, dtype: torch.dtype, device: torch.device, fill: str) -> None:
    if device.type == "meta":
        return
    with torch.no_grad():
        if dtype.is_floating_point and fill != "zeros":
            t.uniform_(0.0, 1.0, generator=_generator(device))
        elif dtype == torch.bool and fill != "zeros":
            # masks that keep everything: an all-false attention mask would
            # hide every position (and make softmax NaN on both sides of a
            # comparison), so a graph reading the wrong cache slot would pass
            t.fill_(True)
        else:
            t.zero_()  # safe indices; complex zeros


def tensor(spec: TensorSpec, fill: str = "uniform") -> Tensor:
    """A fresh tensor with ``spec``'s shape, strides, dtype, device and
    ``requires_grad``."""
    device = torch.device(spec.device)
    grad = spec.requires_grad and (spec.dtype.is_floating_point or spec.dtype.is_complex)
    if len(spec.stride) == len(spec.shape) and _dense(spec.shape, spec.stride):
        # A plain tensor with the live strides: an input that is a view of a
        # larger base makes export fakify the base too, a third slower.
        t = torch.empty_strided(spec.shape, spec.stride, dtype=spec.dtype, device=device)
        _fill(t, spec.dtype, device, fill)
        return t.requires_grad_(True) if grad else t
    # Overlapping strides (an expanded input, stride 0) cannot be written
    # element by element: fill a dense base and view it with those strides.
    if spec.stride and spec.shape:
        numel = 0 if any(n == 0 for n in spec.shape) else \
            1 + sum((n - 1) * s for n, s in zip(spec.shape, spec.stride))
    else:
        numel = 1
        for n in spec.shape:
            numel *= n
    base = torch.empty(max(numel, 0), dtype=spec.dtype, device=device)
    _fill(base, spec.dtype, device, fill)
    t = base.as_strided(spec.shape, spec.stride) if spec.stride else base.reshape(spec.shape)
    return t.detach().requires_grad_(True) if grad else t


def build(spec: Spec, make: Callable[[TensorSpec], Tensor]) -> Any:
    """A value shaped like ``spec`` whose tensors come from ``make``."""
    if isinstance(spec, TensorSpec):
        return make(spec)
    if isinstance(spec, ConstSpec):
        return spec.value
    if isinstance(spec, SeqSpec):
        items = [build(s, make) for s in spec.items]
        if spec.kind is list:
            return items
        if spec.kind is tuple:
            return tuple(items)
        return spec.kind(*items)  # namedtuple
    if isinstance(spec, DictSpec):
        return spec.kind(zip(spec.keys, (build(s, make) for s in spec.values)))
    if isinstance(spec, PytreeSpec):
        kids = [build(s, make) for s in spec.children]
        return _pytree.SUPPORTED_NODES[spec.cls].unflatten_fn(kids, spec.context)
    if isinstance(spec, DataclassSpec):
        values = {n: build(s, make) for n, s in zip(spec.names, spec.values)}
        init = {f.name for f in dataclasses.fields(spec.cls) if f.init}
        try:
            obj = spec.cls(**{k: v for k, v in values.items() if k in init})
        except Exception:  # a user's __init__ may raise anything
            obj = object.__new__(spec.cls)
        for k, v in values.items():
            if k not in init:
                object.__setattr__(obj, k, v)
        return obj
    if isinstance(spec, ObjectSpec):
        obj = object.__new__(spec.cls)
        obj.__dict__.update({n: build(s, make) for n, s in zip(spec.names, spec.values)})
        return obj
    raise TypeError(f"not a spec: {spec!r}")


def materialize(spec: Spec, *, fill: str = "uniform") -> Any:
    """A fresh value matching ``spec``."""
    return build(spec, lambda s: tensor(s, fill))


def _maker(leaves: Iterable[Tensor] | None, fill: str) -> Callable[[TensorSpec], Tensor]:
    if leaves is None:
        return lambda s: tensor(s, fill)
    it = iter(leaves)
    return lambda _s: next(it)


def bind_call(call: CallSpec, make: Callable[[TensorSpec], Tensor]
              ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` for ``call`` with tensors from ``make`` (in leaf order)
    and pristine copies of its mutable constants."""
    call = freeze_constants(call)  # each use mutates its own copies
    return (tuple(build(a, make) for a in call.args),
            {k: build(v, make) for k, v in call.kwargs})


def materialize_leaves(call: CallSpec, *, fill: str = "uniform") -> tuple[Tensor, ...]:
    """Fresh tensors for a call's tensor leaves, in ``CallSpec.leaves()`` order
    (drawn from the start, ``fresh_draws``)."""
    fresh_draws()
    return tuple(tensor(s, fill) for _, s in call.leaves())


def inputs_for(call: CallSpec, binding: str, *, leaves: Iterable[Tensor] | None = None,
               fill: str = "uniform") -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The inputs of a capture with ``binding``: fresh, or the given ``leaves``
    (retained copies of a live call's tensors, in leaf order)."""
    if binding == "flattened":
        if leaves is None:
            return materialize_leaves(call, fill=fill), {}
        return tuple(leaves), {}
    if binding != "native":
        raise ValueError(f"binding: {binding!r} is not one of {list(BINDINGS)}")
    if leaves is None:
        fresh_draws()
    return bind_call(call, _maker(leaves, fill))
