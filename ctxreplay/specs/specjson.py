"""Specs as JSON and back: metadata only, read strictly.

``spec_to_json`` writes shapes, dtypes, devices and type names -- never
tensor values and never string contents (they may be prompts).
``spec_from_json`` is its inverse where JSON carries a spec fully (tensors,
plain scalars, lists, tuples, dicts); anything else (a dataclass, an object,
a constant whose value was not written) comes back as an ``Opaque`` marker
that says what it was and where, so a loader can tell the user which
argument to build themselves.
"""

from __future__ import annotations

import enum
from typing import Any

import attrs
import torch

from .._base.jsonread import (
    dtype_name,
    read_bool,
    read_device,
    read_dtype,
    read_int,
    read_list,
    read_mapping,
    read_pairs,
    read_str,
)
from .signature import (
    CallSpec,
    ConstSpec,
    DictSpec,
    SeqSpec,
    Spec,
    TensorSpec,
    children,
)

__all__ = ["Opaque", "call_to_json", "resolve_opaque", "spec_from_json", "spec_to_json",
           "tensor_from_json"]

_MAX_NESTING = 64
#: the layouts a tensor spec records (``signature.layout_of``)
LAYOUTS = ("strided", "nested", "sparse_coo", "sparse_csr", "sparse_csc", "sparse_bsr",
           "sparse_bsc", "_mkldnn")


def _dims(dims: tuple[Any, ...]) -> list[int | str]:
    # a symbolic dimension (a SymInt from a dynamic graph) is named, not evaluated
    return [d if type(d) is int else str(d) for d in dims]


def spec_to_json(spec: Spec) -> Any:
    """Metadata only: shapes, dtypes, devices and type names; never values of
    tensors, and never string contents."""
    if isinstance(spec, TensorSpec):
        node: dict[str, Any] = {"shape": _dims(spec.shape), "stride": _dims(spec.stride),
                "dtype": dtype_name(spec.dtype), "device": spec.device,
                "requires_grad": spec.requires_grad}
        if spec.layout != "strided":
            node["layout"] = spec.layout
        return {"tensor": node}
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
    return {"object": spec.cls.__qualname__,
            "fields": [[sub, spec_to_json(s)] for sub, s in children(spec) or []]}


def call_to_json(call: CallSpec) -> dict[str, Any]:
    """A call's signature: ``{"args": [...], "kwargs": [[name, spec], ...]}``."""
    return {"args": [spec_to_json(s) for s in call.args],
            "kwargs": [[k, spec_to_json(s)] for k, s in call.kwargs]}


@attrs.frozen
class Opaque:
    """A signature node JSON cannot rebuild (a namedtuple, a dataclass, an
    object, a constant whose value was not recorded)."""

    kind: str
    where: str


def tensor_from_json(value: object, path: str) -> TensorSpec:
    """A ``{"tensor": {...}}`` node, validated field by field."""
    outer = read_mapping(value, path, keys={"tensor"}, required={"tensor"})
    where = f"{path}.tensor"
    t = read_mapping(outer["tensor"], where,
                     keys={"shape", "stride", "dtype", "device", "requires_grad", "layout"},
                     required={"shape", "stride", "dtype", "device", "requires_grad"})
    layout = t.get("layout", "strided")
    if layout not in LAYOUTS:
        raise ValueError(f"{where}.layout: expected one of {', '.join(LAYOUTS)}, got "
                         f"{layout!r}")
    shape = tuple(read_int(d, f"{where}.shape[{i}]", lo=-1 if layout == "nested" else 0,
                           hi=2**40)
                  for i, d in enumerate(read_list(t["shape"], f"{where}.shape", max_len=64)))
    stride = tuple(read_int(d, f"{where}.stride[{i}]", lo=0, hi=2**48)
                   for i, d in enumerate(read_list(t["stride"], f"{where}.stride", max_len=64)))
    if stride and len(stride) != len(shape):
        raise ValueError(f"{where}.stride: {len(stride)} strides for {len(shape)} dimensions")
    return TensorSpec(shape, stride, read_dtype(t["dtype"], f"{where}.dtype"),
                      read_device(t["device"], f"{where}.device"),
                      read_bool(t["requires_grad"], f"{where}.requires_grad"), layout)


