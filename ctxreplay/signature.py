"""Tensor specs, call signatures, the cheap per-call key, and materialising
inputs from specs.

Specs describe values without holding them: a ``TensorSpec`` keeps shape,
stride, dtype, device and ``requires_grad``, never data (DESIGN.md fact 10).
Containers, dataclasses and pytree-registered types nest.  Other objects that
hold no tensor are kept as constants; an object that holds tensors in its
attributes is described attribute by attribute and rebuilt at finalize.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import functools
import types
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import torch
import torch.utils._pytree as _pytree

from ._json import dtype_name

__all__ = [
    "CallSpec",
    "ConstSpec",
    "DataclassSpec",
    "DictSpec",
    "ObjectSpec",
    "PytreeSpec",
    "SeqSpec",
    "Spec",
    "SpecMismatch",
    "TensorSpec",
    "call_key",
    "compare_specs",
    "materialize",
    "spec_of",
    "spec_to_json",
    "tensor_leaves",
]

Tensor = torch.Tensor
_PRIMITIVES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device,
               torch.layout, torch.memory_format)


@attrs.frozen(cache_hash=True)
class TensorSpec:
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: str
    requires_grad: bool = False

    @classmethod
    def of(cls, t: Tensor) -> TensorSpec:
        return cls(tuple(t.shape), tuple(t.stride()) if t.layout == torch.strided else (),
                   t.dtype, str(t.device), bool(t.requires_grad))


@attrs.frozen
class ConstSpec:
    """A value without tensors, kept as is (ints, strings, enums, configs)."""

    value: Any = attrs.field(eq=False)
    type_name: str
    key: Any = None  # hashable summary used for equality

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ConstSpec) and self.key == other.key \
            and self.type_name == other.type_name

    def __hash__(self) -> int:
        return hash((self.type_name, self.key))


@attrs.frozen
class SeqSpec:
    kind: type
    items: tuple[Spec, ...]


@attrs.frozen
class DictSpec:
    kind: type
    keys: tuple[Any, ...]
    values: tuple[Spec, ...]


@attrs.frozen
class DataclassSpec:
    cls: type
    names: tuple[str, ...]
    values: tuple[Spec, ...]


@attrs.frozen
class PytreeSpec:
    """A type registered with torch's pytree (e.g. a framework's cache)."""

    cls: type
    context: Any = attrs.field(eq=False)
    children: tuple[Spec, ...]


@attrs.frozen
class ObjectSpec:
    """An opaque object whose attributes hold tensors: rebuilt attribute-wise."""

    cls: type
    names: tuple[str, ...]
    values: tuple[Spec, ...]


Spec = TensorSpec | ConstSpec | SeqSpec | DictSpec | DataclassSpec | PytreeSpec | ObjectSpec


@attrs.frozen
class CallSpec:
    args: tuple[Spec, ...]
    kwargs: tuple[tuple[str, Spec], ...]

    def leaves(self) -> Iterator[tuple[str, TensorSpec]]:
        for i, a in enumerate(self.args):
            yield from tensor_leaves(a, f"args[{i}]")
        for k, v in self.kwargs:
            yield from tensor_leaves(v, f"kwargs[{k!r}]")

    def is_pytree_native(self) -> bool:
        """Whether torch.export can take these arguments as they are."""
        return all(_native(s) for s in self.args) and all(_native(s) for _, s in self.kwargs)


def _holds_tensor(obj: object) -> bool:
    d = getattr(obj, "__dict__", None)
    if not d:
        return False
    return any(isinstance(v, Tensor) or (isinstance(v, (list, tuple)) and v
               and isinstance(v[0], Tensor)) for v in d.values())


# callables, classes, modules: the same only when they are the same object
_BY_IDENTITY = (types.FunctionType, types.MethodType, types.BuiltinFunctionType, type,
                types.ModuleType, torch.nn.Module, functools.partial)


def _attr_key(value: object) -> Any:
    t = type(value)
    if t in _PRIMITIVES:
        return (t, value)
    if isinstance(value, enum.Enum):
        return (t, value.name)
    if t in (tuple, list, dict):
        return (t, len(value))  # type: ignore[arg-type]
    return (t,)


def _const_key(value: object) -> Any:
    """Equality key of a constant argument.

    A plain object that compares by identity (the default ``__eq__``) is
    keyed by its class and its own scalar attributes instead (nested objects
    and containers count by type and length only), so a framework that builds
    a fresh metadata object every step does not make every call a new
    variant, and a cache that fills layer by layer stays one variant.
    """
    t = type(value)
    if t in _PRIMITIVES:
        return (t, value)
    if isinstance(value, enum.Enum):
        return (t, value.name)
    if getattr(t, "__eq__", None) is object.__eq__ \
            and not isinstance(value, _BY_IDENTITY):
        state = getattr(value, "__dict__", None)
        if isinstance(state, dict) and len(state) <= 64:
            return (t, tuple((k, _attr_key(v)) for k, v in state.items()))
    try:
        hash(value)
        return (t, value)
    except TypeError:
        return (t, id(value))


def spec_of(value: object, _depth: int = 0) -> Spec:
    """Describe ``value`` without retaining a tensor."""
    if _depth > 64:
        raise ValueError("argument nesting deeper than 64 levels")
    if isinstance(value, Tensor):
        return TensorSpec.of(value)
    t = type(value)
    if t in _PRIMITIVES or isinstance(value, enum.Enum):
        return ConstSpec(value, t.__qualname__, _const_key(value))
    if t in (tuple, list) or (isinstance(value, tuple) and hasattr(value, "_fields")):
        return SeqSpec(t, tuple(spec_of(v, _depth + 1) for v in value))  # type: ignore[attr-defined]
    if isinstance(value, dict) and t in (dict, collections.OrderedDict):
        return DictSpec(t, tuple(value), tuple(spec_of(v, _depth + 1) for v in value.values()))
    if t in _pytree.SUPPORTED_NODES:
        children, context = _pytree.SUPPORTED_NODES[t].flatten_fn(value)
        return PytreeSpec(t, context, tuple(spec_of(c, _depth + 1) for c in children))
    if dataclasses.is_dataclass(value):
        names = tuple(f.name for f in dataclasses.fields(value))
        return DataclassSpec(t, names, tuple(spec_of(getattr(value, n), _depth + 1)
                                             for n in names))
    if _holds_tensor(value):
        d = vars(value)
        return ObjectSpec(t, tuple(d), tuple(spec_of(v, _depth + 1) for v in d.values()))
    return ConstSpec(value, t.__qualname__, _const_key(value))


def tensor_values(value: object, _depth: int = 0) -> Iterator[Tensor]:
    """The tensors inside ``value``, in the order ``spec_of`` describes them
    (and ``tensor_leaves`` lists them)."""
    if _depth > 64:
        raise ValueError("value nesting deeper than 64 levels")
    if isinstance(value, Tensor):
        yield value
        return
    t = type(value)
    if t in _PRIMITIVES or isinstance(value, enum.Enum):
        return
    if t in (tuple, list) or (isinstance(value, tuple) and hasattr(value, "_fields")):
        children: Any = value
    elif isinstance(value, dict) and t in (dict, collections.OrderedDict):
        children = value.values()
    elif t in _pytree.SUPPORTED_NODES:
        children = _pytree.SUPPORTED_NODES[t].flatten_fn(value)[0]
    elif dataclasses.is_dataclass(value):
        children = [getattr(value, f.name) for f in dataclasses.fields(value)]
    elif _holds_tensor(value):
        children = vars(value).values()
    else:
        return
    for child in children:
        yield from tensor_values(child, _depth + 1)


def materialize_leaves(call: CallSpec, *, fill: str = "uniform") -> tuple[Tensor, ...]:
    """Fresh tensors for a call's tensor leaves, in ``CallSpec.leaves()`` order
    (the positional inputs of a capture with ``binding="flattened"``)."""
    return tuple(_tensor(s, fill) for _, s in call.leaves())


def tensor_leaves(spec: Spec, path: str = "") -> Iterator[tuple[str, TensorSpec]]:
    """``(path, TensorSpec)`` for every tensor in a spec tree, in order."""
    if isinstance(spec, TensorSpec):
        yield path, spec
    elif isinstance(spec, SeqSpec):
        for i, s in enumerate(spec.items):
            yield from tensor_leaves(s, f"{path}[{i}]")
    elif isinstance(spec, DictSpec):
        for k, s in zip(spec.keys, spec.values):
            yield from tensor_leaves(s, f"{path}[{k!r}]")
    elif isinstance(spec, (DataclassSpec, ObjectSpec)):
        for n, s in zip(spec.names, spec.values):
            yield from tensor_leaves(s, f"{path}.{n}")
    elif isinstance(spec, PytreeSpec):
        for i, s in enumerate(spec.children):
            yield from tensor_leaves(s, f"{path}.<{i}>")


def _native(spec: Spec) -> bool:
    if isinstance(spec, (TensorSpec,)):
        return True
    if isinstance(spec, ConstSpec):
        return type(spec.value) in _PRIMITIVES
    if isinstance(spec, SeqSpec):
        return all(_native(s) for s in spec.items)
    if isinstance(spec, DictSpec):
        return all(_native(s) for s in spec.values)
    if isinstance(spec, PytreeSpec):
        return all(_native(s) for s in spec.children)
    return False


# -- the per-call key (hot path) ------------------------------------------------

def _key(x: object) -> Any:
    if isinstance(x, Tensor):
        return (x.dtype, x.shape, x.device, x.requires_grad)
    t = type(x)
    if t is tuple or t is list:
        return (t, *[_key(v) for v in x])  # type: ignore[attr-defined]
    if t is dict:
        return (dict, *[(k, _key(v)) for k, v in x.items()])  # type: ignore[attr-defined]
    if t in _PRIMITIVES:
        return (t, x)
    return _slow_key(x)


def _slow_key(x: object) -> Any:
    # Rare shapes of argument: describe fully, then hash the description.
    return spec_of(x)


def call_key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A cheap hashable key of a call's input signature.

    Tensors contribute dtype, shape, device and ``requires_grad`` (not
    strides: a non-contiguous input of the same shape shares the variant of
    the first one seen).  Python scalars contribute their value, since
    tracing specialises on them.
    """
    if kwargs:
        return (tuple([_key(a) for a in args]), tuple([(k, _key(v)) for k, v in kwargs.items()]))
    if len(args) == 1:
        x = args[0]
        if isinstance(x, Tensor):  # the common case, without a call layer
            return (x.dtype, x.shape, x.device, x.requires_grad)
        return (_key(x),)
    return tuple([_key(a) for a in args])


