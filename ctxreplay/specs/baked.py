"""What a traced program took from outside its arguments and weights: the
state it baked in, as places to look again where it runs.

A trace runs the forward's Python once.  Every value it read that is not a
parameter, buffer or argument ends in the graph as it was then: a Python
value as a constant, a plain tensor (an attribute, one held in a list, a
module outside the block) as a lifted constant.  A pipeline that later
changes such a value -- another prompt's embedding assigned to the block, a
dict entry flipped, a module global, a class attribute, an adapter's weights
loaded anew -- would be served the old one by the program.

A ``Baked`` lists those places (``Source``): where the value is found from
the member (a submodule, then attribute and item steps) or from a module's
globals, whether it is a tensor or a Python value, and a digest of what
it held at the trace (never the value itself: documents hold metadata
only).  Whoever runs the program looks each place up again and compares
digests before trusting it (``dispatch.baked``).
"""

from __future__ import annotations

import enum
import hashlib
import sys
from collections.abc import Iterable
from typing import Any

import attrs
import torch
from torch import nn

from .._base import codegen
from .._base.jsonread import read_list, read_mapping, read_str

__all__ = ["SCALARS", "Baked", "Source", "digest", "frozen", "lookup", "place_check", "plain",
           "same_state", "state_of", "version"]

#: what a source holds: a tensor (its identity and version are guarded, its
#: values digested) or a small Python value (compared by value)
_KINDS = ("tensor", "value")

#: a value larger than this many items is not a small Python value
_MAX_ITEMS = 64
_MAX_SOURCES = 4096
_MISSING = object()

Step = tuple[str, "str | int"]


def _steps(value: Iterable[Step]) -> tuple[Step, ...]:
    return tuple((str(a), b) for a, b in value)


@attrs.frozen
class Source:
    """One place a program read from: from the member's submodule ``base``
    (``global_`` false; ``""``: the member) or from the module named
    ``base``'s globals, then ``steps`` (``("attr", name)``, ``("item",
    key)``); what it held (``kind``) and its digest at the trace."""

    base: str
    steps: tuple[Step, ...] = attrs.field(converter=_steps)
    kind: str = attrs.field(validator=attrs.validators.in_(_KINDS))
    digest: str
    global_: bool = False

    def where(self) -> str:
        """The place in words a person reads: ``cfg['mode']``,
        ``blocks.0.temb``, ``global knobs.MODE``."""
        out = self.base
        for step, key in self.steps:
            out += f"[{key!r}]" if step == "item" else f".{key}" if out else str(key)
        return f"global {out}" if self.global_ else out

    def to_json(self) -> dict[str, Any]:
        return {"base": self.base, "steps": [list(s) for s in self.steps], "kind": self.kind,
                "digest": self.digest, "global": self.global_}

    @classmethod
    def from_json(cls, value: object, path: str) -> Source:
        doc = read_mapping(value, path, required={"base", "steps", "kind", "digest"})
        steps = []
        for i, s in enumerate(read_list(doc["steps"], f"{path}.steps", max_len=64)):
            p = f"{path}.steps[{i}]"
            if not (isinstance(s, list) and len(s) == 2 and s[0] in ("attr", "item")
                    and isinstance(s[1], (str, int)) and not isinstance(s[1], bool)):
                raise ValueError(f"{p}: expected ['attr' | 'item', name or index], got {s!r}")
            steps.append((s[0], s[1]))
        glob = doc.get("global", False)
        if not isinstance(glob, bool):
            raise ValueError(f"{path}.global: expected true or false, got {glob!r}")
        return cls(read_str(doc["base"], f"{path}.base", max_len=4096), tuple(steps),
                   read_str(doc["kind"], f"{path}.kind", choices=set(_KINDS)),
                   read_str(doc["digest"], f"{path}.digest", max_len=128), glob)


@attrs.frozen
class Baked:
    """The places a program read state from (``sources``); ``complete``:
    every read of the trace is among them (a trace whose reads could not all
    be noted guards what it could)."""

    sources: tuple[Source, ...]
    complete: bool = True

    def to_json(self) -> dict[str, Any]:
        return {"sources": [s.to_json() for s in self.sources], "complete": self.complete}

    @classmethod
    def from_json(cls, value: object, path: str) -> Baked:
        doc = read_mapping(value, path, required={"sources"})
        complete = doc.get("complete", True)
        if not isinstance(complete, bool):
            raise ValueError(f"{path}.complete: expected true or false, got {complete!r}")
        items = read_list(doc["sources"], f"{path}.sources", max_len=_MAX_SOURCES)
        return cls(tuple(Source.from_json(s, f"{path}.sources[{i}]")
                         for i, s in enumerate(items)), complete)


def lookup(source: Source, member: nn.Module) -> Any:
    """The value at ``source`` now, from ``member`` (raises ``LookupError``,
    ``KeyError`` or ``AttributeError`` where the place no longer exists)."""
    if source.global_:
        obj: Any = sys.modules.get(source.base, _MISSING)
        if obj is _MISSING:
            raise LookupError(source.base)
    else:
        obj = member.get_submodule(source.base) if source.base else member
    for step, key in source.steps:
        obj = _step("", obj, step, key, "")[1]
    return obj


