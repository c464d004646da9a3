"""Running a saved program with a member's own weights: ``bind_weights``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..errors import Error

__all__ = ["Weights", "WeightsError", "bind_weights", "misfit", "problems_error"]


class WeightsError(Error, ValueError):
    """Weights given for a capture do not fit its program (a name missing, or
    another shape, dtype or device)."""


Weights = nn.Module | Mapping[str, torch.Tensor] | None


def _tensor_at(gm: nn.Module, name: str) -> tuple[nn.Module, str, torch.Tensor | None]:
    owner_name, _, leaf = name.rpartition(".")
    owner = gm.get_submodule(owner_name) if owner_name else gm
    t: torch.Tensor | None = owner._parameters.get(leaf)
    if t is None:
        t = owner._buffers.get(leaf)
    return owner, leaf, t


def misfit(key: str, src: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype,
           device: torch.device) -> str | None:
    """Why ``src`` cannot stand for the program's tensor ``key`` of that shape,
    dtype and device (``None``: it can)."""
    if tuple(src.shape) == shape and src.dtype == dtype and src.device == device:
        return None
    return (f"{key}: {str(src.dtype).removeprefix('torch.')}{list(src.shape)} on {src.device}, "
            f"the program has {str(dtype).removeprefix('torch.')}{list(shape)} on {device}")


def problems_error(problems: list[str]) -> WeightsError:
    """One error listing the first few problems."""
    shown = "; ".join(problems[:5]) + ("; ..." if len(problems) > 5 else "")
    return WeightsError(f"weights do not fit the program: {shown}")


def bind_weights(program: Any, weights: Weights, binding: str) -> nn.Module:
    """``program.module()`` running with ``weights``: a member module (its own
    parameters and buffers, shared, not copied) or a state dict.  Only this
    module changes: ``program.module()`` shares the program's parameter
    tensors, so the weights are assigned (``assign=True``), never loaded into
    them, which would write into every module made from the program; buffers
    the graph updates in place
    are the member's own, as they are when it runs eagerly.  A flattened
    capture's program names them with an ``inner.`` prefix."""
    gm: nn.Module = program.module()
    if weights is None:
        return gm
    prefix = "inner." if binding == "flattened" else ""
    if isinstance(weights, nn.Module):
        source: dict[str, torch.Tensor] = dict(weights.named_parameters(remove_duplicate=False))
        source.update(weights.named_buffers(remove_duplicate=False))
    else:
        source = dict(weights)
    sig = program.graph_signature
    optional = set() if isinstance(weights, nn.Module) else set(sig.non_persistent_buffers)
    plan: list[tuple[nn.Module, str, torch.Tensor, bool]] = []
    problems: list[str] = []
    for name in (*sig.parameters, *sig.buffers):
        key = name[len(prefix):] if name.startswith(prefix) else name
        owner, leaf, mine = _tensor_at(gm, name)
        src = source.get(key)
        if src is None:
            if name not in optional:
                problems.append(f"{key}: missing")
            continue
        if mine is None:
            problems.append(f"{key}: not a tensor of the program")
            continue
        problem = misfit(key, src, tuple(mine.shape), mine.dtype, mine.device)
        if problem is not None:
            problems.append(problem)
            continue
        plan.append((owner, leaf, src, leaf in owner._parameters))
    if problems:
        raise problems_error(problems)
    for owner, leaf, src, is_param in plan:
        if is_param:
            owner._parameters[leaf] = src if isinstance(src, nn.Parameter) else \
                nn.Parameter(src, requires_grad=src.requires_grad)
        else:
            owner._buffers[leaf] = src
    return gm


