"""Random number generator state: CPU and the current accelerator.  Opt-in."""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import attrs
import torch

from .._base.environment import ACCELERATORS
from .._base.jsonread import read_mapping, read_str
from ..core.probe import ContextProbe
from ..core.registry import register_probe

__all__ = ["RngProbe", "RngState"]

_MAX_B64 = 1 << 20


def _accelerator() -> str | None:
    acc = getattr(torch, "accelerator", None)
    if acc is None or not acc.is_available():
        return None
    dev = acc.current_accelerator()
    return None if dev is None else dev.type


@attrs.frozen(cache_hash=True)
class RngState:
    """Generator states as bytes; compared by content."""

    cpu: bytes = attrs.field(repr=False)
    accelerator: str | None = None
    accelerator_state: bytes | None = attrs.field(default=None, repr=False)

    @property
    def digest(self) -> str:
        h = hashlib.sha256(self.cpu)
        if self.accelerator_state is not None:
            h.update(self.accelerator_state)
        return h.hexdigest()[:16]


def _get_acc(device: str) -> bytes:
    return bytes(getattr(torch, device).get_rng_state().tolist())


def _set_acc(device: str, data: bytes) -> None:
    getattr(torch, device).set_rng_state(torch.tensor(list(data), dtype=torch.uint8))


@register_probe
class RngProbe(ContextProbe[RngState]):
    """Copying a generator state costs microseconds and kilobytes, so this
    probe is not in the default set; add it when a capture depends on random
    ops (dropout in train mode, ``torch.rand`` in forward)."""

    name = "rng"
    description = "CPU and current-accelerator generator state (opt-in: not cheap)"

    def observe(self) -> RngState:
        cpu = bytes(torch.get_rng_state().tolist())
        acc = _accelerator()
        return RngState(cpu, acc, _get_acc(acc) if acc else None)

    def replay(self, state: RngState) -> AbstractContextManager[None]:
        return _replay(state, self)

    def encode(self, state: RngState) -> dict[str, Any]:
        out: dict[str, Any] = {"cpu": base64.b64encode(state.cpu).decode("ascii")}
        if state.accelerator is not None and state.accelerator_state is not None:
            out["accelerator"] = state.accelerator
            out["accelerator_state"] = base64.b64encode(state.accelerator_state).decode("ascii")
        return out

    def decode(self, data: Any, path: str) -> RngState:
        doc = read_mapping(data, path, keys={"cpu", "accelerator", "accelerator_state"},
                           required={"cpu"})
        cpu = _b64(doc["cpu"], f"{path}.cpu")
        if len(cpu) != torch.get_rng_state().numel():
            raise ValueError(f"{path}.cpu: wrong length for a CPU generator state")
        acc = doc.get("accelerator")
        if acc is None:
            return RngState(cpu)
        device = read_str(acc, f"{path}.accelerator", choices=set(ACCELERATORS))
        if "accelerator_state" not in doc:
            raise ValueError(f"{path}.accelerator_state: missing required field")
        return RngState(cpu, device, _b64(doc["accelerator_state"], f"{path}.accelerator_state"))

    def describe(self, state: RngState) -> str:
        return f"sha256:{state.digest}"


def _b64(value: object, path: str) -> bytes:
    text = read_str(value, path, max_len=_MAX_B64)
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError):
        raise ValueError(f"{path}: not valid base64") from None


def _set(state: RngState) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(state.cpu), dtype=torch.uint8))
    if state.accelerator is not None and state.accelerator_state is not None \
            and state.accelerator == _accelerator():
        _set_acc(state.accelerator, state.accelerator_state)


@contextmanager
def _replay(state: RngState, probe: RngProbe) -> Iterator[None]:
    before = probe.observe()
    _set(state)
    try:
        yield
    finally:
        _set(before)
