"""Specs as JSON and back: metadata only, read strictly.

``spec_to_json`` writes shapes, dtypes, devices and type names -- never
tensor values and never string contents (they may be prompts).
``spec_from_json`` is its inverse where JSON carries a spec fully (tensors,
plain scalars, lists, tuples, dicts); anything else (a dataclass, an object,
a constant whose value was not written) comes back as an ``Opaque`` marker
that says what it was and where, so a loader can tell the user which
argument to build themselves.  What JSON does not rebuild can still be
compared: classes are written by import path and unwritten constants by a
key digest (``portable``), so ``spec_to_json`` of a live call equals a
document exactly when the calls agree, wherever ``unmatched`` finds no part
another process cannot key.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
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
from .portable import class_path, digest
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
)

__all__ = ["Opaque", "call_to_json", "call_unmatched", "holds_objects", "resolve_opaque",
           "spec_from_json", "spec_to_json", "tensor_from_json", "unmatched"]

_MAX_NESTING = 64
#: the layouts a tensor spec records (``signature.layout_of``)
LAYOUTS = ("strided", "nested", "sparse_coo", "sparse_csr", "sparse_csc", "sparse_bsr",
           "sparse_bsc", "_mkldnn")


def _dims(dims: tuple[Any, ...]) -> list[int | str]:
    # a symbolic dimension (a SymInt from a dynamic graph) is named, not evaluated
    return [d if type(d) is int else str(d) for d in dims]


def spec_to_json(spec: Spec) -> Any:
    """Metadata only: shapes, dtypes, devices and type names; never values of
    tensors, and never string contents.  Where a value is not written, a
    digest of its equality key is (``key``; ``None`` where no other process
    could compute it), and classes are written by import path (``class``;
    ``None`` for a class defined inside a function), so a live call in
    another process can be compared with it (``unmatched``)."""
    if isinstance(spec, TensorSpec):
        node: dict[str, Any] = {"shape": _dims(spec.shape), "stride": _dims(spec.stride),
                "dtype": dtype_name(spec.dtype), "device": spec.device,
                "requires_grad": spec.requires_grad}
        if spec.layout != "strided":
            node["layout"] = spec.layout
        return {"tensor": node}
    if isinstance(spec, ConstSpec):
        return _const_to_json(spec)
    if isinstance(spec, SeqSpec):
        node = {"seq": spec.kind.__qualname__, "items": [spec_to_json(s) for s in spec.items]}
        if spec.kind not in (list, tuple):
            node["class"] = class_path(spec.kind)
        return node
    if isinstance(spec, DictSpec):
        return _dict_to_json(spec)
    return {"object": spec.cls.__qualname__, "class": class_path(spec.cls),
            "kind": _OBJECT_KINDS[type(spec)],
            "fields": [[sub, spec_to_json(s)] for sub, s in children(spec) or []]}


#: how an object node was described: attribute by attribute, field by field,
#: or through torch's pytree registry
_OBJECT_KINDS: dict[type, str] = {ObjectSpec: "object", DataclassSpec: "dataclass",
                                  PytreeSpec: "pytree"}


def _const_to_json(spec: ConstSpec) -> dict[str, Any]:
    v = spec.value
    if v is None or type(v) in (bool, int, float):
        # the equality key of these is ``(type, value)``: the value says it all
        return {"const": spec.type_name, "value": v}
    node: dict[str, Any] = {"const": spec.type_name}
    if isinstance(v, (torch.dtype, torch.device)):
        node["value"] = str(v)
    elif isinstance(v, enum.Enum):
        node["value"] = v.name
    node["key"] = digest(spec.key)
    return node


def _dict_to_json(spec: DictSpec) -> dict[str, Any]:
    node: dict[str, Any] = {
        "dict": spec.kind.__qualname__,
        "items": [[str(k) if isinstance(k, (str, int)) else type(k).__qualname__,
                   spec_to_json(s)] for k, s in zip(spec.keys, spec.values)]}
    if spec.kind is not dict:
        node["class"] = class_path(spec.kind)
    if any(type(k) is not str for k in spec.keys):
        # the names written above do not tell 1 from "1", nor two keys of one type apart
        node["keys"] = digest(tuple((type(k), k) for k in spec.keys))
    return node


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


def _optional(node: Mapping[str, Any], name: str, path: str) -> None:
    """A ``class`` or ``key`` field: a string, or ``None`` (not portable)."""
    if node.get(name) is not None:
        read_str(node[name], f"{path}.{name}", max_len=4096)


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
        node = read_mapping(value, path, keys={"const", "value", "key"}, required={"const"})
        type_name = read_str(node["const"], f"{path}.const")
        _optional(node, "key", path)
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
        node = read_mapping(value, path, keys={"seq", "items", "class"},
                            required={"seq", "items"})
        kind = read_str(node["seq"], f"{path}.seq")
        _optional(node, "class", path)
        items = tuple(spec_from_json(s, f"{path}.items[{i}]", depth + 1)
                      for i, s in enumerate(read_list(node["items"], f"{path}.items")))
        if kind in ("list", "tuple"):
            return SeqSpec(list if kind == "list" else tuple, items)  # type: ignore[arg-type]
        return Opaque(f"sequence of type {kind}", path)
    if "dict" in node:
        node = read_mapping(value, path, keys={"dict", "items", "class", "keys"},
                            required={"dict", "items"})
        kind = read_str(node["dict"], f"{path}.dict")
        _optional(node, "class", path)
        _optional(node, "keys", path)
        pairs = _pairs(node["items"], f"{path}.items", "key")
        values = tuple(spec_from_json(v, where, depth + 1) for _, v, where in pairs)
        if kind == "dict":
            return DictSpec(dict, tuple(k for k, _, _ in pairs), values)  # type: ignore[arg-type]
        return Opaque(f"mapping of type {kind}", path)
    if "object" in node:
        node = read_mapping(value, path, keys={"object", "fields", "class", "kind"},
                            required={"object", "fields"})
        kind = read_str(node["object"], f"{path}.object")
        _optional(node, "class", path)
        if "kind" in node:
            read_str(node["kind"], f"{path}.kind", choices=set(_OBJECT_KINDS.values()))
        for _, v, where in _pairs(node["fields"], f"{path}.fields", "field"):
            spec_from_json(v, where, depth + 1)
        return Opaque(f"object of type {kind}", path)
    raise ValueError(f"{path}: expected one of 'tensor', 'const', 'seq', 'dict', 'object'")


def resolve_opaque(node: Any, error: type[Exception] = ValueError, *,
                   advice: str = "build this argument yourself") -> Spec:
    """``node`` as a ``Spec``, or ``error`` naming the first opaque part."""
    if isinstance(node, Opaque):
        raise error(f"{node.where}: a {node.kind} cannot be rebuilt from a document; "
                    f"{advice}")
    if isinstance(node, SeqSpec):
        return SeqSpec(node.kind, tuple(resolve_opaque(s, error, advice=advice)
                                        for s in node.items))
    if isinstance(node, DictSpec):
        return DictSpec(node.kind, node.keys, tuple(resolve_opaque(s, error, advice=advice)
                                                    for s in node.values))
    result: Spec = node
    return result


# -- matching a document with a live call ------------------------------------------------

_LATER = ("its writer recorded no key another process can compute (compared by identity "
          "or by its own ==, or saved by a ctxreplay that did not write one)")


def unmatched(value: Any, path: str = "$", depth: int = 0) -> str | None:
    """Where a signature node (``spec_to_json``'s, validated by
    ``spec_from_json``) cannot be compared with a live call's in another
    process, and why; ``None`` when all of it can: then ``spec_to_json`` of
    a live call's spec equals it exactly when the live call is the captured
    one (tensors by metadata, constants by value or key digest, classes by
    import path)."""
    if depth > _MAX_NESTING or not isinstance(value, Mapping):
        return f"{path}: not a signature node"
    if "tensor" in value:
        return None
    if "const" in value:
        plain = "value" in value and value["const"] in _CONST_TYPES
        if plain or value.get("key") is not None:
            return None
        return f"{path}: a constant of type {value['const']}: {_LATER}"
    for tag, what, below in (("seq", "sequence", "items"), ("dict", "mapping", "items"),
                             ("object", "object", "fields")):
        if tag not in value:
            continue
        builtin = tag != "object" and value[tag] in ("list", "tuple", "dict")
        if not builtin and value.get("class") is None:
            return (f"{path}: an {what} of type {value[tag]} whose class has no import path "
                    "(defined inside a function, or saved by a ctxreplay that did not write "
                    "one)")
        if tag == "dict" and "keys" in value and value["keys"] is None:
            return f"{path}: a mapping whose keys {_LATER}"
        for i, item in enumerate(value[below]):
            if tag == "seq":
                sub, inner = f"{path}[{i}]", item
            elif tag == "dict":
                sub, inner = f"{path}[{item[0]!r}]", item[1]
            else:  # an object's field names start with the "." of their path
                sub, inner = f"{path}{item[0]}", item[1]
            found = unmatched(inner, sub, depth + 1)
            if found is not None:
                return found
        return None
    return f"{path}: not a signature node"


def call_unmatched(doc: Mapping[str, Any]) -> str | None:
    """``unmatched`` for a call's ``{"args": [...], "kwargs": [[name, spec], ...]}``,
    with paths as ``CallSpec.items`` names them (``kwargs['cache'].layers[0]``)."""
    for i, a in enumerate(doc["args"]):
        found = unmatched(a, f"args[{i}]")
        if found is not None:
            return found
    for k, v in doc["kwargs"]:
        found = unmatched(v, f"kwargs[{k!r}]")
        if found is not None:
            return found
    return None


# constants written without their value that are values, not objects a forward can change
_VALUE_TYPES = frozenset({"str", "bytes", "complex", "layout", "memory_format"})


def holds_objects(value: Any) -> bool:
    """Whether a signature node holds a Python object a forward could change
    (an object, dataclass or pytree node; a constant that is neither a plain
    value nor an enum) -- what ``object_args="eager"`` refuses."""
    if not isinstance(value, Mapping) or "tensor" in value:
        return False
    if "object" in value:
        return True
    if "const" in value:
        return "value" not in value and value["const"] not in _VALUE_TYPES
    if "seq" in value:
        return any(holds_objects(v) for v in value["items"])
    if "dict" in value:
        return any(holds_objects(v) for _, v in value["items"])
    return True
