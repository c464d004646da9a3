"""Telling cheaply that a call has the signature of an earlier one: ``rematcher``.

``call_key`` walks every argument on every call, objects attribute by
attribute (``signature._parts``), and builds a spec for each; for a decoder
layer's call holding a ``StaticCache`` that is ~100 us, a sixth of the
layer's own forward on a CPU.  A forward called again and again with
arguments of one structure -- the same cache object, the same keyword
names, tensors of the same shapes -- does not need the walk redone to know
its key is the same.

``rematcher(args, kwargs)`` walks a call once with that same ``_parts`` and
generates one function (``exec`` of a source built from the walk; the
classes, names and constants go in its namespace, never in its source) that
re-reads the same places of a later call and says whether its key would be
equal: every container and object of the same exact type, length and
attribute names, every constant the same primitive value, and every tensor
the same metadata, checked at once by torch's C-level ``TensorGuards``
(dispatch keys, dtype, device, shape, stride, ``requires_grad``: a superset of
what the key holds).  It returns the call's tensors in ``call_tensors``
order (what a flattened program takes), or ``None`` -- then the caller
computes the key as before.  A call equal but for its tensors' sizes and
strides (a cache one token longer) returns them wrapped in a 1-tuple
(``Resized``): its key is that of any earlier call with those sizes and
strides, which the caller can look up by them without the walk.  Where
the first call holds something the check cannot state exactly (a constant
that is not a primitive value, a dataclass, a pytree-registered type, a
sparse or nested tensor, a tensor subclass), there is no rematcher and
every call is keyed in full.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import torch

from .._base import codegen
from .._base.torchcaps import TensorGuards
from .signature import PRIMITIVES, _functorch_wrapped, _parts

__all__ = ["Rematcher", "Resized", "rematcher"]

#: the call's tensors (its key is the first call's), a ``Resized`` of them
#: (the key differs in sizes and strides only), or ``None``
Rematcher = Callable[[tuple[Any, ...], dict[str, Any]],
                     "list[torch.Tensor] | tuple[list[torch.Tensor]] | None"]
#: what a rematch returns for a call equal but for sizes: a 1-tuple
Resized = tuple[list[torch.Tensor]]

_MAX_NODES = 512  # a larger call is keyed in full


class _GiveUp(Exception):
    """The call holds something a generated check cannot state exactly."""


class _Source:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self.namespace: dict[str, Any] = {}
        #: every tensor's variable, in walk order; those the guard checks
        self.tensors: list[str] = []
        self.guarded: list[str] = []
        self.found: list[torch.Tensor] = []
        self.count = 0

    def name(self, value: Any, prefix: str) -> str:
        name = f"{prefix}{len(self.namespace)}"
        self.namespace[name] = value
        return name

    def var(self) -> str:
        self.count += 1
        if self.count > _MAX_NODES:
            raise _GiveUp
        return f"v{self.count}"

    def fail_if(self, condition: str) -> None:
        self.lines.append(f"    if {condition}: return None")

    def value(self, value: object, expr: str, depth: int = 0) -> None:
        """Check ``expr`` (read from a later call) against ``value``, recursively."""
        if depth > 32:
            raise _GiveUp
        v = self.var()
        self.lines.append(f"    {v} = {expr}")
        kind, inner = _parts(value)
        if kind == "tensor":
            self._tensor(inner, v)
        elif kind == "const":
            self._const(value, v)
        elif kind == "seq":
            self.fail_if(f"type({v}) is not {self.name(type(value), 'T')} "
                         f"or len({v}) != {len(inner)}")
            for i, item in enumerate(inner):
                self.value(item, f"{v}[{i}]", depth + 1)
        elif kind in ("dict", "object"):
            if kind == "object":
                self.fail_if(f"type({v}) is not {self.name(type(value), 'T')}")
                d = self.var()
                self.lines.append(f"    {d} = {v}.__dict__")
                self.fail_if(f"type({d}) is not dict")
            else:
                d = v
                self.fail_if(f"type({d}) is not {self.name(type(value), 'T')}")
            keys = tuple(inner)
            if not all(type(k) in PRIMITIVES for k in keys):
                raise _GiveUp
            self.fail_if(f"len({d}) != {len(keys)} or tuple({d}) != {self.name(keys, 'K')}")
            for k, item in inner.items():
                self.value(item, f"{d}[{self.name(k, 'K')}]", depth + 1)
        else:  # a dataclass, a pytree-registered type, a tracer's proxy
            raise _GiveUp

    def _tensor(self, t: torch.Tensor, v: str) -> None:
        if type(t) is not torch.Tensor or t.layout != torch.strided or t.is_nested or (
                _functorch_wrapped is not None and _functorch_wrapped(t)):
            raise _GiveUp
        self.tensors.append(v)
        # torch's guard fails on one tensor passed twice: a repeat is checked
        # to be the same object again (a later call passing two tensors there
        # is keyed in full)
        for seen, var in zip(self.found, self.guarded):
            if seen is t:
                self.fail_if(f"{v} is not {var}")
                return
        self.guarded.append(v)
        self.found.append(t)

    def _const(self, value: object, v: str) -> None:
        t = type(value)
        if isinstance(value, enum.Enum):
            self.fail_if(f"{v} is not {self.name(value, 'C')}")
        elif t in PRIMITIVES and (t is not float or value == value):
            self.fail_if(f"type({v}) is not {self.name(t, 'T')} or "
                         f"{v} != {self.name(value, 'C')}")
        else:  # a constant keyed by its content (a config, a callable): keyed in full
            raise _GiveUp


def rematcher(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Rematcher | None:
    """A check that a later call's ``call_key`` equals this one's (see the
    module), or ``None`` where the call holds something it cannot check."""
    if TensorGuards is None:
        return None
    src = _Source()
    try:
        src.fail_if(f"len(args) != {len(args)} or len(kwargs) != {len(kwargs)}")
        if kwargs:
            src.fail_if(f"tuple(kwargs) != {src.name(tuple(kwargs), 'K')}")
        for i, a in enumerate(args):
            src.value(a, f"args[{i}]")
        for k, val in kwargs.items():
            src.value(val, f"kwargs[{src.name(k, 'K')}]")
    except _GiveUp:
        return None
    found = src.found
    try:
        guard = TensorGuards(*found, dynamic_dims_sizes=[list(t.shape) for t in found],
                             dynamic_dims_strides=[list(t.stride()) for t in found])
        # every size and stride left free: the rest of each tensor's metadata
        # (dispatch keys, dtype, device, requires_grad, dimension count)
        free = [[None] * t.dim() for t in found]
        resized = TensorGuards(*found, dynamic_dims_sizes=free, dynamic_dims_strides=free)
    except Exception:  # this torch's TensorGuards takes other arguments
        return None
    src.namespace["G"], src.namespace["R"] = guard, resized
    body = "\n".join(src.lines)
    tensors = "[" + ", ".join(src.tensors) + "]"
    guarded = "".join(v + ", " for v in src.guarded)
    source = (f"def rematch(args, kwargs):\n{body}\n"
              f"    if G.check({guarded}): return {tensors}\n"
              f"    return ({tensors},) if R.check({guarded}) else None\n")
    try:
        fn: Rematcher = codegen.function(source, "rematch", src.namespace, what="rematch")
    except (SyntaxError, RecursionError):  # a call too deep for one function
        return None
    return fn