_CONST_TYPES: dict[str, tuple[type, ...]] = {
    "NoneType": (type(None),), "bool": (bool,), "int": (int,), "float": (int, float)}


def _pairs(value: object, path: str, what: str) -> list[tuple[str, Any, str]]:
    """``[name, spec]`` pairs: the name read, the spec with its path."""
    return [(k, v, where) for k, (v, where) in read_pairs(
        value, path, f"[{what}, spec]", lambda v, p: read_str(v, p, max_len=4096),
        lambda v, p: (v, p))]


def spec_from_json(value: object, path: str = "$", depth: int = 0) -> Spec | Opaque | Any:
    """A signature node: rebuilt where JSON carries it fully (tensors, plain
    constants, lists, tuples, dicts), validated and ``Opaque`` otherwise.
    Containers of opaque nodes keep them inside (see ``resolve_opaque``)."""
    if depth > _MAX_NESTING:
        raise ValueError(f"{path}: nesting deeper than {_MAX_NESTING} levels")
    node = read_mapping(value, path)
    if "tensor" in node:
        return tensor_from_json(node, path)
    if "const" in node:
        node = read_mapping(value, path, keys={"const", "value"}, required={"const"})
        type_name = read_str(node["const"], f"{path}.const")
        if "value" in node and type_name in _CONST_TYPES:
            v = node["value"]
            if type(v) not in _CONST_TYPES[type_name] or (type_name == "int" and
                                                           isinstance(v, bool)):
                raise ValueError(f"{path}.value: expected a {type_name}, got {type(v).__name__}")
            if type_name == "float":
                v = float(v)
            return ConstSpec(v, type_name, (type(v), v))
        if "value" in node and not isinstance(node["value"], str):
            raise ValueError(f"{path}.value: expected a string, got "
                             f"{type(node['value']).__name__}")
        return Opaque(f"constant of type {type_name}", path)
    if "seq" in node:
        node = read_mapping(value, path, keys={"seq", "items"}, required={"seq", "items"})
        kind = read_str(node["seq"], f"{path}.seq")
        items = tuple(spec_from_json(s, f"{path}.items[{i}]", depth + 1)
                      for i, s in enumerate(read_list(node["items"], f"{path}.items")))
        if kind in ("list", "tuple"):
            return SeqSpec(list if kind == "list" else tuple, items)  # type: ignore[arg-type]
        return Opaque(f"sequence of type {kind}", path)
    if "dict" in node:
        node = read_mapping(value, path, keys={"dict", "items"}, required={"dict", "items"})
        kind = read_str(node["dict"], f"{path}.dict")
        pairs = _pairs(node["items"], f"{path}.items", "key")
        values = tuple(spec_from_json(v, where, depth + 1) for _, v, where in pairs)
        if kind == "dict":
            return DictSpec(dict, tuple(k for k, _, _ in pairs), values)  # type: ignore[arg-type]
        return Opaque(f"mapping of type {kind}", path)
    if "object" in node:
        node = read_mapping(value, path, keys={"object", "fields"},
                            required={"object", "fields"})
        kind = read_str(node["object"], f"{path}.object")
        for _, v, where in _pairs(node["fields"], f"{path}.fields", "field"):
            spec_from_json(v, where, depth + 1)
        return Opaque(f"object of type {kind}", path)
    raise ValueError(f"{path}: expected one of 'tensor', 'const', 'seq', 'dict', 'object'")


def resolve_opaque(node: Any, error: type[Exception] = ValueError) -> Spec:
    """``node`` as a ``Spec``, or ``error`` naming the first opaque part."""
    if isinstance(node, Opaque):
        raise error(f"{node.where}: a {node.kind} cannot be rebuilt from a document; "
                    "build this argument yourself")
    if isinstance(node, SeqSpec):
        return SeqSpec(node.kind, tuple(resolve_opaque(s, error) for s in node.items))
    if isinstance(node, DictSpec):
        return DictSpec(node.kind, node.keys, tuple(resolve_opaque(s, error)
                                                    for s in node.values))
    result: Spec = node
    return result