# -- materialising --------------------------------------------------------------

_generators: dict[str, torch.Generator] = {}


def _generator(device: torch.device) -> torch.Generator:
    """A private generator per device: materialising example inputs must not
    move the user's global random state."""
    key = str(device)
    gen = _generators.get(key)
    if gen is None:
        gen = torch.Generator(device=device)
        gen.manual_seed(0)
        _generators[key] = gen
    return gen


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
            # [0, 1) is safe for ops with a [0, 1] domain (fact 11)
            t.uniform_(0.0, 1.0, generator=_generator(device))
        else:
            t.zero_()  # safe indices, false masks; complex zeros


def _tensor(spec: TensorSpec, fill: str) -> Tensor:
    device = torch.device(spec.device)
    if len(spec.stride) == len(spec.shape) and _dense(spec.shape, spec.stride):
        # A plain tensor with the live strides: an input that is a view of a
        # larger base makes export fakify the base too, a third slower.
        t = torch.empty_strided(spec.shape, spec.stride, dtype=spec.dtype, device=device)
        _fill(t, spec.dtype, device, fill)
        if spec.requires_grad and (spec.dtype.is_floating_point or spec.dtype.is_complex):
            t.requires_grad_(True)
        return t
    # Overlapping strides (an expanded input, stride 0) cannot be written
    # element by element: fill a dense base and view it with those strides.
    if spec.stride and spec.shape:
        numel = 1 + sum((n - 1) * s for n, s in zip(spec.shape, spec.stride) if n > 0)
        if any(n == 0 for n in spec.shape):
            numel = 0
    else:
        numel = 1
        for n in spec.shape:
            numel *= n
    base = torch.empty(max(numel, 0), dtype=spec.dtype, device=device)
    _fill(base, spec.dtype, device, fill)
    t = base.as_strided(spec.shape, spec.stride) if spec.stride else base.reshape(spec.shape)
    if spec.requires_grad and (spec.dtype.is_floating_point or spec.dtype.is_complex):
        t = t.detach().requires_grad_(True)
    return t


