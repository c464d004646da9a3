"""Copies of mutable constant arguments, so a capture sees what the live call saw.

A call's non-tensor arguments are kept as constants (``ConstSpec``).  Some are
mutable objects that the forward itself changes: a Hugging Face
``DynamicCache`` is empty when a decoder layer is first called and holds that
layer's keys and values afterwards.  Kept by reference, the constant would be
captured in the state the *end* of the live forward left it in -- and every
trace and every verification run would mutate it further.  So such a
constant is copied once when the variant is first observed, and copied
again for each use at capture (each trace and each execution gets a pristine
one).

Only small, tensor-free objects are copied.  A plain-Python object holding
tensors deeper inside (a cache already filled by earlier steps) is described
attribute by attribute instead -- tensor specs, not tensors -- and rebuilt
with fresh tensors at capture.  An object holding a module or anything
opaque stays a reference: copying it would duplicate weights.
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
    TensorSpec,
    spec_of,
    tensor_leaves,
)

__all__ = ["freeze_constants"]

_IMMUTABLE = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device,
              torch.layout, torch.memory_format, torch.Size, frozenset, range, slice)
# deepcopy keeps these by reference: harmless inside a copied object
_ATOMIC = (type, types.FunctionType, types.BuiltinFunctionType, types.ModuleType)
# never copied, and an object holding one is not copied either
_HEAVY = (torch.nn.Module, torch.Tensor, types.MethodType)
_NOT_COPIED = (*_ATOMIC, *_HEAVY, enum.Enum)
_MAX_NODES = 256
_MAX_DEEP_NODES = 4096
_MAX_DEPTH = 8


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
    if isinstance(value, (*_IMMUTABLE, *_NOT_COPIED)):
        return False
    return isinstance(value, (list, dict, set)) or isinstance(
        getattr(value, "__dict__", None), dict)


def _deep_spec(value: Any, depth: int, budget: list[int]) -> Spec | None:
    """Describe a plain-Python object tree that holds tensors somewhere inside
    (``None`` if it holds a module or something opaque)."""
    budget[0] -= 1
    if budget[0] < 0 or depth > _MAX_DEPTH:
        return None
    if isinstance(value, torch.Tensor):
        return TensorSpec.of(value)
    if isinstance(value, (*_IMMUTABLE, *_ATOMIC, enum.Enum)):
        return spec_of(value)
    if isinstance(value, _HEAVY):
        return None
    if type(value) in (list, tuple):
        items = [_deep_spec(v, depth + 1, budget) for v in value]
        return None if any(i is None for i in items) else SeqSpec(type(value), tuple(
            i for i in items if i is not None))
    if type(value) is dict:
        if not all(isinstance(k, (str, int)) for k in value):
            return None
        vals = [_deep_spec(v, depth + 1, budget) for v in value.values()]
        return None if any(v is None for v in vals) else DictSpec(dict, tuple(value), tuple(
            v for v in vals if v is not None))
    attrs = getattr(value, "__dict__", None)
    if type(attrs) is dict and not callable(value) and not _slotted(type(value)):
        vals = [_deep_spec(v, depth + 1, budget) for v in attrs.values()]
        if any(v is None for v in vals):
            return None
        return ObjectSpec(type(value), tuple(attrs), tuple(v for v in vals if v is not None))
    return None


def _slotted(cls: type) -> bool:
    """Whether instances keep state in slots, outside ``__dict__`` (``abc.ABC``
    declares empty slots, which hold nothing)."""
    for c in cls.__mro__:
        slots = c.__dict__.get("__slots__", ())
        if isinstance(slots, str):
            slots = (slots,)
        if any(name not in ("__dict__", "__weakref__") for name in slots):
            return True
    return False


def _copy(spec: ConstSpec) -> Spec:
    value = spec.value
    if not _mutable(value):
        return spec
    if not _walk_ok(value, 0, [_MAX_NODES]):
        # Tensors deep inside (a cache already holding keys and values): describe
        # the object attribute by attribute, like one holding tensors directly,
        # so capture rebuilds it with fresh tensors of the shapes seen live.
        deep = _deep_spec(value, 0, [_MAX_DEEP_NODES])
        if deep is not None and any(True for _ in tensor_leaves(deep)):
            return deep
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
    if isinstance(spec, ConstSpec):
        return _copy(spec)
    if isinstance(spec, SeqSpec):
        return SeqSpec(spec.kind, tuple(_freeze(s) for s in spec.items))
    if isinstance(spec, DictSpec):
        return DictSpec(spec.kind, spec.keys, tuple(_freeze(s) for s in spec.values))
    if isinstance(spec, DataclassSpec):
        return DataclassSpec(spec.cls, spec.names, tuple(_freeze(s) for s in spec.values))
    if isinstance(spec, ObjectSpec):
        return ObjectSpec(spec.cls, spec.names, tuple(_freeze(s) for s in spec.values))
    if isinstance(spec, PytreeSpec):
        return PytreeSpec(spec.cls, spec.context, tuple(_freeze(s) for s in spec.children))
    return spec


def freeze_constants(call: CallSpec) -> CallSpec:
    """``call`` with every small, tensor-free mutable constant replaced by a
    deep copy (the same spec object when there is none).  Never raises on a
    constant: one that cannot be copied is kept as it is."""
    if not _has_mutable(call):
        return call
    return CallSpec(tuple(_freeze(a) for a in call.args),
                    tuple((k, _freeze(v)) for k, v in call.kwargs))


def _has_mutable(call: CallSpec) -> bool:
    def any_mutable(spec: Spec) -> bool:
        if isinstance(spec, ConstSpec):
            return _mutable(spec.value)
        if isinstance(spec, SeqSpec):
            return any(any_mutable(s) for s in spec.items)
        if isinstance(spec, (DictSpec, DataclassSpec, ObjectSpec)):
            return any(any_mutable(s) for s in spec.values)
        if isinstance(spec, PytreeSpec):
            return any(any_mutable(s) for s in spec.children)
        return False

    return any(any_mutable(a) for a in call.args) or any(any_mutable(v)
                                                         for _, v in call.kwargs)
