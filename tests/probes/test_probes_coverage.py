"""The coverage table in docs/probes.md stays honest.

The table lists every piece of global or thread-local state torch's
``GlobalStateGuard`` and Dynamo's other global guards check, plus the guard's
blind spots, and which probe observes each.  These tests read torch itself:

* every field of ``GlobalStateGuard().__getstate__()`` and every Dynamo
  global guard (``GuardBuilder`` methods torch marks as global) has a row --
  a new torch that checks something new fails here until the table says who
  observes it or why nobody does;
* every row that names a probe is *flipped* with torch's own API: the probe
  must observe a different state, and the "seen by" column must match what
  ``GlobalStateGuard`` does (a ``guard`` row trips it, a ``—`` row does not);
* every row that names no probe gives a reason, and -- where the state can be
  flipped here -- no built-in probe sees it change (otherwise the row is
  stale).
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch
import torchstate as ts
from torch._C._dynamo.guards import GlobalStateGuard
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import ctxreplay

DOC = Path(__file__).resolve().parents[2] / "docs" / "probes.md"


def _rows() -> dict[str, dict[str, Any]]:
    text = DOC.read_text(encoding="utf-8")
    section = text.split("## Coverage", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, dict[str, Any]] = {}
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        assert len(cells) == 5, f"coverage row with {len(cells)} cells: {line}"
        key = cells[0].strip("`")
        assert key not in rows, f"coverage row {key!r} twice"
        probes = re.findall(r"`([a-z_]+)`", cells[2])
        assert probes or cells[2] == "none", f"{key}: probe cell {cells[2]!r}"
        rows[key] = {"seen_by": cells[1], "probes": probes, "replay": cells[3],
                     "why": cells[4]}
    assert rows, "no coverage table found in docs/probes.md"
    return rows


ROWS = _rows()


def _guard_fields() -> set[str]:
    state = json.loads(GlobalStateGuard().__getstate__())
    out = set()
    for k, v in state.items():
        if isinstance(v, dict):
            out |= {f"{k}.{kk}" for kk in v}
        else:
            out.add(k)
    return out


# GuardBuilder methods torch itself calls global-state guards (torch 2.13
# marks them skip_guard_check_spec); older torch: the names known here
_KNOWN_DYNAMO = {"AUTOGRAD_SAVED_TENSORS_HOOKS", "DEFAULT_DEVICE", "DETERMINISTIC_ALGORITHMS",
                 "DUAL_LEVEL", "DUPLICATE_INPUT", "FSDP_TRAINING_STATE",
                 "FUNCTORCH_STACK_MATCH", "GLOBAL_STATE", "GRAD_MODE", "SHAPE_ENV",
                 "TORCH_FUNCTION_STATE"}


def _dynamo_global_guards() -> set[str]:
    import torch._dynamo.guards as guards

    skip = getattr(guards, "SKIP_GUARD", None)
    builder = guards.GuardBuilder
    if skip is None:
        return {n for n in _KNOWN_DYNAMO if hasattr(builder, n)}
    return {n for n in dir(builder)
            if getattr(getattr(builder, n, None), "guard_check_spec", None) is skip}


@pytest.mark.xfail(GlobalStateGuard().__getstate__() is None, strict=True, raises=TypeError,
                   reason="torch 2.7: GlobalStateGuard has no __getstate__ (returns None), so "
                          "the fields it checks cannot be listed; 2.9.1 and later list them")
def test_every_guard_field_has_a_row() -> None:
    missing = sorted(_guard_fields() - {k for k, r in ROWS.items() if r["seen_by"] == "guard"})
    assert not missing, (f"GlobalStateGuard checks {missing}, which the coverage table in "
                         "docs/probes.md does not list: add a row naming the probe that "
                         "observes it, or none and why")


def test_every_dynamo_global_guard_has_a_row() -> None:
    rows = {k for k, r in ROWS.items() if r["seen_by"] == "Dynamo"}
    missing = sorted(_dynamo_global_guards() - rows)
    assert not missing, (f"Dynamo has global guards {missing} that the coverage table does "
                         "not list")


def test_rows_name_registered_probes_or_say_why_not() -> None:
    known = set(ctxreplay.probes.available_probes())
    for key, row in ROWS.items():
        assert set(row["probes"]) <= known, f"{key}: unknown probe in {row['probes']}"
        if not row["probes"]:
            assert len(row["why"]) >= 30, f"{key}: a row without a probe must say why"
        assert row["seen_by"] in {"guard", "Dynamo", "—"}, f"{key}: seen by {row['seen_by']!r}"


# -- flipping each state -------------------------------------------------------

class _Mode(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


class _DispatchMode(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


def _bf16_reduced(value: bool) -> AbstractContextManager[None]:
    get = torch._C._get_cublas_allow_bf16_reduced_precision_reduction
    set_ = torch._C._set_cublas_allow_bf16_reduced_precision_reduction
    if isinstance(get(), tuple):
        return ts.setting(get, lambda v: set_(*v), (value, value))
    return ts.setting(get, set_, value)


def _flag(get: Callable[[], Any], set_: Callable[[Any], Any],
          value: Any) -> Callable[[], AbstractContextManager[None]]:
    return lambda: ts.setting(get, set_, value)


@contextmanager
def _saved_tensors_hooks() -> Iterator[None]:
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        yield


@contextmanager
def _dual_level() -> Iterator[None]:
    with torch.autograd.forward_ad.dual_level():
        yield


@contextmanager
def _onednn_tf32() -> Iterator[None]:
    """oneDNN's TF32 flag on: a CPU build's getter returns ``None`` (the flag
    is for Intel GPUs) and its setter only warns, so "before" is ``False``
    there."""
    before = torch._C._get_onednn_allow_tf32()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        torch._C._set_onednn_allow_tf32(True)
        try:
            yield
        finally:
            torch._C._set_onednn_allow_tf32(bool(before))


_Flip = tuple[Callable[[], AbstractContextManager[Any]], Callable[[], AbstractContextManager[Any]]]


def _plain(flip: Callable[[], AbstractContextManager[Any]]) -> _Flip:
    return nullcontext, flip


ALL_SDPA = [SDPBackend.OVERRIDEABLE, SDPBackend.MATH, SDPBackend.FLASH_ATTENTION,
            SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]

# row key -> (base, flip): the flip is entered inside the base; what a row
# claims is checked between the two.  None: not flippable in this process.
FLIPS: dict[str, _Flip | None] = {
    "grad_mode": _plain(torch.no_grad),
    "autocast_state.enabled": _plain(lambda: torch.autocast("cpu", dtype=torch.bfloat16)),
    "autocast_state.dtype": (lambda: torch.autocast("cpu", dtype=torch.bfloat16),
                             lambda: torch.autocast("cpu", dtype=torch.float16)),
    "autocast_state.cached_enabled": _plain(lambda: ts.autocast_cache(False)),
    "default_dtype": _plain(lambda: ts.default_dtype(torch.float64)),
    "deterministic_algorithms": _plain(lambda: ts.deterministic(True)),
    "deterministic_algorithms_warn_only": (lambda: ts.deterministic(True),
                                           lambda: ts.deterministic(True, warn_only=True)),
    "allow_tf32": _plain(lambda: ts.matmul_precision("high")),
    "allow_fp16_reduce": _plain(lambda: ts.cublas_fp16_reduced_precision(False)),
    "allow_bf16_reduce": _plain(lambda: _bf16_reduced(False)),
    "num_threads": _plain(_flag(torch.get_num_threads, torch.set_num_threads,
                                1 if torch.get_num_threads() != 1 else 2)),
    "torch_function": _plain(torch._C.DisableTorchFunctionSubclass),
    "torch_function_all_disabled": _plain(torch._C.DisableTorchFunction),
    "GLOBAL_STATE": _plain(torch.no_grad),
    "GRAD_MODE": _plain(torch.no_grad),
    "DETERMINISTIC_ALGORITHMS": _plain(lambda: ts.deterministic(True)),
    "DEFAULT_DEVICE": _plain(lambda: torch.device("meta")),
    "TORCH_FUNCTION_STATE": _plain(_Mode),
    "DUAL_LEVEL": _plain(_dual_level),
    "FUNCTORCH_STACK_MATCH": None,   # a transform is a call (vmap(f)(x)), not a context
    "AUTOGRAD_SAVED_TENSORS_HOOKS": _plain(_saved_tensors_hooks),
    "FSDP_TRAINING_STATE": None,     # an FSDP module's own state
    "SHAPE_ENV": None,               # about inputs
    "DUPLICATE_INPUT": None,         # about inputs
    "inference_mode": (torch.no_grad, torch.inference_mode),
    "autocast_state.dtype (device off)": _plain(_flag(
        lambda: torch.get_autocast_dtype("cpu"), lambda d: torch.set_autocast_dtype("cpu", d),
        torch.float16)),
    "cudnn.deterministic": _plain(_flag(torch._C._get_cudnn_deterministic,
                                        torch._C._set_cudnn_deterministic, True)),
    "cudnn.benchmark": _plain(_flag(torch._C._get_cudnn_benchmark,
                                    torch._C._set_cudnn_benchmark, True)),
    "fill_uninitialized_memory": _plain(lambda: ts.fill_uninitialized_memory(False)),
    "cudnn.enabled": _plain(_flag(torch._C._get_cudnn_enabled, torch._C._set_cudnn_enabled,
                                  False)),
    "flush_denormal": _plain(lambda: ts.flush_denormal(True)),
    "mkldnn.enabled": _plain(lambda: ts.mkldnn_enabled(False)),
    "mkldnn.deterministic": _plain(lambda: ts.mkldnn_deterministic(True)),
    "mkldnn.allow_tf32": (_plain(_onednn_tf32)
                          if hasattr(torch._C, "_get_onednn_allow_tf32") else None),
    "cudnn.allow_tf32": _plain(lambda: ts.cudnn_allow_tf32(False)),
    "float32_matmul_precision": (lambda: ts.matmul_precision("high"),
                                 lambda: ts.matmul_precision("medium")),
    "fp32_precision": (_plain(lambda: ts.fp32_precision("mkldnn", "matmul", "bf16"))
                       if hasattr(torch._C, "_get_fp32_precision_getter") else None),
    "sdpa.enabled": _plain(lambda: sdpa_kernel([SDPBackend.MATH])),
    "sdpa.priority": _plain(lambda: sdpa_kernel(ALL_SDPA, set_priority=True)),
    "sdpa.math_fp16_bf16_reduction": _plain(lambda: ts.sdpa_fp16_bf16_reduction(True)),
    "flash_attention_impl": None,    # CUDA only: needs a registered implementation
    "dispatch_mode_stack": _plain(_DispatchMode),
    "rng": _plain(lambda: ts.rng_after_draws(1)),
}

# guard rows of Dynamo that go through GlobalStateGuard
_THROUGH_GUARD = {"GLOBAL_STATE", "GRAD_MODE", "DETERMINISTIC_ALGORITHMS"}


def test_every_row_has_a_flip_and_every_flip_a_row() -> None:
    assert set(FLIPS) == set(ROWS), (sorted(set(ROWS) - set(FLIPS)),
                                     sorted(set(FLIPS) - set(ROWS)))


def _observe_all() -> dict[str, Any]:
    return {n: ctxreplay.probes.get_probe(n).observe() for n, info in
            ctxreplay.probes.available_probes().items() if info.origin == "builtin"}


@pytest.mark.parametrize("key", sorted(k for k, f in FLIPS.items() if f is not None))
def test_each_row_says_what_torch_and_the_probes_do(key: str) -> None:
    row = ROWS[key]
    base, flip = FLIPS[key]  # type: ignore[misc]
    with ExitStack() as stack:
        stack.enter_context(base())
        before, guard = _observe_all(), GlobalStateGuard()
        with flip():
            after, tripped = _observe_all(), not guard.check()
            reason = guard.reason()
    changed = {n for n in before if before[n] != after[n]}
    if row["probes"]:
        assert changed & set(row["probes"]), (
            f"{key}: the table says {row['probes']} observe it, but flipping it changed "
            f"{sorted(changed) or 'no probe'}")
    else:
        assert not changed, (f"{key}: the table says no probe observes it, but "
                             f"{sorted(changed)} saw it change: update the table")
    if row["seen_by"] == "guard" or key in _THROUGH_GUARD:
        assert tripped, f"{key}: the table says GlobalStateGuard sees it; it did not"
    elif row["seen_by"] == "—":
        assert not tripped, (f"{key}: the table says GlobalStateGuard is blind to it, but it "
                             f"tripped ({reason.strip()})")
