"""The default device (``torch.set_default_device`` / ``with torch.device(...)``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch.overrides import _get_current_function_mode_stack
from torch.utils._device import DeviceContext

from .._base.jsonread import read_device
from ..core.probe import ContextProbe
from ..core.registry import register_probe

__all__ = ["DefaultDeviceProbe"]

_stack_len = torch._C._len_torch_function_stack


def _current() -> str:
    # torch.get_default_device() costs ~3 us (it builds a tensor to find an
    # index); the default device is the innermost DeviceContext mode, so an
    # empty mode stack answers at once.
    if not _stack_len():
        return "cpu"
    for mode in reversed(_get_current_function_mode_stack()):  # type: ignore[no-untyped-call]
        if isinstance(mode, DeviceContext):
            return str(mode.device)
    return "cpu"


@register_probe
class DefaultDeviceProbe(ContextProbe[str]):
    """The state is the device string as set (``"cuda"`` stays unindexed).
    ``GlobalStateGuard`` does not notice a change of the default device, so it
    is read on every call -- cheaply."""

    name = "default_device"
    description = "the default device for factory functions"
    default = True
    pinnable = True

    def observe(self) -> str:
        return _current()

    def watch(self, state: str) -> tuple[tuple[Callable[[], object], object], ...]:
        # An empty torch-function mode stack means "cpu": one C call per hit.
        if state == "cpu" and not _stack_len():
            return ((_stack_len, 0),)
        return ((_current, state),)

    def replay(self, state: str) -> AbstractContextManager[None]:
        if _current() == state:
            return nullcontext()
        return _enter_device(state)

    def neutral_state(self) -> str:
        return "cpu"

    def neutral(self, state: str) -> bool:
        return state == "cpu"

    def encode(self, state: str) -> str:
        return state

    def decode(self, data: Any, path: str) -> str:
        return read_device(data, path)

    def describe(self, state: str) -> str:
        return state


@contextmanager
def _enter_device(device: str) -> Iterator[None]:
    with torch.device(device):
        yield
