"""Tensor specs, call signatures, the per-call key, and walking specs
(comparing a live output's spec with a captured one is ``fidelity.compare``).

Specs describe values without holding them: a ``TensorSpec`` keeps shape,
stride, dtype, device and ``requires_grad``, never data: non-strict export
fakifies its inputs, so fresh tensors with that metadata serve to capture.
Containers, dataclasses and pytree-registered types nest.  A plain object
that holds tensors anywhere inside its attributes (a KV cache made of
per-layer objects) is described attribute by attribute (``ObjectSpec``);
any other object is a constant.

One walk decides all of this -- ``_parts`` -- and everything else is built
on it: ``spec_of`` (the capture's description of a call), ``call_key`` (the
live key of a call) and ``tensor_values`` (the tensors of a value, in spec
order).  So the key of a call and what capture takes as its inputs can
never disagree.  ``children`` is the one walker over specs.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import functools
import types
from collections.abc import Iterator
from typing import Any

import attrs
import torch
import torch.utils._pytree as _pytree

from ..errors import Error

__all__ = [
    "PRIMITIVES",
    "CallSpec",
    "ConstSpec",
    "DataclassSpec",
    "DictSpec",
    "NotRealError",
    "ObjectSpec",
    "PytreeSpec",
    "SeqSpec",
    "Spec",
    "TensorSpec",
    "TransformedError",
    "call_key",
    "call_spec",
    "call_tensors",
    "children",
    "flatten_spec",
    "is_native",
    "layout_of",
    "map_leaves",
    "spec_of",
    "tensor_leaves",
    "tensor_values",
]

Tensor = torch.Tensor
PRIMITIVES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device,
              torch.layout, torch.memory_format)
_MAX_DEPTH = 64
_DEEP_BUDGET = 4096  # nodes looked at to decide whether an object holds tensors


@attrs.frozen(cache_hash=True)
class TensorSpec:
    """Shape, stride, dtype, device, ``requires_grad`` and layout of a tensor:
    never its data.  ``layout`` is ``"strided"`` for a plain tensor, else
    torch's layout name (``"sparse_coo"``, ``"sparse_csr"``, ...) or
    ``"nested"`` (a nested tensor: ``shape`` holds its dimension count only,
    as ``-1`` entries, since a nested tensor has no single size)."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: str
    requires_grad: bool = False
    layout: str = "strided"

    @classmethod
    def of(cls, t: Tensor) -> TensorSpec:
        if t.layout == torch.strided and not t.is_nested:
            return cls(tuple(t.shape), tuple(t.stride()), t.dtype, str(t.device),
                       bool(t.requires_grad))
        layout = layout_of(t)
        shape = (-1,) * t.dim() if layout == "nested" else tuple(t.shape)
        return cls(shape, (), t.dtype, str(t.device), bool(t.requires_grad), layout)


def layout_of(t: Tensor) -> str:
    """``"strided"``, ``"nested"`` or torch's name of another layout
    (``"sparse_coo"``, ``"sparse_csr"``, ...): what a graph traced for one
    layout cannot take in place of another."""
    if t.is_nested:
        return "nested"
    return str(t.layout).removeprefix("torch.")


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
    """A list, tuple or namedtuple."""

    kind: type
    items: tuple[Spec, ...]


@attrs.frozen
class DictSpec:
    """A dict or OrderedDict."""

    kind: type
    keys: tuple[Any, ...]
    values: tuple[Spec, ...]


@attrs.frozen
class DataclassSpec:
    """A dataclass instance, field by field."""

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
    """A plain object whose attributes hold tensors: rebuilt attribute-wise."""

    cls: type
    names: tuple[str, ...]
    values: tuple[Spec, ...]


Spec = TensorSpec | ConstSpec | SeqSpec | DictSpec | DataclassSpec | PytreeSpec | ObjectSpec


