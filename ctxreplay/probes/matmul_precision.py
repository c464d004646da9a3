"""Float32 matmul precision, TF32 and reduced-precision reduction flags."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import attrs
import torch

from .._json import read_bool, read_mapping, read_str
from ..probe import ContextProbe
from ..registry import register_probe

__all__ = ["MatmulPrecisionProbe", "MatmulPrecisionState"]

# (field, getter name, setter name) -- only the pairs the installed torch has.
_FLAG_NAMES = (
    ("cuda_matmul_tf32", "_get_cublas_allow_tf32", "_set_cublas_allow_tf32"),
    ("cudnn_tf32", "_get_cudnn_allow_tf32", "_set_cudnn_allow_tf32"),
    ("cuda_fp16_reduced_precision", "_get_cublas_allow_fp16_reduced_precision_reduction",
     "_set_cublas_allow_fp16_reduced_precision_reduction"),
    ("cuda_bf16_reduced_precision", "_get_cublas_allow_bf16_reduced_precision_reduction",
     "_set_cublas_allow_bf16_reduced_precision_reduction"),
    ("cpu_fp16_reduced_precision", "_get_cpu_allow_fp16_reduced_precision_reduction",
     "_set_cpu_allow_fp16_reduced_precision_reduction"),
)


def _flags() -> tuple[tuple[str, Callable[[], bool], Callable[[], Any], Callable[..., Any]], ...]:
    """``(field, get, raw_get, raw_set)`` per flag.  Since torch 2.9 the cuBLAS
    reduced-precision getters return ``(allow_reduced_precision, allow_splitk)``
    and the setters take both: each element is a field of its own (a tuple is
    always truthy), and ``_apply`` sets the pair in one call."""
    out: list[tuple[str, Callable[[], bool], Callable[[], Any], Callable[..., Any]]] = []
    for f, g, s in _FLAG_NAMES:
        get, set_ = getattr(torch._C, g, None), getattr(torch._C, s, None)
        if get is None or set_ is None:
            continue
        if isinstance(get(), tuple):
            out.append((f, _item(get, 0), get, set_))
            out.append((f + "_split_k", _item(get, 1), get, set_))
        else:
            out.append((f, get, get, set_))
    return tuple(out)


def _item(get: Callable[[], Any], i: int) -> Callable[[], bool]:
    return lambda: bool(get()[i])


_FLAGS = _flags()
_FIELD_NAMES = tuple(f for f, _, _, _ in _FLAGS)
_PRECISIONS = {"highest", "high", "medium"}
_cudnn_tf32 = getattr(torch._C, "_get_cudnn_allow_tf32", lambda: True)
_precision = torch._C._get_float32_matmul_precision
# the guard's one blind spot here, by position in the state's flags
_CUDNN_INDEX = _FIELD_NAMES.index("cudnn_tf32") if "cudnn_tf32" in _FIELD_NAMES else -1


# torch's documented defaults (TF32 off for cuBLAS, on for cuDNN; reduced-
# precision reductions allowed on CUDA, not on CPU) -- used only to describe
_DEFAULT_FLAGS = {
    "cuda_matmul_tf32": False, "cudnn_tf32": True,
    "cuda_fp16_reduced_precision": True, "cuda_fp16_reduced_precision_split_k": True,
    "cuda_bf16_reduced_precision": True, "cuda_bf16_reduced_precision_split_k": True,
    "cpu_fp16_reduced_precision": False,
}


@attrs.frozen(cache_hash=True)
class MatmulPrecisionState:
    float32_matmul_precision: str
    flags: tuple[tuple[str, bool], ...]  # (field, value) for the flags this torch has


@register_probe
class MatmulPrecisionProbe(ContextProbe[MatmulPrecisionState]):
    name = "matmul_precision"
    description = "float32 matmul precision, TF32 and reduced-precision reduction flags"
    default = True
    guarded = True  # the guard sees all of these except cuDNN's TF32 flag

    def __init__(self) -> None:
        self._last: MatmulPrecisionState | None = None

    def observe(self) -> MatmulPrecisionState:
        prec = torch.get_float32_matmul_precision()
        flags = tuple((f, bool(get())) for f, get, _, _ in _FLAGS)
        last = self._last
        if last is not None and last.float32_matmul_precision == prec and last.flags == flags:
            return last
        self._last = MatmulPrecisionState(prec, flags)
        return self._last

    def watch(self, state: MatmulPrecisionState
              ) -> tuple[tuple[Callable[[], object], object], ...]:
        # The guard sees the precision only as cuBLAS allow_tf32, which "high"
        # and "medium" both set: a switch between them is a blind spot.  From
        # "highest" (allow_tf32 off) any switch trips the guard, so the common
        # state pays nothing (the getter costs ~0.1 us).
        prec: tuple[tuple[Callable[[], object], object], ...] = (
            () if state.float32_matmul_precision == "highest"
            else ((_precision, state.float32_matmul_precision),))
        if _CUDNN_INDEX < 0:
            return prec
        return (*prec, (_cudnn_tf32, state.flags[_CUDNN_INDEX][1]))

    def replay(self, state: MatmulPrecisionState) -> AbstractContextManager[None]:
        return _replay(state, self.observe)

    def neutral(self, state: MatmulPrecisionState) -> bool:
        return state.float32_matmul_precision == "highest"

    def encode(self, state: MatmulPrecisionState) -> dict[str, Any]:
        return {"float32_matmul_precision": state.float32_matmul_precision,
                "flags": dict(state.flags)}

    def decode(self, data: Any, path: str) -> MatmulPrecisionState:
        doc = read_mapping(data, path, keys={"float32_matmul_precision", "flags"},
                           required={"float32_matmul_precision", "flags"})
        prec = read_str(doc["float32_matmul_precision"], f"{path}.float32_matmul_precision",
                        choices=_PRECISIONS)
        flags = read_mapping(doc["flags"], f"{path}.flags", keys=set(_FIELD_NAMES))
        # Flags this torch lacks were refused above; flags it has but the
        # document lacks keep their current value on replay.
        current = dict(self.observe().flags)
        values = tuple((f, read_bool(flags[f], f"{path}.flags.{f}") if f in flags
                        else current[f]) for f in _FIELD_NAMES)
        return MatmulPrecisionState(prec, values)

    def describe(self, state: MatmulPrecisionState) -> str:
        # only what differs from torch's defaults, so a neutral state reads short
        changed = [f"{f}={v}" for f, v in state.flags if _DEFAULT_FLAGS.get(f, v) != v]
        return state.float32_matmul_precision + (f" [{', '.join(changed)}]" if changed else "")


def _apply(state: MatmulPrecisionState) -> None:
    # Precision first: setting it also moves the TF32 flag, which is then
    # put where the state says -- only where it differs: after
    # set_float32_matmul_precision("medium"), calling a legacy setter (even
    # with the value it already has) makes get_float32_matmul_precision()
    # raise ("mix of the legacy and new APIs", torch >= 2.9).
    torch.set_float32_matmul_precision(state.float32_matmul_precision)
    want = dict(state.flags)
    done: set[Callable[..., Any]] = set()
    for f, _, raw_get, raw_set in _FLAGS:
        if raw_set in done:
            continue
        done.add(raw_set)
        current = raw_get()
        if isinstance(current, tuple):  # (allow_reduced_precision, allow_splitk)
            pair = (want.get(f, bool(current[0])), want.get(f + "_split_k", bool(current[1])))
            if pair != tuple(bool(v) for v in current):
                raw_set(*pair)
        elif f in want and bool(current) != want[f]:
            raw_set(want[f])


@contextmanager
def _replay(state: MatmulPrecisionState,
            observe: Callable[[], MatmulPrecisionState]) -> Iterator[None]:
    before = observe()
    if before == state:
        yield
        return
    _apply(state)
    try:
        yield
    finally:
        _apply(before)