def materialize(spec: Spec, *, fill: str = "uniform",
                tensor_factory: Callable[[TensorSpec], Tensor] | None = None) -> Any:
    """A fresh value matching ``spec``: floats uniform in [0, 1), integers 0,
    bools false.  Call it outside the live forward (DESIGN.md fact 10)."""
    make = tensor_factory or (lambda s: _tensor(s, fill))
    return _build(spec, make)


def _build(spec: Spec, make: Callable[[TensorSpec], Tensor]) -> Any:
    if isinstance(spec, TensorSpec):
        return make(spec)
    if isinstance(spec, ConstSpec):
        return spec.value
    if isinstance(spec, SeqSpec):
        items = [_build(s, make) for s in spec.items]
        if spec.kind is list:
            return items
        if spec.kind is tuple:
            return tuple(items)
        return spec.kind(*items)  # namedtuple
    if isinstance(spec, DictSpec):
        return spec.kind(zip(spec.keys, (_build(s, make) for s in spec.values)))
    if isinstance(spec, PytreeSpec):
        children = [_build(s, make) for s in spec.children]
        return _pytree.SUPPORTED_NODES[spec.cls].unflatten_fn(children, spec.context)
    if isinstance(spec, DataclassSpec):
        values = {n: _build(s, make) for n, s in zip(spec.names, spec.values)}
        init = {f.name for f in dataclasses.fields(spec.cls) if f.init}
        try:
            obj = spec.cls(**{k: v for k, v in values.items() if k in init})
        except Exception:
            obj = object.__new__(spec.cls)
        for k, v in values.items():
            if k not in init:
                object.__setattr__(obj, k, v)
        return obj
    if isinstance(spec, ObjectSpec):
        obj = object.__new__(spec.cls)
        obj.__dict__.update({n: _build(s, make) for n, s in zip(spec.names, spec.values)})
        return obj
    raise TypeError(f"not a spec: {spec!r}")