@attrs.frozen(cache_hash=True)
class CallSpec:
    """The signature of one call: a spec per positional and keyword argument."""

    args: tuple[Spec, ...]
    kwargs: tuple[tuple[str, Spec], ...]

    def leaves(self) -> Iterator[tuple[str, TensorSpec]]:
        """``(path, spec)`` of every tensor the call takes, in capture order."""
        for i, a in enumerate(self.args):
            yield from tensor_leaves(a, f"args[{i}]")
        for k, v in self.kwargs:
            yield from tensor_leaves(v, f"kwargs[{k!r}]")

    def items(self) -> Iterator[tuple[str, Spec]]:
        """``(path, spec)`` of every top-level argument."""
        for i, a in enumerate(self.args):
            yield f"args[{i}]", a
        for k, v in self.kwargs:
            yield f"kwargs[{k!r}]", v

    def is_pytree_native(self) -> bool:
        """Whether torch.export can take these arguments as they are."""
        return all(is_native(s) for _, s in self.items())


class NotRealError(Error):
    """A call's inputs are a tracer's stand-ins (fx proxies, fake or functorch
    tensors), not values of a live forward: observation steps aside."""


class TransformedError(NotRealError):
    """A call's inputs are functorch's wrappers: a live call under a
    ``torch.func`` transform (``vmap``, ``grad``, ``jvp``), which runs, but
    whose tensors no key or copy can read (their values and batch sizes live
    inside the transform): counted as not observed, never dispatched."""


# -- the one walk over values ---------------------------------------------------

# callables, classes, modules: the same only when they are the same object
_BY_IDENTITY = (types.FunctionType, types.MethodType, types.BuiltinFunctionType, type,
                types.ModuleType, torch.nn.Module, functools.partial)
_OPAQUE = (torch.nn.Module, types.FunctionType, types.MethodType, types.BuiltinFunctionType,
           type, types.ModuleType, functools.partial)

_fake_types: tuple[type, ...] | None = None


def _tracer_types() -> tuple[type, ...]:
    global _fake_types
    if _fake_types is None:
        found: list[type] = [torch.fx.Proxy]
        try:
            from torch._subclasses.fake_tensor import FakeTensor
            from torch._subclasses.functional_tensor import FunctionalTensor
            found += [FakeTensor, FunctionalTensor]
        except ImportError:  # pragma: no cover - very old torch
            pass
        _fake_types = tuple(found)
    return _fake_types


_functorch_wrapped = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", None)


def _check_real(t: Tensor) -> None:
    if type(t) is not Tensor and isinstance(t, _tracer_types()):
        raise NotRealError(type(t).__name__)
    if _functorch_wrapped is not None and _functorch_wrapped(t):
        raise TransformedError("functorch wrapper")


def _plain_object(value: object) -> dict[str, Any] | None:
    """The attribute dict of an object that is plain Python data, else None."""
    attrs_ = getattr(value, "__dict__", None)
    cls: Any = type(value)
    if type(attrs_) is not dict or callable(value) or _slotted(cls):
        return None
    return attrs_


@functools.lru_cache(maxsize=512)
def _slotted(cls: Any) -> bool:
    """Whether instances keep state in slots, outside ``__dict__`` (``abc.ABC``
    declares empty slots, which hold nothing)."""
    for c in cls.__mro__:
        slots = c.__dict__.get("__slots__", ())
        if isinstance(slots, str):
            slots = (slots,)
        if any(name not in ("__dict__", "__weakref__") for name in slots):
            return True
    return False


def _holds_tensors(value: object, budget: list[int], depth: int = 0) -> bool:
    """Whether tensors are reachable through plain containers and attributes
    of ``value`` (bounded; modules and callables are not looked into)."""
    budget[0] -= 1
    if budget[0] < 0 or depth > 16:
        return False
    if isinstance(value, Tensor):
        return True
    if isinstance(value, (*PRIMITIVES, enum.Enum, *_OPAQUE)):
        return False
    if isinstance(value, (list, tuple, set, frozenset)):
        return any(_holds_tensors(v, budget, depth + 1) for v in value)
    if isinstance(value, dict):
        return any(_holds_tensors(v, budget, depth + 1) for v in value.values())
    d = _plain_object(value)
    return d is not None and any(_holds_tensors(v, budget, depth + 1) for v in d.values())