#: the scalar types a plain value is made of (enums beside them)
SCALARS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device,
           torch.layout, torch.memory_format)


def plain(value: Any, budget: list[int] | None = None) -> bool:
    """Whether ``value`` is a small Python value: scalars, strings, enums,
    dtypes and devices, and tuples, lists, sets and dicts of them (at most
    ``_MAX_ITEMS`` items in all)."""
    budget = [_MAX_ITEMS] if budget is None else budget
    budget[0] -= 1
    if budget[0] < 0:
        return False
    if isinstance(value, (*SCALARS, enum.Enum)):
        return True
    if type(value) in (tuple, list, set, frozenset, torch.Size):
        return all(plain(v, budget) for v in value)
    if type(value) is dict:
        return all(plain(k, budget) and plain(v, budget) for k, v in value.items())
    return False


def frozen(value: Any) -> Any:
    """A copy of a small Python value that later changes to it leave alone."""
    if type(value) is dict:
        return {k: frozen(v) for k, v in value.items()}
    if type(value) in (list, set, tuple):
        return type(value)(frozen(v) for v in value)
    return value


def digest(value: Any) -> str:
    """A digest of a tensor's dtype, shape and values, or of a small Python
    value (equal values, equal digests; a dict's order does not count)."""
    h = hashlib.sha256()
    if isinstance(value, torch.Tensor):
        t = value.detach()
        h.update(f"tensor {t.dtype} {tuple(t.shape)} {t.device.type}".encode())
        if t.device.type != "meta" and t.numel():
            flat = t.reshape(-1).cpu().contiguous()
            h.update(flat.view(torch.uint8).numpy().tobytes())
        return h.hexdigest()[:32]
    h.update(_canonical(value).encode())
    return h.hexdigest()[:32]


def _canonical(value: Any) -> str:
    if type(value) is dict:
        items = sorted((_canonical(k), _canonical(v)) for k, v in value.items())
        return "{" + ",".join(f"{k}:{v}" for k, v in items) + "}"
    if type(value) in (set, frozenset):
        return f"{type(value).__name__}(" + ",".join(sorted(_canonical(v) for v in value)) + ")"
    if type(value) in (list, tuple, torch.Size):
        return f"{type(value).__name__}(" + ",".join(_canonical(v) for v in value) + ")"
    return f"{type(value).__qualname__}:{value!r}"


def version(t: torch.Tensor) -> int:
    """``t``'s version counter (-1: an inference tensor, which has none)."""
    return -1 if t.is_inference() else t._version


def state_of(values: list[Any]) -> tuple[Any, ...]:
    """What ``place_check`` compares of each value, comparable later."""
    return tuple((id(v), version(v)) if isinstance(v, torch.Tensor) else frozen(v)
                 for v in values)


def same_state(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    """Whether two ``state_of`` results are equal (one that cannot say: no)."""
    try:
        return bool(a == b)
    except Exception:  # a value whose == does not answer: not known to be the same
        return False


def _step(expr: str, obj: Any, step: str, key: Any, name: str) -> tuple[str, Any]:
    """``expr`` (which evaluates to ``obj``) followed one step, and what it
    finds: a module's parameters, buffers and submodules are read from
    their dicts (``nn.Module.__getattr__`` costs ~1.5 us a read; a tensor
    assigned in their place lands in the same dict)."""
    if step == "item":
        return f"{expr}[{name}]", obj[key]
    if isinstance(obj, nn.Module):
        for table in ("_parameters", "_buffers", "_modules"):
            if key in obj.__dict__[table]:
                return f"{expr}.{table}[{name}]", obj.__dict__[table][key]
    if str(key).isidentifier():
        return f"{expr}.{key}", getattr(obj, key)
    return f"getattr({expr}, {name})", getattr(obj, key)


def place_check(sources: tuple[Source, ...], values: list[Any], member: nn.Module) -> Any:
    """One generated function: whether each place holds what it held when
    ``values`` were read (identity and version, or an equal value)."""
    namespace: dict[str, Any] = {}
    terms = []
    for i, (s, v) in enumerate(zip(sources, values)):
        obj = namespace[f"B{i}"] = sys.modules[s.base] if s.global_ else \
            (member.get_submodule(s.base) if s.base else member)
        expr = f"B{i}"
        for j, (step, key) in enumerate(s.steps):
            namespace[f"K{i}_{j}"] = key
            expr, obj = _step(expr, obj, step, key, f"K{i}_{j}")
        namespace[f"V{i}"] = v if isinstance(v, torch.Tensor) else frozen(v)
        if v is None:
            terms.append(f"{expr} is None")
        elif not isinstance(v, torch.Tensor):
            terms.append(f"{expr} == V{i}")
        elif version(v) < 0:
            terms.append(f"{expr} is V{i}")
        else:
            namespace[f"N{i}"] = version(v)
            terms.append(f"({expr} is V{i} and V{i}._version == N{i})")
    body = " and ".join(terms) or "True"
    source = ("def check():\n    try:\n"
              f"        return {body}\n"
              "    except Exception:\n        return False\n")  # a value's == may raise anything
    return codegen.function(source, "check", namespace, what="baked-state guard")
