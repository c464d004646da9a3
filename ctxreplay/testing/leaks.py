"""The leak oracle: ``leak_check()`` fails when the global torch state on
exit differs from the state on entry; ``global_state()`` is the comparable
tuple it uses for the parts torch's own ``GlobalStateGuard`` does not see
(the default device, inference mode, cuDNN flags, ...).  Public through
``ctxreplay.testing``.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager
from types import TracebackType
from typing import Any, NamedTuple, TypeVar

import torch
import torch.utils.deterministic as _deterministic

from .._base.torchcaps import CAPS, GlobalStateGuard
from ..core import registry
from ..core.observer import snapshot
from ..core.probe import ContextProbe
from ..core.snapshots import ContextSnapshot
from ..probes.numerics import denormal_mode

__all__ = ["GlobalState", "global_state", "leak_check", "state_changes"]

T = TypeVar("T")

_DEVICES = CAPS.autocast_devices


class GlobalState(NamedTuple):
    """Global torch state that ``GlobalStateGuard`` does not (fully) see.

    What the guard does not notice -- default device, autocast dtype
    per device, ``no_grad`` vs ``inference_mode``, cuDNN and oneDNN flags,
    the FPU's flush-denormal mode -- plus a few
    flags the guard does see, so that a failure message can name them.
    Compare two values with ``==``; ``state_changes`` lists the fields.
    """

    default_device: str
    autocast: tuple[tuple[str, bool, torch.dtype], ...]  # (device, enabled, dtype)
    autocast_cache_enabled: bool
    grad_enabled: bool
    inference_mode: bool
    default_dtype: torch.dtype
    deterministic_algorithms: bool
    deterministic_warn_only: bool
    fill_uninitialized_memory: bool
    cudnn_enabled: bool
    cudnn_benchmark: bool
    cudnn_deterministic: bool
    cudnn_allow_tf32: bool
    float32_matmul_precision: str  # "unavailable" where torch's getter raises (mixed APIs)
    torch_function_modes: int  # a leaked ``with torch.device(...)`` or other mode
    # torch >= 2.9's per-backend values, ("backend.op", precision); () before
    fp32_precision: tuple[tuple[str, str], ...] = ()
    # scaled-dot-product-attention: (flag, enabled)..., the priority order and
    # the math fp16/bf16 reduction flag (process-global, graph-affecting)
    sdpa: tuple[object, ...] = ()
    # the calling thread's FPU: (denormals_are_zero, flush_to_zero), both set
    # by torch.set_flush_denormal(True)
    denormal_mode: tuple[bool, bool] = (False, False)
    mkldnn_enabled: bool = True
    mkldnn_deterministic: bool = False


def global_state() -> GlobalState:
    """The current ``GlobalState`` (a few microseconds; for tests, not hot paths)."""
    return GlobalState(
        default_device=str(torch.get_default_device()),
        autocast=tuple(
            (d, bool(torch.is_autocast_enabled(d)), torch.get_autocast_dtype(d))
            for d in _DEVICES
        ),
        autocast_cache_enabled=bool(torch.is_autocast_cache_enabled()),
        grad_enabled=bool(torch.is_grad_enabled()),
        inference_mode=bool(torch.is_inference_mode_enabled()),
        default_dtype=torch.get_default_dtype(),
        deterministic_algorithms=bool(torch.are_deterministic_algorithms_enabled()),
        deterministic_warn_only=bool(torch.is_deterministic_algorithms_warn_only_enabled()),
        fill_uninitialized_memory=bool(_deterministic.fill_uninitialized_memory),  # type: ignore[attr-defined]
        cudnn_enabled=bool(torch.backends.cudnn.enabled),
        cudnn_benchmark=bool(torch.backends.cudnn.benchmark),
        cudnn_deterministic=bool(torch.backends.cudnn.deterministic),
        cudnn_allow_tf32=_unless_mixed(torch._C._get_cudnn_allow_tf32, False),
        float32_matmul_precision=_unless_mixed(torch._C._get_float32_matmul_precision,
                                               "unavailable"),
        torch_function_modes=int(torch._C._len_torch_function_stack()),
        fp32_precision=_fp32_precision(),
        sdpa=_sdpa(),
        denormal_mode=denormal_mode(),
        mkldnn_enabled=bool(torch.backends.mkldnn.enabled),
        mkldnn_deterministic=bool(torch.backends.mkldnn.deterministic),
    )


_SDPA_GETTERS = tuple(
    (n, g) for n in ("cudnn", "flash", "mem_efficient", "math", "overrideable", "fa3")
    if (g := getattr(torch._C, f"_get_{n}_sdp_enabled", None)) is not None)
_SDPA_EXTRA = tuple(g for g in (getattr(torch._C, "_get_sdp_priority_order", None),
                                getattr(torch._C, "_get_math_sdp_allow_fp16_bf16_reduction",
                                        None)) if g is not None)


def _sdpa() -> tuple[object, ...]:
    return (*((n, bool(g())) for n, g in _SDPA_GETTERS),
            *(tuple(v) if isinstance(v := g(), list) else v for g in _SDPA_EXTRA))


def _unless_mixed(get: Any, unavailable: T) -> T:
    # torch >= 2.9's legacy getters raise once the per-backend API has set a
    # state they cannot express: the oracle must describe it, not crash
    try:
        return get()  # type: ignore[no-any-return]
    except RuntimeError:
        return unavailable


_FP32_GET = getattr(torch._C, "_get_fp32_precision_getter", None)


def _fp32_pairs() -> tuple[tuple[str, str], ...]:
    if _FP32_GET is None:
        return ()
    out = []
    for b in ("generic", "cuda", "mkldnn"):
        for op in ("all", "matmul", "conv", "rnn"):
            try:
                _FP32_GET(b, op)
            except RuntimeError:
                continue
            out.append((b, op))
    return tuple(out)


_FP32_PAIRS = _fp32_pairs()


def _fp32_precision() -> tuple[tuple[str, str], ...]:
    assert _FP32_GET is not None or not _FP32_PAIRS
    return tuple((f"{b}.{op}", _FP32_GET(b, op)) for b, op in _FP32_PAIRS)  # type: ignore[misc]


def state_changes(
    guard: GlobalStateGuard,
    before: GlobalState,
    before_snapshot: ContextSnapshot | None = None,
) -> list[str]:
    """What changed since ``guard``, ``before`` and ``before_snapshot`` were taken,
    one human-readable line per difference; empty when nothing did."""
    out: list[str] = []
    if not guard.check():
        out.append(f"GlobalStateGuard: {guard.reason().strip() or 'changed'}")
    now = global_state()
    for field, a, b in zip(GlobalState._fields, before, now, strict=True):
        if a != b:
            out.append(f"{field}: {a!r} -> {b!r}")
    if before_snapshot is not None:
        after = snapshot(before_snapshot.probes)
        for d in before_snapshot.diff(after):
            out.append(f"probe {d.probe}: {d.left} -> {d.right}")
    return out


class _LeakCheck(AbstractContextManager[None]):
    def __init__(self, what: str, probes: tuple[ContextProbe[Any], ...]) -> None:
        self._what = what
        self._probes = probes
        self._guard: GlobalStateGuard | None = None
        self._before: GlobalState | None = None
        self._snapshot: ContextSnapshot | None = None

    def __enter__(self) -> None:
        # A fresh observer (explicit probes), so no cached snapshot hides a change.
        self._snapshot = snapshot(self._probes) if self._probes else None
        self._before = global_state()
        self._guard = GlobalStateGuard()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        assert self._guard is not None and self._before is not None
        problems = state_changes(self._guard, self._before, self._snapshot)
        if problems:
            where = f"{self._what}: " if self._what else ""
            raised = f" (the body raised {type(exc).__name__})" if exc is not None else ""
            raise AssertionError(
                f"{where}global torch state leaked{raised}:\n  - " + "\n  - ".join(problems)
            )


def leak_check(
    what: str = "",
    *,
    probes: Iterable[str | ContextProbe[Any]] | None = None,
) -> AbstractContextManager[None]:
    """A context that fails with ``AssertionError`` if global torch state on exit
    differs from the state on entry -- also when the body raises.

    Compared: ``GlobalStateGuard().check()``, ``global_state()`` (the guard's
    blind spots) and a fresh observation of ``probes`` (the default probe set
    when ``None``; pass ``()`` to skip probes).  The message starts with
    ``what`` and names every field that changed.  A body exception propagates
    unchanged when nothing leaked.
    """
    resolved = registry.resolve_probes(None if probes is None else list(probes))
    return _LeakCheck(what, resolved)


# -- check_probe ---------------------------------------------------------------
