"""Guarding, per call, the state a program baked in (``specs.baked``).

``BakedGuard(baked, member)`` holds one member to what its program read
when traced.  ``holds()`` is its per-call question.  The first time, and
after any failure, it looks every place up again and compares digests of
what each holds with those of the trace; when all agree it writes one
function that answers the next calls cheaply, as Dynamo guards its
sources: for a tensor its identity and version counter (a new tensor
assigned, or the same one written in place: ``copy_``, ``load_state_dict``),
for a small Python value an equality with a copy taken then (a dict entry
flipped in place, a global or class attribute reassigned).  A call it
refuses runs eagerly; ``failed`` names the place that differed.  A state
that differs but was seen differing on the last look costs no new digest.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from .._base import codegen
from ..specs.baked import Baked, Source, digest, frozen, lookup

__all__ = ["BakedGuard"]


def _never() -> bool:
    return False


class BakedGuard:
    """``holds()``: whether the places ``baked`` lists hold, for ``member``, what
    the program baked in; ``failed``: the last place that did not."""

    __slots__ = ("_bad", "_check", "failed", "member", "sources")

    def __init__(self, baked: Baked, member: nn.Module) -> None:
        self.sources, self.member = baked.sources, member
        self._check: Any = _never
        self._bad: Any = None
        self.failed: Source | None = None

    def holds(self) -> bool:
        return bool(self._check()) or self._look()

    def _look(self) -> bool:
        """Every place looked up and digested again; the fast check made anew
        where all agree."""
        values: list[Any] = []
        for s in self.sources:
            try:
                values.append(lookup(s, self.member))
            except Exception:  # a place gone (an attribute deleted): it differs
                self.failed = s
                return False
        state = _state(values)
        if self._bad is not None and _same(state, self._bad):
            return False
        for s, v in zip(self.sources, values):
            if _kind(v) != s.kind or digest(v) != s.digest:
                self._bad, self.failed = state, s
                self._check = _never
                return False
        self._bad = self.failed = None
        self._check = _checker(self.sources, values, self.member)
        return True


def _kind(value: Any) -> str:
    return "tensor" if isinstance(value, torch.Tensor) else "value"


def _version(t: torch.Tensor) -> int:
    """``t``'s version counter (-1: an inference tensor, which has none)."""
    return -1 if t.is_inference() else t._version


def _state(values: list[Any]) -> tuple[Any, ...]:
    return tuple((id(v), _version(v)) if isinstance(v, torch.Tensor) else frozen(v)
                 for v in values)


def _same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
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


def _checker(sources: tuple[Source, ...], values: list[Any], member: nn.Module) -> Any:
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
        if not isinstance(v, torch.Tensor):
            terms.append(f"{expr} == V{i}")
        elif _version(v) < 0:
            terms.append(f"{expr} is V{i}")
        else:
            namespace[f"N{i}"] = _version(v)
            terms.append(f"({expr} is V{i} and V{i}._version == N{i})")
    body = " and ".join(terms) or "True"
    source = ("def check():\n    try:\n"
              f"        return {body}\n"
              "    except Exception:\n        return False\n")
    return codegen.function(source, "check", namespace, what="baked-state guard")
