"""The distributed mode a call ran in: world size, backend, the default
group's ranks, and the parallel degrees a framework declares."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import attrs
import torch

from .._base.jsonread import read_bool, read_int, read_list, read_mapping, read_pairs, read_str
from ..core.probe import ContextProbe
from ..core.registry import register_probe

__all__ = ["DistributedProbe", "DistributedState"]

_MAX_RANKS = 1 << 16


@attrs.frozen(cache_hash=True)
class DistributedState:
    """Not the rank: every rank of one job observes the same state, so the
    same call on two ranks is one variant."""

    initialized: bool = False
    backend: str | None = None
    world_size: int = 1
    ranks: tuple[int, ...] = ()
    degrees: tuple[tuple[str, int], ...] = ()


_SINGLE = DistributedState()
_MISSING = object()


def _initialized() -> bool:
    dist = torch.distributed
    return bool(dist.is_available() and dist.is_initialized())


def _world_initialized() -> Callable[[], bool] | None:
    """``is_initialized()`` read where it reads (``_world._default_pg``) at a
    fraction of its cost, where this torch keeps the default group there."""
    if not torch.distributed.is_available():
        return None
    from torch.distributed import distributed_c10d as c10d

    if getattr(getattr(c10d, "_world", None), "_default_pg", _MISSING) is _MISSING:
        return None

    def initialized() -> bool:
        return c10d._world._default_pg is not None
    return initialized


_initialized_fast = _world_initialized()


@register_probe
class DistributedProbe(ContextProbe[DistributedState]):
    """``torch.distributed``'s mode, part of every variant key and of the
    manifest, so an artifact says the distributed mode it was made in.

    ``degrees`` returns the parallel degrees a framework uses (e.g.
    ``lambda: {"sequence_parallel": get_sp_world_size()}``); register an
    instance with ``register_probe(DistributedProbe(degrees=...),
    replace=True)`` to record them.  Not replayable -- a process's
    distributed mode cannot be entered for a capture -- so ``replay`` changes
    nothing; captures happen on a rank of the same job.  Neutral in a single
    process.

    Args:
        degrees: returns the framework's parallel degrees by name (``None``:
            none are recorded).
    """

    name = "distributed"
    description = "torch.distributed world size, backend, group ranks and declared degrees"
    default = True
    guarded = True  # nothing per call: the mode changes once, at start-up

    def __init__(self, degrees: Callable[[], Mapping[str, int]] | None = None) -> None:
        self._degrees = degrees

    def observe(self) -> DistributedState:
        if not _initialized():
            return _SINGLE
        dist = torch.distributed
        degrees: tuple[tuple[str, int], ...] = ()
        if self._degrees is not None:
            degrees = tuple(sorted((str(k), int(v)) for k, v in self._degrees().items()))
        world = int(dist.get_world_size())
        return DistributedState(True, str(dist.get_backend()), world,
                                tuple(range(world)), degrees)

    def watch_forward(self, state: DistributedState
                      ) -> tuple[tuple[Callable[[], object], object], ...]:
        checks: list[tuple[Callable[[], object], object]] = [
            (_initialized if _initialized_fast is None else _initialized_fast,
             state.initialized)]
        if self._degrees is not None and state.initialized:
            get = self._degrees
            checks.append((lambda: tuple(sorted((str(k), int(v))
                                                for k, v in get().items())), state.degrees))
        return tuple(checks)

    def replay(self, state: DistributedState) -> AbstractContextManager[None]:
        return nullcontext()

    def neutral_state(self) -> DistributedState:
        return _SINGLE

    def neutral(self, state: DistributedState) -> bool:
        return not state.initialized or state.world_size == 1

    def encode(self, state: DistributedState) -> dict[str, Any]:
        return {"initialized": state.initialized, "backend": state.backend,
                "world_size": state.world_size, "ranks": list(state.ranks),
                "degrees": [list(d) for d in state.degrees]}

    def decode(self, data: Any, path: str) -> DistributedState:
        keys = {"initialized", "backend", "world_size", "ranks", "degrees"}
        doc = read_mapping(data, path, keys=keys, required=keys)
        backend = doc["backend"]
        ranks = tuple(read_int(r, f"{path}.ranks[{i}]", lo=0, hi=_MAX_RANKS)
                      for i, r in enumerate(read_list(doc["ranks"], f"{path}.ranks",
                                                      max_len=_MAX_RANKS)))
        degrees = read_pairs(doc["degrees"], f"{path}.degrees", "[name, degree]", read_str,
                             lambda v, p: read_int(v, p, lo=1, hi=_MAX_RANKS), max_len=64)
        return DistributedState(
            read_bool(doc["initialized"], f"{path}.initialized"),
            None if backend is None else read_str(backend, f"{path}.backend"),
            read_int(doc["world_size"], f"{path}.world_size", lo=1, hi=_MAX_RANKS),
            ranks, tuple(degrees))

    def describe(self, state: DistributedState) -> str:
        if not state.initialized:
            return "single process"
        extra = "".join(f", {k}={v}" for k, v in state.degrees)
        return f"world {state.world_size} ({state.backend}{extra})"