def _parts(value: object) -> tuple[str, Any]:
    """How the walk sees ``value``: ``("tensor", t)``, ``("const", None)``, or
    a container kind with its children.  The single source of truth for
    ``spec_of``, ``call_key`` and ``tensor_values``."""
    if isinstance(value, Tensor):
        return "tensor", value
    t = type(value)
    if t in PRIMITIVES or isinstance(value, enum.Enum):
        return "const", None
    if isinstance(value, torch.fx.Proxy):
        return "proxy", value
    if t in (tuple, list) or (isinstance(value, tuple) and hasattr(value, "_fields")):
        return "seq", value
    if isinstance(value, dict) and t in (dict, collections.OrderedDict):
        return "dict", value
    if t in _pytree.SUPPORTED_NODES:
        return "pytree", _pytree.SUPPORTED_NODES[t].flatten_fn(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return "dataclass", value
    d = _plain_object(value)
    if d is not None and _holds_tensors(value, [_DEEP_BUDGET]):
        return "object", d
    return "const", None


def spec_of(value: object) -> Spec:
    """Describe ``value`` without retaining a tensor (also a traced graph's
    fake values)."""
    return _spec(value, 0, False)


def _spec(value: object, depth: int, live: bool) -> Spec:
    """``live``: the value comes from a live call -- a tracer's stand-ins
    (fx proxies, fake or functorch tensors) raise ``NotRealError``."""
    if depth > _MAX_DEPTH:
        raise ValueError(f"argument nesting deeper than {_MAX_DEPTH} levels")
    kind, inner = _parts(value)
    d = depth + 1
    if kind == "tensor":
        if live:
            _check_real(inner)
        return TensorSpec.of(inner)
    if kind == "proxy" and live:
        raise NotRealError("fx proxy")
    if kind == "seq":
        return SeqSpec(type(value), tuple(_spec(v, d, live) for v in inner))
    if kind == "dict":
        return DictSpec(type(value), tuple(inner),
                        tuple(_spec(v, d, live) for v in inner.values()))
    if kind == "pytree":
        kids, context = inner
        return PytreeSpec(type(value), context, tuple(_spec(c, d, live) for c in kids))
    if kind == "dataclass":
        names = tuple(f.name for f in dataclasses.fields(inner))
        return DataclassSpec(type(value), names, tuple(_spec(getattr(value, n), d, live)
                                                       for n in names))
    if kind == "object":
        return ObjectSpec(type(value), tuple(inner), tuple(_spec(v, d, live)
                                                           for v in inner.values()))
    return ConstSpec(value, type(value).__qualname__, _const_key(value))


def call_spec(args: tuple[Any, ...], kwargs: dict[str, Any]) -> CallSpec:
    """The ``CallSpec`` of a live call; ``NotRealError`` for a tracer's stand-ins."""
    return CallSpec(tuple(_spec(a, 0, True) for a in args),
                    tuple((k, _spec(v, 0, True)) for k, v in kwargs.items()))


def tensor_values(value: object, _depth: int = 0) -> Iterator[Tensor]:
    """The tensors inside ``value``, in the order ``spec_of`` describes them
    (and ``tensor_leaves`` lists them)."""
    if _depth > _MAX_DEPTH:
        raise ValueError(f"value nesting deeper than {_MAX_DEPTH} levels")
    kind, inner = _parts(value)
    if kind == "tensor":
        yield inner
        return
    if kind in ("const", "proxy"):
        return
    if kind == "dict" or kind == "object":
        kids: Any = inner.values()
    elif kind == "pytree":
        kids = inner[0]
    elif kind == "dataclass":
        kids = [getattr(value, f.name) for f in dataclasses.fields(inner)]
    else:
        kids = inner
    for child in kids:
        yield from tensor_values(child, _depth + 1)


def call_tensors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Tensor]:
    """The tensors a call takes, in ``CallSpec.leaves()`` order (keyword
    arguments in the order given)."""
    out = [t for a in args for t in tensor_values(a)]
    if kwargs:
        out += [t for v in kwargs.values() for t in tensor_values(v)]
    return out


