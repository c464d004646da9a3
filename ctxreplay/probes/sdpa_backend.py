"""Scaled-dot-product-attention backend selection: which backends
``F.scaled_dot_product_attention`` may use (``torch.nn.attention.sdpa_kernel``,
``torch.backends.cuda.enable_*_sdp``), their priority order, and whether the
math backend may reduce in fp16/bf16.

These flags are process-global and decide the kernel -- on CUDA flash vs
memory-efficient vs math vs cuDNN -- and, on every device, the decomposition a
tracer records for an SDPA call (measured on CPU, torch 2.13: a program
decomposed under ``sdpa_kernel([SDPBackend.MATH])`` has no ``aten.clone``).
Torch's global-state guard sees none of them.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import attrs
import torch

from .._base.environment import ACCELERATORS
from .._base.jsonread import read_bool, read_list, read_mapping, read_str
from .._base.torchcaps import CAPS
from ..core.probe import ContextProbe, applying
from ..core.registry import register_probe

__all__ = ["SdpaBackendProbe", "SdpaBackendState"]

# -- what this torch has (feature detection in one place) ----------------------

# (name, getter, setter) in torch's own order (torch/nn/attention/__init__.py
# _backend_names), plus FA3 (torch >= 2.9), kept where both functions exist
_CANDIDATES = ("cudnn", "flash", "mem_efficient", "math", "overrideable", "fa3")


def _flag_functions() -> tuple[tuple[str, Callable[[], bool], Callable[[bool], None]], ...]:
    out = []
    for name in _CANDIDATES:
        get = getattr(torch._C, f"_get_{name}_sdp_enabled", None)
        set_ = getattr(torch._C, f"_set_sdp_use_{name}", None)
        if get is not None and set_ is not None:
            out.append((name, get, set_))
    return tuple(out)


_FLAGS = _flag_functions()
_NAMES = tuple(n for n, _, _ in _FLAGS)
#: backends a document from another torch may name that this one lacks
_ABSENT = frozenset(_CANDIDATES) - set(_NAMES)
_GET = {n: g for n, g, _ in _FLAGS}
_SET = {n: s for n, _, s in _FLAGS}
_get_priority = getattr(torch._C, "_get_sdp_priority_order", None)
_set_priority = getattr(torch._C, "_set_sdp_priority_order", None)
_get_reduction = getattr(torch._C, "_get_math_sdp_allow_fp16_bf16_reduction", None)
_set_reduction = getattr(torch._C, "_set_math_sdp_allow_fp16_bf16_reduction", None)
if _get_priority is None or _set_priority is None:
    _get_priority = _set_priority = None
if _get_reduction is None or _set_reduction is None:
    _get_reduction = _set_reduction = None

# SDPBackend values (priority entries) <-> the flag names above
_BACKEND_OF: dict[int, str] = {}
_SDPBackend = getattr(torch._C, "_SDPBackend", None)
for _flag, _member in (("math", "MATH"), ("flash", "FLASH_ATTENTION"),
                       ("mem_efficient", "EFFICIENT_ATTENTION"), ("cudnn", "CUDNN_ATTENTION"),
                       ("overrideable", "OVERRIDEABLE")):
    _value = getattr(_SDPBackend, _member, None)
    if _value is not None:
        _BACKEND_OF[int(_value)] = _flag
_ID_OF = {n: i for i, n in _BACKEND_OF.items()}


def _id(name: str) -> int:
    # a backend this module has no name for is carried as "#<value>"
    return _ID_OF[name] if name in _ID_OF else int(name[1:])

# torch's defaults (aten/src/ATen/Context.h): every backend enabled except
# FA3, which is opt-in; math may not reduce in fp16/bf16; the priority order
# is this release's (CAPS.sdp_default_priority)
_DEFAULT_FLAGS = {"cudnn": True, "flash": True, "mem_efficient": True, "math": True,
                  "overrideable": True, "fa3": False}


def _priority_names() -> tuple[str, ...] | None:
    if _get_priority is None:
        return None
    return tuple(_BACKEND_OF.get(int(i), f"#{int(i)}") for i in _get_priority())


def _without_absent_backends(data: Any, path: str) -> dict[str, Any]:
    """The document's flags, less backends of another torch that this one
    lacks (FA3 before 2.9): a backend this torch does not have is never
    chosen, what a disabled one means; enabled, the call may have run it."""
    given = dict(read_mapping(data, path, keys=set(_NAMES) | _ABSENT,
                              required=set(_NAMES)))
    for n in sorted(_ABSENT & set(given)):
        if read_bool(given.pop(n), f"{path}.{n}"):
            raise ValueError(
                f"{path}.{n}: true, written by a torch with the {n} attention backend; "
                f"torch {torch.__version__} has no such backend, so a call that may "
                "have run it cannot be re-established here")
    return given


def _watched_names() -> tuple[str, ...]:
    """The flags that can change what runs -- or what a tracer records -- on
    the devices this process has.  The CPU (and MPS) selection,
    ``select_sdp_backend_cpp``, reads only the flash and math flags, in a
    fixed order; the global priority order and the memory-efficient, cuDNN
    and FA3 flags matter only to the CUDA selection, the overrideable flag
    only to a registered privateuse1 backend.  Keeping the per-call list
    short keeps the cached-snapshot fast path cheap; every flag is still
    observed (and keyed) whenever anything else changes."""
    names = {"flash", "math"}
    try:
        if torch.cuda.is_available():
            names |= {"cudnn", "mem_efficient", "fa3"}
    except Exception:  # a broken CUDA install: watch as if it were there
        names |= {"cudnn", "mem_efficient", "fa3"}
    for device in ACCELERATORS:
        if device in ("cuda", "mps"):  # CUDA above; MPS selects like the CPU
            continue
        mod = getattr(torch, device, None)
        try:
            if mod is not None and mod.is_available():
                names |= {"mem_efficient", "cudnn"}
        except Exception:  # a broken backend install: not watched
            continue
    try:
        if torch._C._get_privateuse1_backend_name() != "privateuseone":
            names.add("overrideable")
    except Exception:  # pragma: no cover - a torch without privateuse1
        pass
    return tuple(n for n in _NAMES if n in names)


@attrs.frozen(cache_hash=True)
class SdpaBackendState:
    """``flags``: ``(backend, enabled)`` for every backend flag this torch has;
    ``priority``: backend names in torch's priority order (``None`` where
    torch has none); ``math_fp16_bf16_reduction``: whether the math backend
    may reduce in fp16/bf16 (``None`` where torch has no such flag)."""

    flags: tuple[tuple[str, bool], ...]
    priority: tuple[str, ...] | None = None
    math_fp16_bf16_reduction: bool | None = None

    @property
    def enabled(self) -> tuple[str, ...]:
        return tuple(n for n, on in self.flags if on)


def _observe() -> SdpaBackendState:
    return SdpaBackendState(
        tuple((n, bool(g())) for n, g, _ in _FLAGS),
        _priority_names(),
        None if _get_reduction is None else bool(_get_reduction()),
    )


def _neutral() -> SdpaBackendState:
    priority = _priority_names()
    if priority is not None:
        # torch's default order of the backends this torch knows; any it
        # knows beyond those keep their place at the end
        known = [n for n in CAPS.sdp_default_priority if n in priority]
        priority = (*known, *(n for n in priority if n not in known))
    return SdpaBackendState(
        tuple((n, _DEFAULT_FLAGS.get(n, True)) for n in _NAMES),
        priority,
        None if _get_reduction is None else False,
    )


_NEUTRAL = _neutral()


@register_probe
class SdpaBackendProbe(ContextProbe[SdpaBackendState]):
    """Replayed around the capture: ``sdpa_kernel`` entered inside a
    non-strict exported callable is not recorded (measured on torch 2.13:
    the program holds the same ``aten.scaled_dot_product_attention`` node),
    and raw flag setters would break a Dynamo trace.  A program whose SDPA
    is decomposed later must be decomposed under the same flags, so a
    non-neutral state is listed in ``ambient_only``."""

    name = "sdpa_backend"
    description = "scaled_dot_product_attention backend flags, priority order, math reduction"
    default = True
    # The guard sees none of this; watch() and watch_forward() list it all.
    guarded = True

    def __init__(self) -> None:
        self.watched = _watched_names()
        self._watch_getters = tuple((n, _GET[n]) for n in self.watched)
        self._last: SdpaBackendState | None = None

    def observe(self) -> SdpaBackendState:
        state = _observe()
        last = self._last
        if last is not None and last == state:
            return last
        self._last = state
        return state

    def watch(self, state: SdpaBackendState
              ) -> tuple[tuple[Callable[[], object], object], ...]:
        # Graph-affecting, process-global: checked on every block call, so
        # only the flags that matter on this process's devices (see
        # _watched_names); zero-argument C getters, ~30 ns each.
        flags = dict(state.flags)
        checks: list[tuple[Callable[[], object], object]] = [
            (g, flags[n]) for n, g in self._watch_getters]
        if _get_reduction is not None:
            # the math decomposition upcasts fp16/bf16 unless this is set
            checks.append((_get_reduction, state.math_fp16_bf16_reduction))
        return tuple(checks)

    def watch_forward(self, state: SdpaBackendState
                      ) -> tuple[tuple[Callable[[], object], object], ...]:
        # The flags not watched per block: they cannot change what runs on
        # this process's devices, but the state records them, so a snapshot
        # cached before a switch must still be refreshed once per forward.
        flags = dict(state.flags)
        checks: list[tuple[Callable[[], object], object]] = [
            (_GET[n], flags[n]) for n in _NAMES if n not in self.watched]
        if _get_priority is not None and state.priority is not None:
            # the raw list of ints: comparing lists costs far less than naming them
            checks.append((_get_priority, [_id(n) for n in state.priority]))
        return tuple(checks)

    def replay(self, state: SdpaBackendState) -> AbstractContextManager[None]:
        return _replay(state)

    def neutral_state(self) -> SdpaBackendState:
        return _NEUTRAL

    def neutral(self, state: SdpaBackendState) -> bool:
        return state == _NEUTRAL

    def encode(self, state: SdpaBackendState) -> dict[str, Any]:
        out: dict[str, Any] = {"flags": dict(state.flags)}
        if state.priority is not None:
            out["priority"] = list(state.priority)
        if state.math_fp16_bf16_reduction is not None:
            out["math_fp16_bf16_reduction"] = state.math_fp16_bf16_reduction
        return out

    def decode(self, data: Any, path: str) -> SdpaBackendState:
        optional = {"priority"} if _get_priority is not None else set()
        optional |= {"math_fp16_bf16_reduction"} if _get_reduction is not None else set()
        doc = read_mapping(data, path, keys={"flags", *optional},
                           required={"flags", *optional})
        given = _without_absent_backends(doc["flags"], f"{path}.flags")
        flags = tuple((n, read_bool(given[n], f"{path}.flags.{n}")) for n in _NAMES)
        priority = None
        if "priority" in doc:
            where = f"{path}.priority"
            current = _priority_names() or ()
            backends = set(_BACKEND_OF.values()) | set(current)
            items = read_list(doc["priority"], where, max_len=len(current))
            names = tuple(read_str(v, f"{where}[{i}]", choices=backends)
                          for i, v in enumerate(items))
            # A permutation -- except on a release whose own default holds a
            # backend twice (2.7 repeats math: CAPS.sdp_default_priority), where
            # sdpa_kernel(set_priority=True) leaves that extra slot as it was,
            # so any backend may repeat.
            repeats = len(set(CAPS.sdp_default_priority)) < len(CAPS.sdp_default_priority)
            if len(names) != len(current) or (not repeats and len(set(names)) != len(names)):
                each = "" if repeats else ", each exactly once"
                raise ValueError(f"{where}: expected {len(current)} of {sorted(backends)}{each}")
            priority = names
        reduction = None
        if "math_fp16_bf16_reduction" in doc:
            reduction = read_bool(doc["math_fp16_bf16_reduction"],
                                  f"{path}.math_fp16_bf16_reduction")
        return SdpaBackendState(flags, priority, reduction)

    def describe(self, state: SdpaBackendState) -> str:
        if state == _NEUTRAL:
            return "default"
        parts = []
        off = [n for n, on in state.flags if not on and _DEFAULT_FLAGS.get(n, True)]
        on = [n for n, v in state.flags if v and not _DEFAULT_FLAGS.get(n, True)]
        if off:
            parts.append("off: " + ",".join(off))
        if on:
            parts.append("on: " + ",".join(on))
        if state.priority is not None and state.priority != _NEUTRAL.priority:
            parts.append("priority: " + ">".join(state.priority))
        if state.math_fp16_bf16_reduction:
            parts.append("math fp16/bf16 reduction")
        return "; ".join(parts) or "default"


def _apply(state: SdpaBackendState) -> None:
    for n, on in state.flags:
        if _GET[n]() != on:
            _SET[n](on)
    if state.priority is not None and _set_priority is not None \
            and _priority_names() != state.priority:
        _set_priority([_id(n) for n in state.priority])
    if state.math_fp16_bf16_reduction is not None and _set_reduction is not None \
            and _get_reduction is not None \
            and bool(_get_reduction()) != state.math_fp16_bf16_reduction:
        _set_reduction(state.math_fp16_bf16_reduction)


def _replay(state: SdpaBackendState) -> AbstractContextManager[None]:
    # The raw setters, not sdpa_kernel: its exit re-enables what it found
    # but rebuilds the priority order from the enabled backends only, so a
    # priority set while a backend was off would not come back exactly.
    return applying(_observe, _apply, state)
