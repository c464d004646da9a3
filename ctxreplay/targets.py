"""Choosing the submodules to observe, and grouping them by structure."""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["resolve_targets", "structure_key"]


def structure_key(module: nn.Module) -> tuple[Any, ...]:
    """Class plus parameter and buffer names, shapes and dtypes: members with
    equal keys trace to the same graph up to parameter values."""
    params = tuple((n, tuple(p.shape), p.dtype, p.device.type)
                   for n, p in module.named_parameters())
    bufs = tuple((n, tuple(b.shape), b.dtype, b.device.type)
                 for n, b in module.named_buffers())
    return (type(module), params, bufs)


def resolve_targets(root: nn.Module, targets: object) -> list[tuple[str, nn.Module]]:
    """``(qualified name, module)`` pairs to observe, in module order."""
    if targets is None:
        return [("", root)]
    named = dict(root.named_modules())
    if targets == "repeated":
        out = []
        for name, mod in named.items():
            if isinstance(mod, nn.ModuleList) and len(mod) > 0 and \
                    len({type(m) for m in mod}) == 1:
                out += [(f"{name}.{i}" if name else str(i), m) for i, m in enumerate(mod)]
        if not out:
            raise ValueError("targets='repeated': the module has no nn.ModuleList whose "
                             "children share one class")
        return out
    if isinstance(targets, str):
        raise ValueError(f"targets: unknown mode {targets!r}; use None, 'repeated', a list of "
                         "qualified names or a predicate (name, module) -> bool")
    if callable(targets):
        pred: Callable[[str, nn.Module], bool] = targets
        out = [(n, m) for n, m in named.items() if pred(n, m)]
        if not out:
            raise ValueError("targets: the predicate selected no module")
        return out
    try:
        names = list(targets)  # type: ignore[call-overload]
    except TypeError:
        raise TypeError(f"targets: expected None, 'repeated', names or a predicate, "
                        f"got {targets!r}") from None
    out = []
    for n in names:
        if not isinstance(n, str):
            raise TypeError(f"targets: expected qualified names, got {n!r}")
        if n not in named:
            close = difflib.get_close_matches(n, [k for k in named if k], n=5)
            hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
            raise ValueError(f"targets: no submodule named {n!r}{hint}")
        out.append((n, named[n]))
    return out


def is_module(obj: object) -> bool:
    return isinstance(obj, torch.nn.Module)
