"""Where a tensor's data lives, for any tensor a model may hold.

A parameter is not always an ordinary tensor: a quantized weight
(torchao's ``Int8Tensor``, a hand-written int8 wrapper), a ``DTensor``
shard under FSDP or tensor parallelism, a functional or fake tensor inside
a trace.  A wrapper subclass has no storage of its own: its
``untyped_storage().data_ptr()`` raises "Attempted to access the data
pointer on an invalid python storage".  Its data lives in the ordinary
tensors ``__tensor_flatten__`` names (recursively, a wrapper may hold
wrappers).  Bookkeeping that identifies weights by storage (which
parameters a run wrote into, which tensors two modules share) asks this
module, never the tensor itself.
"""

from __future__ import annotations

import re

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

__all__ = ["inner_tensor", "inner_tensors", "is_wrapper", "member_tensors", "same_data",
           "storage_ptr", "storage_ptrs", "unwrapped_name"]

#: how a re-traced program names the inner tensors of a wrapper-subclass
#: parameter or buffer (torch's ``unwrap_tensor_subclass_parameters``
#: parametrizes ``up.weight`` into ``up.parametrizations.weight.original0``,
#: ``original1``, ... in ``__tensor_flatten__`` order, depth first)
_UNWRAPPED = re.compile(r"^(?:(?P<owner>.*)\.)?parametrizations\.(?P<leaf>[^.]+)"
                        r"\.original(?P<index>\d+)$")


def is_wrapper(t: torch.Tensor) -> bool:
    """``t`` is a wrapper subclass whose data lives in inner tensors."""
    return is_traceable_wrapper_subclass(t)


def inner_tensors(t: torch.Tensor, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    """``(path, tensor)`` of each ordinary tensor holding ``t``'s data:
    ``[("", t)]`` for an ordinary tensor; for a wrapper subclass, each
    attribute ``__tensor_flatten__`` names, as ``prefix + "." + name``,
    flattened again where it is a wrapper itself."""
    if not is_traceable_wrapper_subclass(t):
        return [(prefix, t)]
    names, _ctx = t.__tensor_flatten__()
    out: list[tuple[str, torch.Tensor]] = []
    for name in names:
        inner = getattr(t, name)
        if isinstance(inner, torch.Tensor):
            out += inner_tensors(inner, f"{prefix}.{name}" if prefix else name)
    return out


def storage_ptr(t: torch.Tensor) -> int | None:
    """The address of an ordinary tensor's storage; ``None`` where it has
    none that can be read (a wrapper, a functional or meta tensor, a
    storage that is not allocated)."""
    if is_traceable_wrapper_subclass(t) or t.device.type == "meta" or is_fake(t):
        return None  # a fake tensor's address is a deprecated read that warns
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    return ptr or None


def storage_ptrs(t: torch.Tensor) -> tuple[int, ...]:
    """The storage addresses of every ordinary tensor holding ``t``'s data
    (``inner_tensors``), those that have one."""
    found: list[int] = []
    for _path, inner in inner_tensors(t):
        ptr = storage_ptr(inner)
        if ptr is not None:
            found.append(ptr)
    return tuple(found)


def same_data(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether ``x`` and ``y`` hold equal data: the same dtype and shape, and
    equal values -- for a wrapper subclass, the same class and flatten
    context and equal inner tensors (``torch.equal`` on the wrapper itself
    is an operator the subclass may not implement: torchao's ``Int8Tensor``
    raises ``NotImplementedError``)."""
    if x.dtype != y.dtype or x.shape != y.shape:
        return False
    if not (is_traceable_wrapper_subclass(x) or is_traceable_wrapper_subclass(y)):
        return torch.equal(x.detach().cpu(), y.detach().cpu())
    if type(x) is not type(y):
        return False
    names_x, ctx_x = x.__tensor_flatten__()
    names_y, ctx_y = y.__tensor_flatten__()
    try:
        same_ctx = bool(names_x == names_y and ctx_x == ctx_y)
    except Exception:  # a context whose parts do not compare
        return False
    return same_ctx and all(same_data(getattr(x, n), getattr(y, n)) for n in names_x)


def unwrapped_name(name: str) -> tuple[str, int] | None:
    """``("up.weight", 0)`` for ``"up.parametrizations.weight.original0"``:
    the wrapper tensor a re-traced program's tensor of that name is the
    ``index``-th inner tensor of; ``None`` for any other name."""
    m = _UNWRAPPED.match(name)
    if m is None:
        return None
    owner = m.group("owner")
    return (f"{owner}.{m.group('leaf')}" if owner else m.group("leaf")), int(m.group("index"))


def inner_tensor(t: torch.Tensor, index: int) -> torch.Tensor:
    """The ``index``-th ordinary tensor holding wrapper ``t``'s data (``t``
    itself for an ordinary tensor at 0); ``IndexError`` past the last."""
    return inner_tensors(t)[index][1]


def member_tensors(module: nn.Module, prefix: str = "") -> dict[str, torch.Tensor]:
    """``module``'s parameters and buffers by qualified name (the same
    tensors), under ``prefix``; for each that is a wrapper subclass (a
    DTensor shard, a quantized weight), its inner tensors too, by the names
    a re-traced program gives them (``unwrapped_name``)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in (*module.named_parameters(remove_duplicate=False),
                    *module.named_buffers(remove_duplicate=False)):
        out[prefix + name] = t
        if is_traceable_wrapper_subclass(t):
            owner, _, leaf = name.rpartition(".")
            base = f"{owner}.parametrizations.{leaf}" if owner else f"parametrizations.{leaf}"
            for i, (_path, inner) in enumerate(inner_tensors(t)):
                out[f"{prefix}{base}.original{i}"] = inner
    return out