def materialize_call(call: CallSpec, *, fill: str = "uniform") -> tuple[tuple[Any, ...],
                                                                        dict[str, Any]]:
    return (tuple(materialize(a, fill=fill) for a in call.args),
            {k: materialize(v, fill=fill) for k, v in call.kwargs})


# -- comparing ------------------------------------------------------------------

@attrs.frozen
class SpecMismatch:
    """One difference between a live and a captured output."""

    path: str
    field: str
    live: str
    captured: str


def compare_specs(live: Spec, captured: Spec, path: str = "out", *,
                  requires_grad: bool = True,
                  free_dims: dict[str, frozenset[int]] | None = None) -> list[SpecMismatch]:
    """Structured differences (dtype, shape, device, requires_grad, nesting).

    ``requires_grad``: report a live output that required grad where the
    captured one does not (autograd was lost).  The reverse is not a
    mismatch: an artifact run with grad enabled may track what a live
    no-grad call did not.  ``False`` skips the field: traced graph metadata
    is functional and says nothing about autograd.  ``free_dims``: per path,
    dimensions not compared (those the captured graph left symbolic)."""
    out: list[SpecMismatch] = []
    _compare(live, captured, path, out, requires_grad, free_dims or {})
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


def _shapes_differ(a: tuple[Any, ...], b: tuple[Any, ...], free: frozenset[int]) -> bool:
    if len(a) != len(b):
        return True
    # A symbolic dimension (data-dependent or dynamic) matches any size, and
    # so does a dimension the captured graph declared symbolic.
    return any(i not in free and type(x) is int and type(y) is int and x != y
               for i, (x, y) in enumerate(zip(a, b)))


