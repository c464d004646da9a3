"""Determinism flags: deterministic algorithms (and warn-only), cuDNN, fill of
uninitialized memory."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import attrs
import torch
import torch.utils.deterministic as _det

from .._base.jsonread import read_bool, read_mapping
from ..core.probe import ContextProbe
from ..core.registry import register_probe

__all__ = ["DeterminismProbe", "DeterminismState"]

_algos = torch._C._get_deterministic_algorithms
_warn_only = torch._C._get_deterministic_algorithms_warn_only
_cudnn_det = torch._C._get_cudnn_deterministic
_cudnn_bench = torch._C._get_cudnn_benchmark
_fill = torch._C._get_deterministic_fill_uninitialized_memory


@attrs.frozen(cache_hash=True)
class DeterminismState:
    """``torch.use_deterministic_algorithms`` (and its ``warn_only``), cuDNN's
    ``deterministic`` and ``benchmark`` flags, and
    ``torch.utils.deterministic.fill_uninitialized_memory``; the defaults are
    a fresh process's."""

    deterministic_algorithms: bool = False
    warn_only: bool = False
    cudnn_deterministic: bool = False
    cudnn_benchmark: bool = False
    fill_uninitialized_memory: bool = True


_FIELDS = tuple(f.name for f in attrs.fields(DeterminismState))
_NEUTRAL = DeterminismState()  # torch's defaults: what a fresh process observes


@register_probe
class DeterminismProbe(ContextProbe[DeterminismState]):
    name = "determinism"
    description = ("use_deterministic_algorithms (+warn_only), cuDNN deterministic/benchmark, "
                   "fill_uninitialized_memory")
    default = True
    guarded = True  # the guard sees the algorithms flags, not cuDNN or fill

    def __init__(self) -> None:
        self._last: tuple[tuple[bool, ...], DeterminismState] | None = None

    def observe(self) -> DeterminismState:
        values = (_algos(), _warn_only(), _cudnn_det(), _cudnn_bench(), _fill())
        last = self._last
        if last is not None and values == last[0]:
            return last[1]
        state = DeterminismState(*values)
        self._last = (values, state)
        return state

    def watch(self, state: DeterminismState) -> tuple[tuple[Callable[[], object], object], ...]:
        # The guard sees the algorithms flags (and warn_only); nothing else
        # here can change a traced graph.
        return ()

    def watch_forward(self, state: DeterminismState
                      ) -> tuple[tuple[Callable[[], object], object], ...]:
        # Process-global and invisible to the guard, but they only pick CUDA
        # kernels (cuDNN) or fill fresh memory: numerics, never the graph.
        return ((_cudnn_det, state.cudnn_deterministic), (_cudnn_bench, state.cudnn_benchmark),
                (_fill, state.fill_uninitialized_memory))

    def neutral_state(self) -> DeterminismState:
        return _NEUTRAL

    def replay(self, state: DeterminismState) -> AbstractContextManager[None]:
        return _replay(state)

    def neutral(self, state: DeterminismState) -> bool:
        return state == _NEUTRAL

    def encode(self, state: DeterminismState) -> dict[str, Any]:
        return attrs.asdict(state)

    def decode(self, data: Any, path: str) -> DeterminismState:
        doc = read_mapping(data, path, keys=set(_FIELDS), required=set(_FIELDS))
        return DeterminismState(*(read_bool(doc[f], f"{path}.{f}") for f in _FIELDS))

    def describe(self, state: DeterminismState) -> str:
        on = [f for f in _FIELDS if getattr(state, f) != getattr(_NEUTRAL, f)]
        return "default" if not on else ", ".join(
            f"{f}={getattr(state, f)}" for f in on)


def _set(state: DeterminismState) -> None:
    torch.use_deterministic_algorithms(state.deterministic_algorithms,
                                       warn_only=state.warn_only)
    torch._C._set_cudnn_deterministic(state.cudnn_deterministic)
    torch._C._set_cudnn_benchmark(state.cudnn_benchmark)
    _det.fill_uninitialized_memory = state.fill_uninitialized_memory  # type: ignore[attr-defined]


@contextmanager
def _replay(state: DeterminismState) -> Iterator[None]:
    before = DeterminismState(_algos(), _warn_only(), _cudnn_det(), _cudnn_bench(), _fill())
    if before == state:
        yield
        return
    _set(state)
    try:
        yield
    finally:
        _set(before)