_CONTENT_BUDGET = 256  # values looked at to key one constant by content
_MAX_ATTRS = 64


def _const_key(value: object) -> Any:
    """Equality key of a constant argument, made from its content at this call.

    Containers (dict subclasses too) and plain objects -- a ``SimpleNamespace``,
    a metadata object a framework fills anew every step or reuses and
    mutates -- are keyed by what they hold now, recursively (nested dicts
    and lists by their items); callables, classes and modules by identity;
    value-comparable hashable objects by ``==``.  Only an object too large
    to look through is keyed by ``id()`` (its content not seen).
    """
    key = _content(value, [_CONTENT_BUDGET], 0)
    return key if key is not _TOO_LARGE else (type(value), "id", id(value))


_TOO_LARGE = ("<too large>",)


def _content(value: object, budget: list[int], depth: int) -> Any:
    budget[0] -= 1
    if budget[0] < 0 or depth > 16:
        return _TOO_LARGE
    t = type(value)
    if t in PRIMITIVES:
        return (t, value)
    if isinstance(value, enum.Enum):
        return (t, value.name)
    if isinstance(value, Tensor):  # a tensor beyond what the walk looks into
        return (t, "tensor", value.dtype, tuple(value.shape), str(value.device))
    if isinstance(value, _BY_IDENTITY):
        return (t, "id", id(value))
    if isinstance(value, (tuple, list, set, frozenset)):
        items = [_content(v, budget, depth + 1) for v in value]
        if isinstance(value, (set, frozenset)):
            items.sort(key=repr)
        return _TOO_LARGE if any(i is _TOO_LARGE for i in items) else (t, tuple(items))
    if isinstance(value, dict):
        pairs = [(_content(k, budget, depth + 1), _content(v, budget, depth + 1))
                 for k, v in value.items()]
        return _TOO_LARGE if any(k is _TOO_LARGE or v is _TOO_LARGE for k, v in pairs) \
            else (t, tuple(pairs))
    return _object_content(value, t, budget, depth)


def _object_content(value: object, t: type, budget: list[int], depth: int) -> Any:
    """A plain object by its attributes; a callable object (a processor) by
    identity; a hashable value-comparable one (a frozen config) by ``==``."""
    state = getattr(value, "__dict__", None)
    custom_eq = getattr(t, "__eq__", None) is not object.__eq__
    if custom_eq and getattr(t, "__hash__", None) is not None:
        try:
            hash(value)
            return (t, value)
        except TypeError:  # a mutable value class: keyed by content below
            pass
    if callable(value) or type(state) is not dict:
        return (t, "id", id(value))
    if len(state) > _MAX_ATTRS:
        return _TOO_LARGE
    items = [(k, _content(v, budget, depth + 1)) for k, v in state.items()]
    return _TOO_LARGE if any(v is _TOO_LARGE for _, v in items) else (t, tuple(items))


# -- the per-call key -------------------------------------------------------------