def symbolic_dims(spec: Spec, path: str = "out") -> dict[str, frozenset[int]]:
    """Per tensor path, the dimensions a captured spec leaves symbolic."""
    out: dict[str, frozenset[int]] = {}
    if isinstance(spec, TensorSpec):
        free = frozenset(i for i, d in enumerate(spec.shape) if type(d) is not int)
        if free:
            out[path] = free
        return out
    for sub, child in _children(spec) or []:
        out.update(symbolic_dims(child, path + sub))
    return out


def _compare(a: Spec, b: Spec, path: str, out: list[SpecMismatch], rg: bool,
             free: dict[str, frozenset[int]]) -> None:
    if isinstance(a, TensorSpec) and isinstance(b, TensorSpec):
        if a.dtype != b.dtype:
            out.append(SpecMismatch(path, "dtype", dtype_name(a.dtype), dtype_name(b.dtype)))
        if _shapes_differ(a.shape, b.shape, free.get(path, frozenset())):
            out.append(SpecMismatch(path, "shape", str(list(a.shape)), str(list(b.shape))))
        if torch.device(a.device).type != torch.device(b.device).type:
            out.append(SpecMismatch(path, "device", a.device, b.device))
        if rg and a.requires_grad and not b.requires_grad:
            out.append(SpecMismatch(path, "requires_grad", str(a.requires_grad),
                                    str(b.requires_grad)))
        return
    la, lb = _children(a), _children(b)
    if la is None or lb is None or len(la) != len(lb):
        if _kind(a) != _kind(b):
            out.append(SpecMismatch(path, "structure", _kind(a), _kind(b)))
        return
    for (sub, ca), (_, cb) in zip(la, lb):
        _compare(ca, cb, f"{path}{sub}", out, rg, free)


def _children(spec: Spec) -> list[tuple[str, Spec]] | None:
    if isinstance(spec, SeqSpec):
        return [(f"[{i}]", s) for i, s in enumerate(spec.items)]
    if isinstance(spec, DictSpec):
        return [(f"[{k!r}]", s) for k, s in zip(spec.keys, spec.values)]
    if isinstance(spec, (DataclassSpec, ObjectSpec)):
        return [(f".{n}", s) for n, s in zip(spec.names, spec.values)]
    if isinstance(spec, PytreeSpec):
        return [(f".<{i}>", s) for i, s in enumerate(spec.children)]
    return None


def flatten_spec(spec: Spec) -> list[Spec]:
    """Tensor and constant leaves in order (what a flattened output returns)."""
    ch = _children(spec)
    if ch is None:
        return [spec]
    return [leaf for _, c in ch for leaf in flatten_spec(c)]


# -- JSON (metadata only) ------------------------------------------------------

def _dims(dims: tuple[Any, ...]) -> list[int | str]:
    # a symbolic dimension (a SymInt from a dynamic graph) is named, not evaluated
    return [d if type(d) is int else str(d) for d in dims]


def spec_to_json(spec: Spec) -> Any:
    """Metadata only: shapes, dtypes, devices and type names; never values of
    tensors, and never string contents (they may be prompts)."""
    if isinstance(spec, TensorSpec):
        return {"tensor": {"shape": _dims(spec.shape), "stride": _dims(spec.stride),
                           "dtype": dtype_name(spec.dtype), "device": spec.device,
                           "requires_grad": spec.requires_grad}}
    if isinstance(spec, ConstSpec):
        v = spec.value
        if v is None or type(v) in (bool, int, float):
            return {"const": spec.type_name, "value": v}
        if isinstance(v, (torch.dtype, torch.device)):
            return {"const": spec.type_name, "value": str(v)}
        if isinstance(v, enum.Enum):
            return {"const": spec.type_name, "value": v.name}
        return {"const": spec.type_name}
    if isinstance(spec, SeqSpec):
        return {"seq": spec.kind.__qualname__, "items": [spec_to_json(s) for s in spec.items]}
    if isinstance(spec, DictSpec):
        return {"dict": spec.kind.__qualname__,
                "items": [[str(k) if isinstance(k, (str, int)) else type(k).__qualname__,
                           spec_to_json(s)] for k, s in zip(spec.keys, spec.values)]}
    children = _children(spec) or []
    return {"object": spec.cls.__qualname__,
            "fields": [[sub, spec_to_json(s)] for sub, s in children]}
