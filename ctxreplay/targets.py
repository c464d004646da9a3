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


def _is_stack(mod: nn.Module) -> bool:
    """A stack of repeated blocks: an ``nn.ModuleList`` whose children share
    one class, or an ``nn.Sequential`` of two or more blocks of one class
    (torchvision's ResNet stages, ViT's encoder layers)."""
    if isinstance(mod, nn.ModuleList):
        return len(mod) > 0 and len({type(m) for m in mod}) == 1
    if type(mod) is nn.Sequential and len(mod) >= 2:
        kinds = {type(m) for m in mod}
        # a Sequential of plain layers (Linear, ReLU) is a block, not a stack
        return len(kinds) == 1 and next(iter(kinds)).__module__.split(".")[:3] != [
            "torch", "nn", "modules"]
    return False


def _inside(name: str, taken: set[str]) -> bool:
    parts = name.split(".")
    return any(".".join(parts[:i]) in taken for i in range(1, len(parts) + 1))


def _repeated(named: dict[str, nn.Module]) -> list[tuple[str, nn.Module]]:
    out: list[tuple[str, nn.Module]] = []
    taken: set[str] = set()  # members already observed
    for name, mod in named.items():
        # Every homogeneous ModuleList counts, nested ones too (an MoE layer's
        # experts); a Sequential stack only outside an observed member.  The
        # ancestors of a name are its dotted prefixes: O(depth), not O(members).
        if not isinstance(mod, nn.ModuleList) and _inside(name, taken):
            continue
        if _is_stack(mod):
            members = [(f"{name}.{child}" if name else child, m)
                       for child, m in mod.named_children()]
            out += members
            taken.update(n for n, _ in members)
    if not out:
        raise ValueError("targets='repeated': the module has no stack of repeated blocks "
                         "(an nn.ModuleList, or an nn.Sequential of two or more, whose "
                         "children share one class)")
    return out


def resolve_targets(root: nn.Module, targets: object) -> list[tuple[str, nn.Module]]:
    """``(qualified name, module)`` pairs to observe, in module order."""
    if targets is None:
        return [("", root)]
    named = dict(root.named_modules())
    if targets == "repeated":
        return _repeated(named)
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