def _key(x: object) -> Any:
    # tensors, plain containers and primitives as tuples (cheap); everything
    # else through spec_of -- the walk capture uses
    if isinstance(x, Tensor):
        if type(x) is not Tensor:
            _check_real(x)
        elif _functorch_wrapped is not None and _functorch_wrapped(x):
            raise TransformedError("functorch wrapper")
        if x.layout != torch.strided or x.is_nested:
            return TensorSpec.of(x)  # sparse or nested: the layout is part of the key
        return (x.dtype, x.shape, x.stride(), x.device, x.requires_grad)
    t = type(x)
    if t is tuple or t is list:
        return (t, *[_key(v) for v in x])  # type: ignore[attr-defined]
    if t is dict:
        return (dict, *[(k, _key(v)) for k, v in x.items()])  # type: ignore[attr-defined]
    if t in PRIMITIVES:
        return (t, x)
    return _spec(x, 0, True)


def call_key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A hashable key of a call's input signature.

    Tensors contribute dtype, shape, stride, device, ``requires_grad`` and
    layout (a sparse or nested tensor is never keyed like a dense one);
    tensors inside containers and plain objects count the same way (the walk
    ``spec_of`` makes).  Python scalars contribute their value, since tracing
    specialises on them.  Raises ``NotRealError`` for a tracer's stand-ins.
    """
    if kwargs:
        return (tuple([_key(a) for a in args]), tuple([(k, _key(v)) for k, v in kwargs.items()]))
    return tuple([_key(a) for a in args])


# -- walking specs ----------------------------------------------------------------

def children(spec: Spec) -> list[tuple[str, Spec]] | None:
    """``(path suffix, child)`` of a container spec; ``None`` for a leaf."""
    if isinstance(spec, SeqSpec):
        return [(f"[{i}]", s) for i, s in enumerate(spec.items)]
    if isinstance(spec, DictSpec):
        return [(f"[{k!r}]", s) for k, s in zip(spec.keys, spec.values)]
    if isinstance(spec, (DataclassSpec, ObjectSpec)):
        return [(f".{n}", s) for n, s in zip(spec.names, spec.values)]
    if isinstance(spec, PytreeSpec):
        return [(f".<{i}>", s) for i, s in enumerate(spec.children)]
    return None


def map_leaves(spec: Spec, fn: Any) -> Spec:
    """``spec`` with every container rebuilt and ``fn`` applied to each leaf
    (a ``TensorSpec`` or a ``ConstSpec``)."""
    if isinstance(spec, SeqSpec):
        return SeqSpec(spec.kind, tuple(map_leaves(c, fn) for c in spec.items))
    if isinstance(spec, DictSpec):
        return DictSpec(spec.kind, spec.keys, tuple(map_leaves(c, fn) for c in spec.values))
    if isinstance(spec, DataclassSpec):
        return DataclassSpec(spec.cls, spec.names, tuple(map_leaves(c, fn) for c in spec.values))
    if isinstance(spec, ObjectSpec):
        return ObjectSpec(spec.cls, spec.names, tuple(map_leaves(c, fn) for c in spec.values))
    if isinstance(spec, PytreeSpec):
        return PytreeSpec(spec.cls, spec.context,
                          tuple(map_leaves(c, fn) for c in spec.children))
    result: Spec = fn(spec)
    return result


def tensor_leaves(spec: Spec, path: str = "") -> Iterator[tuple[str, TensorSpec]]:
    """``(path, TensorSpec)`` for every tensor in a spec tree, in order."""
    if isinstance(spec, TensorSpec):
        yield path, spec
        return
    for sub, child in children(spec) or ():
        yield from tensor_leaves(child, path + sub)


def flatten_spec(spec: Spec) -> list[Spec]:
    """Tensor and constant leaves in order (what a flattened output returns)."""
    ch = children(spec)
    if ch is None:
        return [spec]
    return [leaf for _, c in ch for leaf in flatten_spec(c)]


def is_native(spec: Spec) -> bool:
    """Whether torch.export takes this argument (or output) as it is."""
    if isinstance(spec, TensorSpec):
        return True
    if isinstance(spec, ConstSpec):
        return type(spec.value) in PRIMITIVES
    if isinstance(spec, (DataclassSpec, ObjectSpec)):
        return False
    return all(is_native(c) for _, c in children(spec) or ())
