"""Copies of mutable constant arguments, so a capture sees what the live call saw.

A call's non-tensor arguments are kept as constants (``ConstSpec``).  Some are
mutable objects that the forward itself changes: a small config dict a
block updates, a list it appends to.  Kept by reference, the constant would
be captured in the state the *end* of the live forward left it in -- and
every trace and every verification run would mutate it further.  So such a
constant is copied once when the variant is first observed, and copied
again for each use at capture (each trace and each execution gets a
pristine one).  A ``torch.Generator`` passed as an argument is copied with
its state, so capture and verification never advance the user's generator.

Objects that hold tensors anywhere inside are not constants at all:
``spec_of`` describes them attribute by attribute and capture rebuilds them
with fresh tensors.  An object holding a module or anything opaque stays a
reference: copying it would duplicate weights.
"""

from __future__ import annotations

import copy
import enum
import types
from typing import Any

import torch

from .signature import (
    CallSpec,
    ConstSpec,
    DataclassSpec,
    DictSpec,
    ObjectSpec,
    PytreeSpec,
    SeqSpec,
    Spec,
    children,
    map_leaves,
)

__all__ = ["copy_generator", "freeze_constants", "is_object", "may_change_in_python"]

_IMMUTABLE = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device,
              torch.layout, torch.memory_format, torch.Size, frozenset, range, slice)
# deepcopy keeps these by reference: harmless inside a copied object
_ATOMIC = (type, types.FunctionType, types.BuiltinFunctionType, types.ModuleType)
# never copied, and an object holding one is not copied either
_HEAVY = (torch.nn.Module, torch.Tensor, types.MethodType)
_NOT_COPIED = (*_ATOMIC, *_HEAVY, enum.Enum)
_MAX_NODES = 256
_MAX_DEPTH = 8


def copy_generator(g: torch.Generator) -> torch.Generator:
    """A new generator on ``g``'s device in ``g``'s current state."""
    out = torch.Generator(device=g.device)
    out.set_state(g.get_state())
    return out


def _walk_ok(value: Any, depth: int, budget: list[int]) -> bool:
    """Whether ``value`` is a small tree of plain Python data: no tensors, no
    modules, nothing opaque."""
    budget[0] -= 1
    if budget[0] < 0 or depth > _MAX_DEPTH:
        return False
    if isinstance(value, (*_IMMUTABLE, *_ATOMIC, enum.Enum)):
        return True
    if isinstance(value, _HEAVY):
        return False
    if isinstance(value, (list, tuple, set)):
        return all(_walk_ok(v, depth + 1, budget) for v in value)
    if isinstance(value, dict):
        return all(_walk_ok(k, depth + 1, budget) and _walk_ok(v, depth + 1, budget)
                   for k, v in value.items())
    attrs = getattr(value, "__dict__", None)
    if isinstance(attrs, dict) and not callable(value):
        return all(_walk_ok(v, depth + 1, budget) for v in attrs.values())
    return False


def _mutable(value: Any) -> bool:
    if isinstance(value, torch.Generator):
        return True
    if isinstance(value, (*_IMMUTABLE, *_NOT_COPIED)):
        return False
    return isinstance(value, (list, dict, set)) or isinstance(
        getattr(value, "__dict__", None), dict)


def is_object(value: Any) -> bool:
    """Whether a constant is a Python object a forward can change in place
    (its attributes, a container's items): not a scalar, a callable, a
    module, a tensor, an enum or a generator."""
    return not isinstance(value, torch.Generator) and not callable(value) and _mutable(value)


def may_change_in_python(spec: Spec | CallSpec) -> bool:
    """Whether a call's inputs hold something its forward could change in
    Python, which no graph op does: a list or dict (its items), an object,
    dataclass or pytree node (its attributes), or a constant that is such
    an object.  Tensors, tuples of them and plain values cannot be."""
    if isinstance(spec, CallSpec):
        return any(may_change_in_python(s) for _, s in spec.items())
    if isinstance(spec, (DataclassSpec, ObjectSpec, PytreeSpec)):
        return True
    if isinstance(spec, ConstSpec):
        return is_object(spec.value)
    if isinstance(spec, DictSpec) or (isinstance(spec, SeqSpec) and
                                      issubclass(spec.kind, list)):
        return True
    return any(may_change_in_python(c) for _, c in children(spec) or ())


def _copy(spec: ConstSpec) -> Spec:
    value = spec.value
    if isinstance(value, torch.Generator):
        return ConstSpec(copy_generator(value), spec.type_name, spec.key)
    if not _mutable(value) or not _walk_ok(value, 0, [_MAX_NODES]):
        return spec
    try:
        copied = copy.deepcopy(value)
    except Exception:  # an object that refuses copying stays a reference
        return spec
    key = spec.key
    if isinstance(key, tuple) and len(key) == 2 and key[1] is value:
        # the key would otherwise keep the live object (and what the forward
        # puts in it) alive: an identity-compared one is keyed by its id, a
        # value-compared one by its copy
        identity = getattr(type(value), "__eq__", None) is getattr(object, "__eq__", None)
        key = (key[0], id(value) if identity else copied)
    return ConstSpec(copied, spec.type_name, key)


def _freeze(spec: Spec) -> Spec:
    return map_leaves(spec, lambda s: _copy(s) if isinstance(s, ConstSpec) else s)


def _any_mutable(spec: Spec) -> bool:
    if isinstance(spec, ConstSpec):
        return _mutable(spec.value)
    if isinstance(spec, SeqSpec):
        return any(_any_mutable(s) for s in spec.items)
    if isinstance(spec, (DictSpec, DataclassSpec, ObjectSpec)):
        return any(_any_mutable(s) for s in spec.values)
    if isinstance(spec, PytreeSpec):
        return any(_any_mutable(s) for s in spec.children)
    return False


def freeze_constants(call: CallSpec) -> CallSpec:
    """``call`` with every small, tensor-free mutable constant (and every
    generator) replaced by a copy (the same spec object when there is none).
    Never raises on a constant: one that cannot be copied is kept as it is."""
    if not any(_any_mutable(s) for _, s in call.items()):
        return call
    return CallSpec(tuple(_freeze(a) for a in call.args),
                    tuple((k, _freeze(v)) for k, v in call.kwargs))
