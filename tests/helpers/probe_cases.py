"""Non-default states of every built-in probe, set with torch's own API,
and what torch does under each (so a test can show a replay really acts)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
import torchstate as ts
from torch.fx.experimental.proxy_tensor import make_fx
from torch.nn.attention import SDPBackend, sdpa_kernel


def mm_dtype() -> torch.dtype:
    return (torch.ones(2, 2) @ torch.ones(2, 2)).dtype


def _grad_effect() -> tuple[bool, bool, bool]:
    x = torch.ones(1, requires_grad=True)
    return (torch.is_grad_enabled(), (x * 2).requires_grad, torch.ones(1).is_inference())


def sdpa_graph(dtype: torch.dtype = torch.float32) -> tuple[str, ...]:
    """The aten ops make_fx records for an SDPA call on CPU: torch's backend
    selection runs at trace time (flash kernel vs the decomposed math)."""
    q = torch.zeros(1, 1, 4, 8, dtype=dtype)
    gm = make_fx(lambda q: F.scaled_dot_product_attention(q, q, q))(q)
    return tuple(sorted({str(n.target) for n in gm.graph.nodes if n.op == "call_function"}))


def _sdpa_math_bf16_graph() -> tuple[str, ...]:
    """The math decomposition of a bf16 SDPA: it upcasts (``_to_copy``) unless
    fp16/bf16 reduction is allowed."""
    with sdpa_kernel([SDPBackend.MATH]):
        return sdpa_graph(torch.bfloat16)


def _rand() -> list[float]:
    with torch.random.fork_rng(devices=[]):  # read the generator without moving it
        return torch.rand(3).tolist()


@dataclass(frozen=True)
class Case:
    id: str
    probe: str
    make: Callable[[], AbstractContextManager[Any]]
    effect: Callable[[], object]  # what torch does under the state


CASES = [
    Case("autocast-cpu-bf16", "autocast",
         lambda: torch.autocast("cpu", dtype=torch.bfloat16), mm_dtype),
    Case("autocast-cpu-fp16", "autocast",
         lambda: torch.autocast("cpu", dtype=torch.float16), mm_dtype),
    Case("autocast-cpu-bf16-cache-off", "autocast",
         lambda: torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False),
         lambda: (mm_dtype(), torch.is_autocast_cache_enabled())),
    Case("autocast-cache-off-only", "autocast", lambda: ts.autocast_cache(False),
         torch.is_autocast_cache_enabled),
    # torch.autocast refuses CUDA on a CPU build; the probe must replay it anyway.
    Case("autocast-cuda-raw-bf16", "autocast", lambda: ts.raw_autocast("cuda", torch.bfloat16),
         lambda: (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))),
    Case("grad-no_grad", "grad_mode", torch.no_grad, _grad_effect),
    Case("grad-inference_mode", "grad_mode", torch.inference_mode, _grad_effect),
    Case("grad-inference_mode-enable_grad", "grad_mode", ts.inference_with_grad,
         lambda: (torch.is_grad_enabled(), torch.is_inference_mode_enabled())),
    Case("determinism-warn_only", "determinism",
         lambda: ts.deterministic(True, warn_only=True),
         lambda: (torch.are_deterministic_algorithms_enabled(),
                  torch.is_deterministic_algorithms_warn_only_enabled())),
    Case("determinism-strict", "determinism", lambda: ts.deterministic(True),
         torch.are_deterministic_algorithms_enabled),
    Case("determinism-cudnn", "determinism",
         lambda: torch.backends.cudnn.flags(enabled=True, benchmark=True, deterministic=True),
         lambda: (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic)),
    Case("determinism-fill-off", "determinism", lambda: ts.fill_uninitialized_memory(False),
         lambda: torch.utils.deterministic.fill_uninitialized_memory),  # type: ignore[attr-defined]
    Case("default_dtype-float64", "default_dtype", lambda: ts.default_dtype(torch.float64),
         lambda: (torch.ones(1).dtype, (torch.arange(3) * 0.5).dtype)),
    Case("default_dtype-bfloat16", "default_dtype", lambda: ts.default_dtype(torch.bfloat16),
         lambda: torch.ones(1).dtype),
    Case("default_dtype-float16", "default_dtype", lambda: ts.default_dtype(torch.float16),
         lambda: torch.ones(1).dtype),
    Case("default_device-meta", "default_device", lambda: torch.device("meta"),
         lambda: torch.ones(1).device.type),
    Case("matmul-medium", "matmul_precision", lambda: ts.matmul_precision("medium"),
         torch.get_float32_matmul_precision),
    Case("matmul-high", "matmul_precision", lambda: ts.matmul_precision("high"),
         torch.get_float32_matmul_precision),
    Case("matmul-cudnn-tf32-off", "matmul_precision", lambda: ts.cudnn_allow_tf32(False),
         lambda: torch.backends.cudnn.allow_tf32),
    # A (bool, bool) pair since torch 2.9: a probe reading it as bool(...) sees nothing.
    Case("matmul-cublas-fp16-reduced-off", "matmul_precision",
         lambda: ts.cublas_fp16_reduced_precision(False),
         torch._C._get_cublas_allow_fp16_reduced_precision_reduction),
    Case("numerics-flush-denormal", "numerics", lambda: ts.flush_denormal(True),
         ts.denormals_flushed),
    Case("numerics-mkldnn-off", "numerics", lambda: ts.mkldnn_enabled(False),
         lambda: torch.backends.mkldnn.enabled),
    Case("numerics-mkldnn-deterministic", "numerics", lambda: ts.mkldnn_deterministic(True),
         lambda: torch.backends.mkldnn.deterministic),
    Case("rng-after-draws", "rng", lambda: ts.rng_after_draws(1234), _rand),
    Case("sdpa-math-only", "sdpa_backend", lambda: sdpa_kernel([SDPBackend.MATH]), sdpa_graph),
    Case("sdpa-flash-only", "sdpa_backend", lambda: sdpa_kernel([SDPBackend.FLASH_ATTENTION]),
         lambda: (torch.backends.cuda.math_sdp_enabled(), sdpa_graph())),
    # the CUDA-only priority order: on CPU it changes no graph, only the flags
    Case("sdpa-priority-cudnn-first", "sdpa_backend",
         lambda: sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH,
                              SDPBackend.FLASH_ATTENTION], set_priority=True),
         lambda: (torch._C._get_sdp_priority_order(), sdpa_graph())),
    Case("sdpa-math-fp16-bf16-reduction", "sdpa_backend",
         lambda: ts.sdpa_fp16_bf16_reduction(True), _sdpa_math_bf16_graph),
]
BUILTIN_PROBES = {"autocast", "grad_mode", "determinism", "default_dtype", "default_device",
                  "matmul_precision", "rng", "sdpa_backend", "mode_stack", "distributed",
                  "numerics", "diffusers_attention", "transformers_attention"}
# Built-ins whose registered instance replays no non-neutral state it
# observes, so no case here can pass the replay tests: each has its own file.
CASELESS = {"mode_stack": "types only; tests/probes/test_probes_mode_stack.py",
            "distributed": "a process's distributed mode is not re-entered; "
                           "tests/distributed/test_distributed.py",
            "diffusers_attention": "needs diffusers; tests/integrations/test_integrations.py",
            "transformers_attention": "reads attached models' configs; "
                                      "tests/integrations/test_integrations_transformers.py"}
