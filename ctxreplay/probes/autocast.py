"""Autocast: enabled flag and dtype per device type, and the autocast cache flag."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import attrs
import torch

from .._base.jsonread import dtype_name, read_bool, read_dtype, read_list, read_mapping, read_str
from .._base.torchcaps import AUTOCAST_DEVICE_TYPES, CAPS, dynamo_compiling
from ..core.probe import ContextProbe, Part, composed
from ..core.registry import register_probe

__all__ = ["AutocastProbe", "AutocastState"]

# torch.autocast's own rule (torch/amp/autocast_mode.py): every device type
# runs in bfloat16 or float16, a privateuse1 backend in what its module's
# get_amp_supported_dtype() lists.  For CUDA torch.autocast checks only
# bfloat16 support; float32 (autocast as a no-op) and float64 are in use, an
# integer, bool or complex "autocast dtype" is never meaningful.
_LOW_PRECISION = frozenset({torch.bfloat16, torch.float16})
_CUDA_DTYPES = frozenset({torch.bfloat16, torch.float16, torch.float32, torch.float64})


def _autocast_dtypes(device: str) -> frozenset[torch.dtype]:
    if device == "cuda":
        return _CUDA_DTYPES
    try:
        custom = torch._C._get_privateuse1_backend_name()
    except Exception:  # pragma: no cover - a torch without privateuse1
        custom = "privateuseone"
    if device == custom:
        mod = getattr(torch, custom, None)
        get = getattr(mod, "get_amp_supported_dtype", None)
        if get is not None:
            try:
                return frozenset(d for d in get() if isinstance(d, torch.dtype))
            except Exception:  # a broken backend module: torch's defaults
                return _LOW_PRECISION
    return _LOW_PRECISION


@attrs.frozen(cache_hash=True)
class AutocastState:
    """Devices with autocast enabled, each with its dtype; and the cache flag.

    The dtype of a device whose autocast is disabled has no effect on what
    runs, so it is not part of the state (and not read on the hot path).
    """

    enabled: tuple[tuple[str, torch.dtype], ...] = ()
    cache_enabled: bool = True

    def dtype_for(self, device_type: str) -> torch.dtype | None:
        for d, dt in self.enabled:
            if d == device_type:
                return dt
        return None


_is_any = torch._C._is_any_autocast_enabled
_is_enabled = torch._C.is_autocast_enabled
_get_dtype = torch._C.get_autocast_dtype
_cache_enabled = torch._C.is_autocast_cache_enabled


@register_probe
class AutocastProbe(ContextProbe[AutocastState]):
    name = "autocast"
    description = "torch.autocast enabled flag and dtype for every device type, and its cache flag"
    default = True
    traceable = True
    # GlobalStateGuard sees every device's enabled flag and (when enabled) its
    # dtype, and the cache flag, on every release from 2.7 (CAPS.guard_sees_*)
    guarded = True

    def __init__(self) -> None:
        self.devices = CAPS.autocast_devices
        self._off = {c: AutocastState((), c) for c in (True, False)}

    def observe(self) -> AutocastState:
        if not _is_any():
            return self._off[_cache_enabled()]
        enabled = tuple((d, _get_dtype(d)) for d in self.devices if _is_enabled(d))
        return AutocastState(enabled, _cache_enabled())

    def watch(self, state: AutocastState) -> tuple[tuple[Callable[[], object], object], ...]:
        if CAPS.guard_sees_autocast_flags and CAPS.guard_sees_autocast_dtype:
            return ()
        # a torch whose guard is blind to part of it: the whole observation
        return ((self.observe, state),)

    def replay(self, state: AutocastState) -> AbstractContextManager[None]:
        return self._replay(state)

    @contextmanager
    def _replay(self, state: AutocastState) -> Iterator[None]:
        want = dict(state.enabled)
        parts: list[Part] = []
        for d in self.devices:
            on = d in want
            if on == _is_enabled(d) and (not on or _get_dtype(d) == want[d]):
                continue
            parts.append(functools.partial(_device_autocast, d, on, want.get(d),
                                           state.cache_enabled))
        # made after the devices' parts are entered: torch.autocast sets the
        # cache flag itself, and Dynamo refuses the raw setter
        parts.append(functools.partial(_cache_part, state.cache_enabled))
        with composed(parts):  # no ExitStack where this torch's Dynamo cannot trace one
            yield

    def neutral_state(self) -> AutocastState:
        return self._off[True]

    def neutral(self, state: AutocastState) -> bool:
        return not state.enabled

    def encode(self, state: AutocastState) -> dict[str, Any]:
        return {
            "enabled": [[d, dtype_name(dt)] for d, dt in state.enabled],
            "cache_enabled": state.cache_enabled,
        }

    def decode(self, data: Any, path: str) -> AutocastState:
        doc = read_mapping(data, path, keys={"enabled", "cache_enabled"},
                           required={"enabled", "cache_enabled"})
        pairs = []
        for i, item in enumerate(read_list(doc["enabled"], f"{path}.enabled", max_len=32)):
            where = f"{path}.enabled[{i}]"
            pair = read_list(item, where, max_len=2)
            if len(pair) != 2:
                raise ValueError(f"{where}: expected [device_type, dtype]")
            device = read_str(pair[0], f"{where}[0]", choices=set(AUTOCAST_DEVICE_TYPES))
            if device not in self.devices:
                raise ValueError(f"{where}[0]: autocast is not available for {device!r} on "
                                 f"this torch; available: {list(self.devices)}")
            dtype = read_dtype(pair[1], f"{where}[1]")
            allowed = _autocast_dtypes(device)
            if dtype not in allowed:
                # replaying it would run e.g. nn.Linear in int64
                raise ValueError(f"{where}[1]: autocast on {device!r} does not run in "
                                 f"{dtype_name(dtype)}; it accepts "
                                 f"{sorted(dtype_name(d) for d in allowed)}")
            pairs.append((device, dtype))
        if len({d for d, _ in pairs}) != len(pairs):
            raise ValueError(f"{path}.enabled: a device type is listed twice")
        # observe() lists enabled devices in the probe's device order
        pairs.sort(key=lambda p: self.devices.index(p[0]))
        return AutocastState(tuple(pairs),
                             read_bool(doc["cache_enabled"], f"{path}.cache_enabled"))

    def describe(self, state: AutocastState) -> str:
        on = ", ".join(f"{d}:{dtype_name(dt)}" for d, dt in state.enabled) or "off"
        return on if state.cache_enabled else f"{on} (cache off)"


@contextmanager
def _device_autocast(device: str, enabled: bool, dtype: torch.dtype | None,
                     cache: bool) -> Iterator[None]:
    """``torch.autocast`` where it accepts the state (a tracer records it);
    raw setters where it would refuse it (e.g. CUDA autocast on a CPU build)."""
    if torch.compiler.is_compiling():
        # Dynamo cannot trace warning filters; it records torch.autocast itself.
        ctx = torch.autocast(device, dtype=dtype, enabled=enabled, cache_enabled=cache)
        if dynamo_compiling():
            with ctx:
                yield
            return
        # Under export, torch 2.7-2.8's __exit__ returns a truthy value and so
        # would swallow an error raised inside -- a probe's replay error, say
        # (CAPS.autocast_exit_swallows_errors).  Exiting it without the error,
        # then letting the error go on, is the same on every release.
        enter: Callable[[], object] = ctx.__enter__  # untyped in torch's stubs
        exit_: Callable[[None, None, None], object] = ctx.__exit__
        enter()
        try:
            yield
        finally:
            exit_(None, None, None)
        return
    before = (_is_enabled(device), _get_dtype(device))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ctx = torch.autocast(device, dtype=dtype, enabled=enabled, cache_enabled=cache)
    if ctx._enabled == enabled and (not enabled or ctx.fast_dtype == dtype):
        with ctx:
            yield
        return
    torch.set_autocast_enabled(device, enabled)
    if dtype is not None:
        torch.set_autocast_dtype(device, dtype)
    try:
        yield
    finally:
        torch.set_autocast_enabled(device, before[0])
        torch.set_autocast_dtype(device, before[1])


def _cache_part(enabled: bool) -> AbstractContextManager[None] | None:
    return _raw_cache(enabled) if _cache_enabled() != enabled else None


@contextmanager
def _raw_cache(enabled: bool) -> Iterator[None]:
    before = _cache_enabled()
    torch.set_autocast_cache_enabled(enabled)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(before)
