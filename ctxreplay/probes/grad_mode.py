"""Grad mode and inference mode."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import attrs
import torch

from .._base.jsonread import read_bool, read_mapping
from ..core.probe import ContextProbe
from ..core.registry import register_probe

__all__ = ["GradModeProbe", "GradModeState"]

_grad = torch._C.is_grad_enabled
_inference = torch.is_inference_mode_enabled


@attrs.frozen(cache_hash=True)
class GradModeState:
    """Whether autograd records (``torch.is_grad_enabled()``) and whether
    inference mode is on (``torch.is_inference_mode_enabled()``)."""

    grad_enabled: bool = True
    inference_mode: bool = False


_STATES = {(g, i): GradModeState(g, i) for g in (True, False) for i in (True, False)}


@register_probe
class GradModeProbe(ContextProbe[GradModeState]):
    """Grad mode is recorded by export when set inside the traced callable
    (``wrap_with_set_grad_enabled``); ``inference_mode`` entered there is
    silently dropped (no graph node), so it is always replayed around the
    capture."""

    name = "grad_mode"
    description = "grad enabled (traceable) and inference mode (replayed around capture)"
    default = True
    traceable = True
    guarded = True  # the guard sees grad mode; no_grad -> inference_mode it does not

    def observe(self) -> GradModeState:
        return _STATES[(_grad(), _inference())]

    def watch(self, state: GradModeState) -> tuple[tuple[Callable[[], object], object], ...]:
        # thread-local, and it decides what a trace records (inference tensors)
        return ((_inference, state.inference_mode),)

    def replay(self, state: GradModeState) -> AbstractContextManager[None]:
        return _replay(state, inference=True, grad=True)

    def split_replay(
        self, state: GradModeState
    ) -> tuple[AbstractContextManager[None] | None, AbstractContextManager[None] | None]:
        return _replay(state, inference=False, grad=True), _replay(state, inference=True,
                                                                   grad=False)

    def neutral_state(self) -> GradModeState:
        return _STATES[(True, False)]

    def neutral(self, state: GradModeState) -> bool:
        # An artifact is normally run for inference; only inference mode itself
        # must be re-established by the caller (it cannot be embedded).
        return not state.inference_mode

    def encode(self, state: GradModeState) -> dict[str, Any]:
        return {"grad_enabled": state.grad_enabled, "inference_mode": state.inference_mode}

    def decode(self, data: Any, path: str) -> GradModeState:
        doc = read_mapping(data, path, keys={"grad_enabled", "inference_mode"},
                           required={"grad_enabled", "inference_mode"})
        return _STATES[(read_bool(doc["grad_enabled"], f"{path}.grad_enabled"),
                        read_bool(doc["inference_mode"], f"{path}.inference_mode"))]

    def describe(self, state: GradModeState) -> str:
        if state.inference_mode:
            return "inference_mode" + ("" if not state.grad_enabled else " (grad on)")
        return "grad" if state.grad_enabled else "no_grad"


@contextmanager
def _replay(state: GradModeState, *, inference: bool, grad: bool) -> Iterator[None]:
    # Built lazily: torch.set_grad_enabled(...) acts when constructed, not on enter.
    inf_ctx = (torch.inference_mode(state.inference_mode)
               if inference and _inference() != state.inference_mode else None)
    if inf_ctx is not None:
        inf_ctx.__enter__()
    try:
        if grad and _grad() != state.grad_enabled:
            with torch.set_grad_enabled(state.grad_enabled):
                yield
        else:
            yield
    finally:
        if inf_ctx is not None:
            inf_ctx.__exit__(None, None, None)
