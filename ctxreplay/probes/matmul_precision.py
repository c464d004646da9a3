"""Float32 matmul precision, TF32 and reduced-precision reduction flags, and
torch's per-backend float32 precision settings (``fp32_precision``, torch >= 2.9).

Since torch 2.9 two APIs set the same knobs: the legacy one
(``torch.set_float32_matmul_precision``, ``torch.backends.cudnn.allow_tf32``,
``torch.backends.cuda.matmul.allow_tf32``) and the per-backend one
(``torch.backends.cuda.matmul.fp32_precision = "tf32"``, cuDNN conv/rnn,
mkldnn, generic).  Setting the new one can leave the legacy getters with no
answer: they *raise* ("mix of the legacy and new APIs").  This probe never
calls a legacy getter unguarded: where one raises, its value is recorded as
``None`` ("unavailable") and the per-backend values carry the state.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any

import attrs
import torch

from .._base.jsonread import key_path, read_bool, read_mapping, read_str
from ..core.probe import ContextProbe, applying
from ..core.registry import register_probe

__all__ = ["MatmulPrecisionProbe", "MatmulPrecisionState"]

# -- what this torch has (feature detection in one place) ----------------------

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
# Legacy getters that raise once the per-backend API has set a state they
# cannot express; their value is then recorded as None.
_MAY_RAISE = frozenset({"cuda_matmul_tf32", "cudnn_tf32"})
# The split-K part of the cuBLAS reduced-precision settings, a field of its own
# where the getters return ``(allow_reduced_precision, allow_splitk)`` (torch
# 2.9 on).  Before, there is no such setting and cuBLAS may always split K:
# what the newer default (True) means.
_SPLIT_K = frozenset({"cuda_fp16_reduced_precision_split_k",
                      "cuda_bf16_reduced_precision_split_k"})

_get_fp32 = getattr(torch._C, "_get_fp32_precision_getter", None)
_set_fp32 = getattr(torch._C, "_set_fp32_precision_setter", None)
# Candidate names: each kept only where the getter answers for it on this
# build (torch 2.13: backends generic/cuda/mkldnn -- cuDNN's conv and rnn
# live under "cuda" -- and ops all/conv/rnn/matmul; generic has only "all").
_BACKENDS = ("generic", "cuda", "mkldnn", "cudnn")
_OPS = ("all", "matmul", "conv", "rnn", "math_sdp")

_precision = torch._C._get_float32_matmul_precision
_LEGACY_PRECISIONS = ("highest", "high", "medium")


def _safe(get: Callable[[], Any]) -> Callable[[], Any]:
    """``get()``, or ``None`` where torch refuses to answer (mixed APIs)."""
    def read() -> Any:
        try:
            return get()
        except RuntimeError:
            return None
    return read


_legacy_precision: Callable[[], str | None] = _safe(_precision)


def _flags() -> tuple[tuple[str, Callable[[], bool | None], Callable[[], Any],
                            Callable[..., Any]], ...]:
    """``(field, get, raw_get, raw_set)`` per flag.  Since torch 2.9 the cuBLAS
    reduced-precision getters return ``(allow_reduced_precision, allow_splitk)``
    and the setters take both: each element is a field of its own (a tuple is
    always truthy), and ``_apply`` sets the pair in one call."""
    out: list[tuple[str, Callable[[], bool | None], Callable[[], Any], Callable[..., Any]]] = []
    for f, g, s in _FLAG_NAMES:
        get, set_ = getattr(torch._C, g, None), getattr(torch._C, s, None)
        if get is None or set_ is None:
            continue
        if f in _MAY_RAISE:
            out.append((f, _safe_bool(get), _safe(get), set_))
        elif isinstance(get(), tuple):
            out.append((f, _item(get, 0), get, set_))
            out.append((f + "_split_k", _item(get, 1), get, set_))
        else:
            out.append((f, _as_bool(get), get, set_))
    return tuple(out)


def _item(get: Callable[[], Any], i: int) -> Callable[[], bool]:
    return lambda: bool(get()[i])


def _as_bool(get: Callable[[], Any]) -> Callable[[], bool]:
    return lambda: bool(get())


def _safe_bool(get: Callable[[], Any]) -> Callable[[], bool | None]:
    read = _safe(get)

    def safe() -> bool | None:
        v = read()
        return None if v is None else bool(v)
    return safe


def _fp32_pairs() -> tuple[tuple[str, str, str], ...]:
    """``(key, backend, op)`` for every pair the getter answers, parents first
    (generic, then each backend's "all", then the ops): the order in which
    setting them never overrides a child already put in place."""
    if _get_fp32 is None or _set_fp32 is None:
        return ()
    found = []
    for b in _BACKENDS:
        for op in _OPS:
            try:
                value = _get_fp32(b, op)
            except (RuntimeError, ValueError, TypeError):
                continue  # not a (backend, op) pair of this build
            if isinstance(value, str):
                level = 0 if b == "generic" else 1 if op == "all" else 2
                found.append((level, b, op))
    return tuple((f"{b}.{op}", b, op) for _, b, op in sorted(found))


_FLAGS = _flags()
_FIELD_NAMES = tuple(f for f, _, _, _ in _FLAGS)
_PAIRS = _fp32_pairs()
_PAIR_KEYS = tuple(k for k, _, _ in _PAIRS)
_PAIR_GETTERS = tuple((k, functools.partial(_get_fp32, b, op)) for k, b, op in _PAIRS
                      ) if _get_fp32 is not None else ()
_cudnn_tf32 = next((get for f, get, _, _ in _FLAGS if f == "cudnn_tf32"), None)


def _spelling() -> frozenset[str]:
    """Precision names the per-backend API uses on this torch.  Releases
    differ in how they spell "inherit": "none" (2.13) or "default" (older);
    the current values tell which, since a fresh torch reports it for most
    pairs.  Both are accepted where nothing tells."""
    values = {_get_fp32(b, op) for _, b, op in _PAIRS} if _get_fp32 is not None else set()
    if "none" in values:
        return frozenset({"none", "ieee", "tf32", "bf16"})
    if "default" in values:
        return frozenset({"default", "ieee", "tf32", "bf16"})
    return frozenset({"none", "default", "ieee", "tf32", "bf16"})


_NAMES = _spelling()
# what torch refuses per backend (torch 2.13: "backend 'cuda' does not support
# precision 'bf16'"); a getter never reports it
_REFUSED = {"cuda": frozenset({"bf16"}), "cudnn": frozenset({"bf16"})}


def _names_for(key: str) -> frozenset[str]:
    return _NAMES - _REFUSED.get(key.partition(".")[0], frozenset())


# torch's documented defaults (TF32 off for cuBLAS, on for cuDNN; reduced-
# precision reductions allowed on CUDA, not on CPU)
_DEFAULT_FLAGS: dict[str, bool] = {
    "cuda_matmul_tf32": False, "cudnn_tf32": True,
    "cuda_fp16_reduced_precision": True, "cuda_fp16_reduced_precision_split_k": True,
    "cuda_bf16_reduced_precision": True, "cuda_bf16_reduced_precision_split_k": True,
    "cpu_fp16_reduced_precision": False,
}
# What a fresh torch 2.13 reports per pair: everything inherits ("none"),
# except cuDNN conv/rnn, whose default follows the legacy cuDNN TF32 flag (on).
_DEFAULT_PAIRS: dict[str, str] = {
    "generic.all": "none", "cuda.all": "none", "cuda.matmul": "none", "cuda.conv": "tf32",
    "cuda.rnn": "tf32", "mkldnn.all": "none", "mkldnn.matmul": "none", "mkldnn.conv": "none",
    "mkldnn.rnn": "none",
}


@attrs.frozen(cache_hash=True)
class MatmulPrecisionState:
    """``float32_matmul_precision`` is ``None`` where torch's legacy getter
    refuses to answer (a per-backend setting it cannot express); so is a
    flag's value.  ``fp32_precision`` holds ``("backend.op", precision)`` for
    every pair this torch has: ``()`` on a torch without the per-backend API,
    ``None`` when a document written by such a torch is read on one with it
    (not recorded: replay leaves the per-backend settings to the legacy ones)."""

    float32_matmul_precision: str | None
    flags: tuple[tuple[str, bool | None], ...]  # (field, value) for the flags this torch has
    fp32_precision: tuple[tuple[str, str], ...] | None = ()


def _observe() -> MatmulPrecisionState:
    return MatmulPrecisionState(
        _legacy_precision(),
        tuple((f, get()) for f, get, _, _ in _FLAGS),
        tuple((k, get()) for k, get in _PAIR_GETTERS),
    )


def _neutral() -> MatmulPrecisionState | None:
    if not set(_FIELD_NAMES) <= set(_DEFAULT_FLAGS):
        return None  # a flag whose default this probe does not know
    pairs: tuple[tuple[str, str], ...] = ()
    if _PAIRS:
        if "none" not in _NAMES or "default" in _NAMES or set(_PAIR_KEYS) != set(_DEFAULT_PAIRS):
            return None  # a spelling or a pair set whose fresh values are unknown here
        pairs = tuple((k, _DEFAULT_PAIRS[k]) for k in _PAIR_KEYS)
    return MatmulPrecisionState("highest", tuple((f, _DEFAULT_FLAGS[f]) for f in _FIELD_NAMES),
                                pairs)


_NEUTRAL = _neutral()


@register_probe
class MatmulPrecisionProbe(ContextProbe[MatmulPrecisionState]):
    name = "matmul_precision"
    description = ("float32 matmul precision, TF32 and reduced-precision reduction flags, "
                   "per-backend fp32_precision")
    default = True
    # The guard sees cuBLAS TF32 (so "highest" vs the rest) and the reduced-
    # precision flags; watch_forward covers what it does not.
    guarded = True

    def __init__(self) -> None:
        self._last: MatmulPrecisionState | None = None

    def observe(self) -> MatmulPrecisionState:
        state = _observe()
        last = self._last
        if last is not None and last == state:
            return last
        self._last = state
        return state

    def watch(self, state: MatmulPrecisionState
              ) -> tuple[tuple[Callable[[], object], object], ...]:
        # Nothing here changes a traced graph: only which kernels run.
        return ()

    def watch_forward(self, state: MatmulPrecisionState
                      ) -> tuple[tuple[Callable[[], object], object], ...]:
        # Process-global, numerics only.  The guard sees cuBLAS TF32 and so
        # "highest" vs the rest, not "high" vs "medium"; nor cuDNN's TF32
        # flag or any per-backend value.  The legacy getters are read through
        # a wrapper: they raise in a mixed-API state, and a watched getter
        # must never break the user's forward.
        checks: list[tuple[Callable[[], object], object]] = []
        if _PAIRS or state.float32_matmul_precision != "highest":
            # without the per-backend API, "highest" is covered by the guard
            checks.append((_legacy_precision, state.float32_matmul_precision))
        if _cudnn_tf32 is not None:
            checks.append((_cudnn_tf32, dict(state.flags).get("cudnn_tf32")))
        if state.fp32_precision:
            # ~0.1 us a pair (the getter parses two strings): once per forward
            want = dict(state.fp32_precision)
            checks.extend((get, want[k]) for k, get in _PAIR_GETTERS if k in want)
        return tuple(checks)

    def replay(self, state: MatmulPrecisionState) -> AbstractContextManager[None]:
        return _replay(state)

    def neutral_state(self) -> MatmulPrecisionState | None:
        return _NEUTRAL

    def neutral(self, state: MatmulPrecisionState) -> bool:
        if state.float32_matmul_precision != "highest":
            return False
        if any(v != _DEFAULT_FLAGS.get(f, v) for f, v in state.flags):
            return False
        if _NEUTRAL is not None and state.fp32_precision:
            return state.fp32_precision == _NEUTRAL.fp32_precision
        return not state.fp32_precision or all(
            v == _DEFAULT_PAIRS.get(k, v) for k, v in state.fp32_precision)

    def encode(self, state: MatmulPrecisionState) -> dict[str, Any]:
        out: dict[str, Any] = {"float32_matmul_precision": state.float32_matmul_precision,
                               "flags": dict(state.flags)}
        if state.fp32_precision:
            out["fp32_precision"] = dict(state.fp32_precision)
        return out

    def decode(self, data: Any, path: str) -> MatmulPrecisionState:
        return _decode(data, path)

    def describe(self, state: MatmulPrecisionState) -> str:
        # only what differs from torch's defaults, so a neutral state reads short
        changed = [f"{f}={'unavailable' if v is None else v}" for f, v in state.flags
                   if _DEFAULT_FLAGS.get(f, v) != v or v is None]
        if state.fp32_precision:
            changed += [f"{k}={v}" for k, v in state.fp32_precision
                        if _DEFAULT_PAIRS.get(k, v) != v]
        elif state.fp32_precision is None:
            changed.append("fp32_precision not recorded")
        prec = state.float32_matmul_precision or "mixed (legacy precision unavailable)"
        return prec + (f" [{', '.join(changed)}]" if changed else "")


def _without_absent_split_k(data: Any, path: str) -> dict[str, Any]:
    """The document's flags, less the split-K fields of a newer torch that
    this one lacks -- accepted only at the value this torch always has."""
    absent = _SPLIT_K - set(_FIELD_NAMES)
    flags = dict(read_mapping(data, path, keys=set(_FIELD_NAMES) | absent))
    for f in sorted(absent & set(flags)):
        if read_bool(flags.pop(f), f"{path}.{f}") is not True:
            raise ValueError(
                f"{path}.{f}: false, written by a torch whose cuBLAS reduced-precision "
                f"setting has a split-K part; torch {torch.__version__} has no such "
                "setting and always lets cuBLAS split K, so this context cannot be "
                "re-established here")
    return flags


def _decode(data: Any, path: str) -> MatmulPrecisionState:
    doc = read_mapping(data, path, keys={"float32_matmul_precision", "flags", "fp32_precision"},
                       required={"float32_matmul_precision", "flags"})
    where = f"{path}.float32_matmul_precision"
    raw_prec = doc["float32_matmul_precision"]
    prec = None if raw_prec is None else read_str(raw_prec, where,
                                                  choices=set(_LEGACY_PRECISIONS))
    if prec is None and not _PAIRS:
        raise ValueError(f"{where}: null (unavailable) only arises with torch's per-backend "
                         "fp32_precision API, which this torch does not have")
    flags = _without_absent_split_k(doc["flags"], f"{path}.flags")
    # Flags this torch lacks were refused above; flags it has but the
    # document lacks keep their current value on replay.
    current = dict(_observe().flags)
    values: list[tuple[str, bool | None]] = []
    for f in _FIELD_NAMES:
        if f not in flags:
            values.append((f, current[f]))
            continue
        fw = f"{path}.flags.{f}"
        if flags[f] is None:
            if f not in _MAY_RAISE or not _PAIRS:
                raise ValueError(f"{fw}: null (unavailable) is not a value this flag can have")
            values.append((f, None))
        else:
            values.append((f, read_bool(flags[f], fw)))
    pairs = _decode_pairs(doc, path)
    state = MatmulPrecisionState(prec, tuple(values), pairs)
    _check_consistent(state, path)
    return state


def _decode_pairs(doc: Mapping[str, Any], path: str) -> tuple[tuple[str, str], ...] | None:
    if "fp32_precision" not in doc:
        return None if _PAIRS else ()
    where = f"{path}.fp32_precision"
    if not _PAIRS:
        _check_legacy_expresses(doc, where)
        return ()
    given = read_mapping(doc["fp32_precision"], where, keys=set(_PAIR_KEYS))
    out = []
    for k in _PAIR_KEYS:
        if k not in given:
            raise ValueError(f"{where}[{k!r}]: missing required field")
        out.append((k, read_str(given[k], f"{where}[{k!r}]", choices=set(_names_for(k)))))
    return tuple(out)


def _check_legacy_expresses(doc: Mapping[str, Any], where: str) -> None:
    """A document written by a torch with the per-backend API, read on one
    without it: accepted where every pair inherits or says what the legacy
    flags beside it say (cuBLAS and cuDNN TF32) -- the legacy fields then
    hold the whole state; refused where a pair holds what this torch cannot
    set (mkldnn's bf16, say)."""
    given = read_mapping(doc["fp32_precision"], where)
    raw = doc.get("flags")
    flags: Mapping[str, Any] = raw if isinstance(raw, Mapping) else {}
    implied = {"cuda.matmul": flags.get("cuda_matmul_tf32"),
               "cuda.conv": flags.get("cudnn_tf32"), "cuda.rnn": flags.get("cudnn_tf32")}
    for k, v in given.items():
        value = read_str(v, key_path(where, k))
        if value in ("none", "default"):
            continue
        if k in implied and implied[k] is not None and (value == "tf32") == implied[k] \
                and value in ("tf32", "ieee"):
            continue
        raise ValueError(
            f"{key_path(where, k)}: {value!r}, written by a torch with the per-backend "
            f"fp32_precision settings; torch {torch.__version__} has only the legacy "
            "ones, which cannot express it, so this context cannot be re-established here")


def _check_consistent(state: MatmulPrecisionState, path: str) -> None:
    """Refuse combinations torch's getters never report together."""
    flags = dict(state.flags)
    pairs = dict(state.fp32_precision or ())
    prec, cublas = state.float32_matmul_precision, flags.get("cuda_matmul_tf32")
    if prec is not None and cublas is not None and cublas != (prec != "highest"):
        raise ValueError(f"{path}.flags.cuda_matmul_tf32: {cublas} contradicts "
                         f"float32_matmul_precision {prec!r} (TF32 is on exactly when it "
                         "is not 'highest')")
    if "cuda.matmul" in pairs:
        tf32 = pairs["cuda.matmul"] == "tf32"
        if cublas is not None and cublas != tf32:
            raise ValueError(f"{path}.flags.cuda_matmul_tf32: {cublas} contradicts "
                             f"fp32_precision['cuda.matmul'] {pairs['cuda.matmul']!r}")
        if tf32 and prec == "highest":
            raise ValueError(f"{path}.float32_matmul_precision: 'highest' contradicts "
                             "fp32_precision['cuda.matmul'] 'tf32' (torch's getter raises "
                             "there; the state records null)")
    cudnn = flags.get("cudnn_tf32")
    if cudnn is not None:
        for k in ("cuda.conv", "cuda.rnn"):
            if k in pairs and (pairs[k] == "tf32") != cudnn:
                raise ValueError(f"{path}.flags.cudnn_tf32: {cudnn} contradicts "
                                 f"fp32_precision[{k!r}] {pairs[k]!r}")


# -- replay -----------------------------------------------------------------

def _set_flags(target: MatmulPrecisionState, *, skip: frozenset[str]) -> None:
    """The legacy flags that differ, skipping unavailable (None) targets and
    ``skip``; only where they differ: a legacy setter called even with the
    value it has can make another getter raise (mixed APIs)."""
    want = dict(target.flags)
    done: set[Callable[..., Any]] = set()
    for f, get, raw_get, raw_set in _FLAGS:
        if raw_set in done or f in skip:
            continue
        done.add(raw_set)
        if f in _MAY_RAISE:
            if want.get(f) is not None and get() != want[f]:
                raw_set(want[f])
            continue
        current = raw_get()
        if isinstance(current, tuple):  # (allow_reduced_precision, allow_splitk)
            pair = (want.get(f, bool(current[0])), want.get(f + "_split_k", bool(current[1])))
            if pair != tuple(bool(v) for v in current):
                raw_set(*pair)
        elif f in want and bool(current) != want[f]:
            raw_set(want[f])


def _set_pairs(target: MatmulPrecisionState) -> None:
    if not target.fp32_precision or _set_fp32 is None:
        return
    want = dict(target.fp32_precision)
    for k, b, op in _PAIRS:  # parents first
        if k in want and _get_fp32(b, op) != want[k]:  # type: ignore[misc]
            _set_fp32(b, op, want[k])


def _attempt(target: MatmulPrecisionState, legacy: str | None, cudnn: bool | None) -> None:
    # 1. the legacy precision: it also resets the cuda and mkldnn matmul pairs
    if legacy is not None and _legacy_precision() != legacy:
        torch.set_float32_matmul_precision(legacy)
    # 2. the legacy cuDNN flag: it also sets cuda conv and rnn
    if cudnn is not None and _cudnn_tf32 is not None and _cudnn_tf32() != cudnn:
        torch._C._set_cudnn_allow_tf32(cudnn)
    # 3. the other legacy flags (cuBLAS TF32 only when no precision was set:
    #    the precision implies it)
    skip = {"cudnn_tf32"} | ({"cuda_matmul_tf32"} if legacy is not None else set())
    _set_flags(target, skip=frozenset(skip))
    # 4. the per-backend values, parents first, only where they still differ
    _set_pairs(target)


def _apply(target: MatmulPrecisionState) -> None:
    """Establish ``target`` so that ``_observe()`` reports it.

    A value the legacy getters cannot report (``None``) hides a legacy
    setting: any legacy value that makes the getter refuse reproduces it, so
    the few candidates are tried in turn -- the first attempt changes only
    what differs."""
    if _observe() == target:
        return
    cudnn_flag = dict(target.flags).get("cudnn_tf32")
    legacy_choices: tuple[str | None, ...] = (
        (target.float32_matmul_precision,) if target.float32_matmul_precision is not None
        else (None, *_LEGACY_PRECISIONS))
    cudnn_choices: tuple[bool | None, ...] = (
        (cudnn_flag,) if cudnn_flag is not None or _cudnn_tf32 is None else (None, True, False))
    for legacy in legacy_choices:
        for cudnn in cudnn_choices:
            _attempt(target, legacy, cudnn)
            if target.fp32_precision is None:
                return  # nothing per-backend to compare against
            if _observe() == target:
                return
    raise RuntimeError(f"matmul_precision: torch did not reach the state {target!r}; "
                       f"it reports {_observe()!r}")


def _replay(state: MatmulPrecisionState) -> AbstractContextManager[None]:
    return applying(_observe, _apply, state)
