"""A member's own parameters and buffers, as a flat program takes them.

``Bound`` finds, once, the dict that holds each tensor the program names
(the owning submodule's ``_parameters`` or ``_buffers``) and makes a
function that reads them all on every call: a tensor replaced in that dict
without an assignment torch's registration hooks see (accelerate's
offloading hooks put a freshly loaded parameter there before each forward)
is the one the call runs with, as it is for the eager forward.  Weights
changed in place -- an optimizer step, ``p.data = ...``, ``load_state_dict``
-- are the same tensor objects, so nothing needs noticing.

What does need noticing is a tensor whose shape, dtype or device changed
in place: ``module.to(torch.float64)`` converts parameters through
``p.data = ...``, keeping the objects.  ``holds`` checks every tensor's
metadata on each call, with torch's C-level ``TensorGuards`` where this
torch has it (~0.15 us a tensor, measured), else in Python.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .._base import codegen
from .._base.torchcaps import TensorGuards
from ..loading.weights import misfit, problems_error
from ..specs.storage import inner_tensor, unwrapped_name
from .flat import Flat

__all__ = ["Bound"]

_Meta = tuple[tuple[int, ...], torch.dtype, torch.device]


class Bound:
    """``state()``: the member's tensors named ``names`` (a program's names, under
    ``prefix``), read now; ``holds(state)``: whether each still has the shape,
    dtype and device in ``meta`` (the program's own tensors'; ``None``: the
    member's when bound, for a program it was bound to already); ``first``:
    the tensors read when bound; ``contiguous``: a program compiled ahead of
    time takes them, which indexes them with the strides it was built with,
    so each must stay contiguous (a weight swapped for a transposed view of
    the same shape does not fit).

    Raises ``WeightsError`` (from the constructor) when the member lacks a
    tensor the program takes or one does not fit it."""

    __slots__ = ("_guard", "contiguous", "first", "meta", "state")

    def __init__(self, names: tuple[str, ...], meta: tuple[_Meta, ...] | None,
                 module: nn.Module, prefix: str) -> None:
        pairs: list[tuple[dict[str, Any], str, int | None]] = []
        problems: list[str] = []
        for i, name in enumerate(names):
            key = name[len(prefix):] if name.startswith(prefix) else name
            where = _holder(module, key)
            if where is None:
                problems.append(f"{key}: missing")
                continue
            problem = None if meta is None else misfit(key, _read(where), *meta[i])
            if problem is not None:
                problems.append(problem)
                continue
            pairs.append(where)
        if problems:
            raise problems_error(problems)
        self.state: Callable[[], tuple[torch.Tensor, ...]] = _reader(pairs)
        self.first = self.state()
        self.meta: tuple[_Meta, ...] = meta if meta is not None else \
            tuple((tuple(t.shape), t.dtype, t.device) for t in self.first)
        self._guard: Any = _guard(self.first)
        self.contiguous = False

    @classmethod
    def of(cls, flat: Flat, module: nn.Module, prefix: str) -> Bound:
        """The member's tensors for a flat program."""
        return cls(flat.state_names, flat.state_meta, module, prefix)

    def same(self, state: tuple[torch.Tensor, ...]) -> bool:
        """Whether ``state`` holds the very tensors read when bound."""
        return all(a is b for a, b in zip(state, self.first))

    def holds(self, state: tuple[torch.Tensor, ...]) -> bool:
        """Whether ``state`` (just read) fits the program; a guard that fails
        on a state that fits (made under another dispatch-key state:
        inference mode) is made again."""
        guard = self._guard
        if guard is not None and guard.check(*state):
            return True
        for t, (shape, dtype, device) in zip(state, self.meta):
            if t.dtype != dtype or t.device != device or tuple(t.shape) != shape:
                return False
            if self.contiguous and not t.is_contiguous():
                return False
        self._guard = _guard(state)
        return True


def _holder(module: nn.Module, key: str) -> tuple[dict[str, Any], str, int | None] | None:
    """The dict holding the tensor ``key`` names and its key there; the third
    item: for a program re-traced through a wrapper subclass (a DTensor
    shard, a quantized weight: ``up.parametrizations.weight.original0``),
    which of the wrapper's inner tensors it is, read at every call."""
    owner_name, _, leaf = key.rpartition(".")
    try:
        owner = module.get_submodule(owner_name) if owner_name else module
    except AttributeError:
        owner = None
    for d in () if owner is None else (owner._parameters, owner._buffers):
        if d.get(leaf) is not None:
            return d, leaf, None
    unwrapped = unwrapped_name(key)
    if unwrapped is None:
        return None
    base = _holder(module, unwrapped[0])
    if base is None or base[2] is not None:
        return None
    try:
        inner_tensor(base[0][base[1]], unwrapped[1])
    except IndexError:
        return None
    return base[0], base[1], unwrapped[1]


def _read(where: tuple[dict[str, Any], str, int | None]) -> torch.Tensor:
    d, key, index = where
    return d[key] if index is None else inner_tensor(d[key], index)


def _reader(pairs: list[tuple[dict[str, Any], str, int | None]]
            ) -> Callable[[], tuple[torch.Tensor, ...]]:
    """One generated function returning each ``d[key]`` in a tuple (the dicts
    and keys go in its namespace, never in its source): one call and one
    tuple per dispatched call."""
    namespace: dict[str, Any] = {"inner": inner_tensor}
    terms = []
    for i, (d, key, index) in enumerate(pairs):
        namespace[f"d{i}"], namespace[f"k{i}"] = d, key
        terms.append(f"d{i}[k{i}]" if index is None else f"inner(d{i}[k{i}], {index:d})")
    source = "def state():\n    return (" + "".join(t + ", " for t in terms) + ")\n"
    reader: Callable[[], tuple[torch.Tensor, ...]] = codegen.function(
        source, "state", namespace, what="member state")
    return reader


def _guard(state: tuple[torch.Tensor, ...]) -> Any:
    if TensorGuards is None or not state or \
            any(not isinstance(t, torch.Tensor) or type(t) not in (torch.Tensor, nn.Parameter)
                for t in state):
        return None
    try:
        return TensorGuards(*state, dynamic_dims_sizes=[list(t.shape) for t in state],
                            dynamic_dims_strides=[list(t.stride()) for t in state])
    except Exception:  # this torch's TensorGuards takes other arguments
        return None
