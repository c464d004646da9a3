"""Context managers that put global torch state somewhere and put it back.

Written against torch directly (not through ctxreplay), so tests that build a
state with these and replay it with ctxreplay check one against the other.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TypeVar

import torch
import torch.utils.deterministic as det

T = TypeVar("T")


@contextmanager
def setting(get: Callable[[], T], set_: Callable[[T], object], value: T) -> Iterator[None]:
    before = get()
    set_(value)
    try:
        yield
    finally:
        set_(before)


@contextmanager
def deterministic(enabled: bool, *, warn_only: bool = False) -> Iterator[None]:
    before = (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def fill_uninitialized_memory(value: bool) -> AbstractContextManager[None]:
    return setting(lambda: det.fill_uninitialized_memory,
                   lambda v: setattr(det, "fill_uninitialized_memory", v), value)


def default_dtype(dtype: torch.dtype) -> AbstractContextManager[None]:
    return setting(torch.get_default_dtype, torch.set_default_dtype, dtype)


_FP32_PAIRS = (("generic", "all"), ("cuda", "all"), ("mkldnn", "all"), ("cuda", "conv"),
               ("cuda", "matmul"), ("cuda", "rnn"), ("mkldnn", "conv"), ("mkldnn", "matmul"),
               ("mkldnn", "rnn"))  # parents first


def _fp32_values() -> list[tuple[str, str, str]]:
    get = getattr(torch._C, "_get_fp32_precision_getter", None)
    if get is None:  # torch < 2.9: no per-backend API
        return []
    out = []
    for b, op in _FP32_PAIRS:
        try:
            out.append((b, op, get(b, op)))
        except RuntimeError:
            continue
    return out


@contextmanager
def fp32_precision_kept() -> Iterator[None]:
    """Put torch's per-backend fp32_precision values back on exit: the legacy
    setters move them (``set_float32_matmul_precision("highest")`` leaves
    ``cuda.matmul`` at "ieee" where a fresh torch 2.13 has "none"), so
    setting the legacy value back alone does not restore the state."""
    before = _fp32_values()
    try:
        yield
    finally:
        for b, op, value in before:
            if torch._C._get_fp32_precision_getter(b, op) != value:
                torch._C._set_fp32_precision_setter(b, op, value)


@contextmanager
def matmul_precision(precision: str) -> Iterator[None]:
    with fp32_precision_kept(), setting(torch.get_float32_matmul_precision,
                                        torch.set_float32_matmul_precision, precision):
        yield


@contextmanager
def fp32_precision(backend: str, op: str, precision: str) -> Iterator[None]:
    """A per-backend value set with torch's own API (torch >= 2.9), which can
    leave the legacy getters raising; every pair is put back on exit."""
    with fp32_precision_kept():
        torch._C._set_fp32_precision_setter(backend, op, precision)
        yield


@contextmanager
def cudnn_allow_tf32(value: bool) -> Iterator[None]:
    with fp32_precision_kept(), setting(torch._C._get_cudnn_allow_tf32,
                                        torch._C._set_cudnn_allow_tf32, value):
        yield


def cublas_fp16_reduced_precision(value: bool) -> AbstractContextManager[None]:
    """Since torch 2.9 the flag is a pair ``(allow_reduced_precision, allow_splitk)``;
    ``allow_splitk=False`` is only allowed with reduced precision off."""
    get = torch._C._get_cublas_allow_fp16_reduced_precision_reduction
    set_ = torch._C._set_cublas_allow_fp16_reduced_precision_reduction
    if isinstance(get(), tuple):
        return setting(get, lambda v: set_(*v), (value, value))
    return setting(get, set_, value)


def autocast_cache(enabled: bool) -> AbstractContextManager[None]:
    return setting(torch.is_autocast_cache_enabled, torch.set_autocast_cache_enabled, enabled)


@contextmanager
def raw_autocast(device: str, dtype: torch.dtype | None = None, *,
                 enabled: bool = True) -> Iterator[None]:
    """Autocast for a device this build cannot run (``torch.autocast`` refuses
    CUDA on a CPU build), through the raw per-device setters; ``dtype=None``
    keeps the device's dtype."""
    before = (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
    torch.set_autocast_enabled(device, enabled)
    if dtype is not None:
        torch.set_autocast_dtype(device, dtype)
    try:
        yield
    finally:
        torch.set_autocast_enabled(device, before[0])
        torch.set_autocast_dtype(device, before[1])


@contextmanager
def inference_with_grad() -> Iterator[None]:
    with torch.inference_mode(), torch.enable_grad():
        yield


@contextmanager
def rng_after_draws(seed: int, draws: int = 3) -> Iterator[None]:
    """A generator state reached by seeding and drawing; the caller's state is
    restored on exit."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for _ in range(draws):
            torch.rand(7)
        yield


def sdpa_fp16_bf16_reduction(allowed: bool) -> AbstractContextManager[None]:
    return setting(torch._C._get_math_sdp_allow_fp16_bf16_reduction,
                   torch._C._set_math_sdp_allow_fp16_bf16_reduction, allowed)


def denormals_flushed() -> bool:
    """Whether a denormal float32 comes out of a CPU multiply as 0: what
    ``torch.set_flush_denormal`` changes, read through torch (which has no
    getter for it)."""
    return (torch.tensor([1e-39], dtype=torch.float32) * 1.0).item() == 0.0


def flush_denormal(on: bool) -> AbstractContextManager[None]:
    return setting(denormals_flushed, torch.set_flush_denormal, on)


def mkldnn_enabled(value: bool) -> AbstractContextManager[None]:
    return setting(torch._C._get_mkldnn_enabled, torch._C._set_mkldnn_enabled, value)


def mkldnn_deterministic(value: bool) -> AbstractContextManager[None]:
    return setting(torch._C._get_mkldnn_deterministic, torch._C._set_mkldnn_deterministic,
                   value)
