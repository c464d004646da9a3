"""Weights FSDP2 (``fully_shard``) gathers around a module's forward.

Between calls a ``fully_shard``-ed module holds each parameter as a
``DTensor`` shard of it; FSDP's forward pre-hook all-gathers the whole
parameters (in ``MixedPrecisionPolicy.param_dtype`` when one is set) and
registers them on the modules of its group, the forward runs with them,
and its post-hook frees them and registers the shards again.  The module
refuses ``deepcopy`` ("FSDP does not support deepcopy"), and a view over
its shards would trace another computation than the live call's.

``fsdp_owners(module)`` names the FSDP modules whose parameter groups
hold parameters of ``module``'s tree (those inside it, and an ancestor
whose group holds the parameters of a submodule targeted alone);
``gathered(owners)`` has their whole parameters registered inside, the way
FSDP's own pre-hook does it (``FSDPModule.unshard()``, the policy's dtype
included), and the shards back after (``reshard()``); an owner found
already unsharded (a root FSDP keeps its parameters after a forward) is
left as it is.  ``unshard()`` is a collective over the owner's mesh: every
rank must gather the same owners in the same order.  Inside a distributed
``finalize()`` the engine sets how (``gathering_by``: the ranks take turns,
each following what the capturing rank gathers); elsewhere the calling
rank gathers alone, right only where every rank of the mesh does the same
at that moment (or the mesh has one rank).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from torch import nn

__all__ = ["FSDP_MARKS", "Gather", "fsdp_class", "fsdp_owners", "fsdp_states", "gathered",
           "gathered_forms", "gathered_here", "gathering_by", "holds_fsdp", "is_fsdp",
           "is_fsdp_key", "original_class"]

#: attributes ``fully_shard`` sets on the modules it manages: its state's
#: keys (``torch.distributed._composable``'s registry) and Dynamo's markers
FSDP_MARKS = ("_is_fsdp_managed_module", "_fsdp_use_orig_params")
_STATE_KEY = "__composable_api_state_key_"

#: how owners are gathered: ``Gather(owners)`` is a context inside which
#: their whole parameters are registered
Gather = Callable[[list[nn.Module]], AbstractContextManager[None]]
_gathers: list[Gather] = []


#: where ``FSDPModule`` is defined (torch 2.6 moved it from ``_composable``)
_HOMES = ("torch.distributed.fsdp._fully_shard._fully_shard",
          "torch.distributed._composable.fsdp.fully_shard")


def fsdp_class() -> type | None:
    """``FSDPModule``, where FSDP2 is imported (no module is one otherwise)."""
    for home in _HOMES:
        cls = getattr(sys.modules.get(home), "FSDPModule", None)
        if isinstance(cls, type):
            return cls
    return None


def is_fsdp(module: nn.Module) -> bool:
    cls = fsdp_class()
    return cls is not None and isinstance(module, cls)


def is_fsdp_key(name: str) -> bool:
    """An attribute ``fully_shard`` put on a module (state or marker)."""
    return name.startswith(_STATE_KEY) or name in FSDP_MARKS


def original_class(module: nn.Module) -> type[nn.Module]:
    """The class ``fully_shard`` derived the module's ``FSDP<cls>`` from
    (its MRO is ``[FSDP<cls>, FSDPModule, cls, ...]``; the index is the
    class's own ``_orig_cls_mro_index``)."""
    cls = type(module)
    if not is_fsdp(module):
        return cls
    found: type[nn.Module] = cls.__mro__[int(getattr(cls, "_orig_cls_mro_index", 2))]
    return found


def fsdp_states(module: nn.Module) -> list[Any]:
    """The FSDP states of the FSDP modules in ``module``'s tree."""
    out: list[Any] = []
    for m in module.modules():
        if is_fsdp(m):
            state = m._get_fsdp_state()  # type: ignore[operator]
            if all(state is not s for s in out):
                out.append(state)
    return out


def holds_fsdp(modules: Iterable[nn.Module]) -> bool:
    """Whether any of ``modules`` has FSDP parameters in its tree (``True``
    where FSDP's state cannot be read: each capture then fails to find them,
    saying why, without anyone gathering)."""
    if fsdp_class() is None:
        return False
    try:
        return any(fsdp_owners(m) for m in modules)
    except Exception:  # FSDP's internals of another torch: capture says why
        return True


def fsdp_owners(module: nn.Module) -> list[nn.Module]:
    """The FSDP modules whose parameter groups hold parameters of
    ``module``'s tree, in a fixed order: ancestors first (outermost first),
    then those inside the tree in module order."""
    if fsdp_class() is None:
        return []
    inside = [m for m in module.modules() if is_fsdp(m)]
    tree = {id(m) for m in module.modules() if m._parameters}
    covered = {id(m) for owner in inside for m in _managed(owner)}
    above = [] if tree <= covered else _ancestors(tree - covered)
    return [*above, *inside]


def _groups(owner: nn.Module) -> list[Any]:
    """The FSDP parameter groups of ``owner`` (a torch that keeps one reads it
    as ``_fsdp_param_group``, ``None`` for none)."""
    state = owner._get_fsdp_state()  # type: ignore[operator]
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    one = state._fsdp_param_group
    return [] if one is None else [one]


def _managed(owner: nn.Module) -> list[nn.Module]:
    """The modules whose parameters ``owner``'s groups hold."""
    return [fp._module_info.module for group in _groups(owner) for fp in group.fsdp_params]


def _ancestors(modules: set[int]) -> list[nn.Module]:
    """The FSDP modules outside a tree whose groups hold parameters of its
    ``modules`` (ids): FSDP keeps no link from a parameter to its owner, so
    the process's FSDP states are looked through."""
    try:
        from torch.distributed._composable_state import _module_state_mapping
    except ImportError:
        return []
    out: list[nn.Module] = []
    for owner in list(_module_state_mapping):
        if is_fsdp(owner) and any(id(m) in modules for m in _managed(owner)) \
                and all(owner is not o for o in out):
            out.append(owner)
    # the outermost first: a module's ancestors have more modules in their tree
    return sorted(out, key=lambda m: -sum(1 for _ in m.modules()))


def gathered_forms(module: nn.Module) -> dict[int, tuple[tuple[int, ...], torch.dtype]]:
    """For each FSDP parameter of ``module``'s tree held as its shard now
    (by ``id``), the shape and dtype FSDP gathers it in for a call: the
    whole shape, in ``MixedPrecisionPolicy.param_dtype`` where one is set."""
    out: dict[int, tuple[tuple[int, ...], torch.dtype]] = {}
    for owner in fsdp_owners(module):
        for group in _groups(owner):
            for fp in group.fsdp_params:
                shard = fp.sharded_param
                out[id(shard)] = (tuple(fp._orig_size), fp.param_dtype or shard.dtype)
    return out


def _unsharded(owner: nn.Module) -> bool:
    groups = _groups(owner)
    return bool(groups) and all(g.is_unsharded for g in groups)


@contextmanager
def gathered_here(owners: list[nn.Module]) -> Iterator[None]:
    """Each owner's parameters whole inside (``unshard()``), its shards
    back after (``reshard()``), on this rank alone."""
    done: list[nn.Module] = []
    try:
        for owner in owners:
            if not _unsharded(owner):
                owner.unshard()  # type: ignore[operator]
                done.append(owner)
        yield
    finally:
        for owner in reversed(done):
            owner.reshard()  # type: ignore[operator]


def gathered(owners: list[nn.Module]) -> AbstractContextManager[None]:
    """``owners`` gathered the way the running finalize says (``gathering_by``),
    or by this rank alone."""
    if _gathers:
        return _gathers[-1](owners)
    return gathered_here(owners)


@contextmanager
def gathering_by(gather: Gather) -> Iterator[None]:
    """Inside, ``gathered`` goes through ``gather`` (the ranks in lockstep)."""
    _gathers.append(gather)
    try:
        yield
    finally:
        _gathers.remove(gather)
