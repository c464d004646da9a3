"""The sdpa_backend probe: the scaled-dot-product-attention backend
flags, their priority order and the math backend's fp16/bf16 reduction flag.

Acceptance: a block calling ``F.scaled_dot_product_attention`` observed live
under ``sdpa_kernel([SDPBackend.MATH])`` -- the deferred capture without the
probe differs from the live graph, with it the graph matches; the replay
restores every flag exactly (the suite's leak oracle checks after every test,
and ``global_state()`` carries the SDPA flags).
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import ctxreplay
from ctxreplay._base.torchcaps import CAPS
from ctxreplay.probes import SdpaBackendProbe, SdpaBackendState
from ctxreplay.testing import check_probe, global_state, leak_check

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

WITHOUT = [p for p in ctxreplay.probes.default_probes() if p != "sdpa_backend"]


class Attention(nn.Module):
    def __init__(self, dim: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v)


def _ops(gm: torch.fx.GraphModule) -> set[str]:
    # named as the report names them (operator.getitem -> "getitem")
    return {str(n.target) if isinstance(n.target, torch._ops.OpOverload) else n.target.__name__
            for n in gm.graph.nodes if n.op == "call_function"}


def _capture_ops(c: Any) -> set[str]:
    return {op for op, _ in c.ops}


def _raw_flags() -> tuple[object, ...]:
    return (torch._C._get_flash_sdp_enabled(), torch._C._get_mem_efficient_sdp_enabled(),
            torch._C._get_math_sdp_enabled(), torch._C._get_cudnn_sdp_enabled(),
            torch._C._get_overrideable_sdp_enabled(), torch._C._get_sdp_priority_order(),
            torch._C._get_math_sdp_allow_fp16_bf16_reduction())


def _session(model: nn.Module, probes: list[str] | None, backend: str) -> Any:
    with ctxreplay.capture_with(model, probes=probes, backend=backend, verify="execute") as s, \
            sdpa_kernel([SDPBackend.MATH]):
        model(torch.rand(1, 5, 8))
    report = s.finalize()
    assert report.failures == ()
    (capture,) = report.captures
    assert report.ok == capture.fidelity.ok
    return capture


def _wrong_layout(c: Any) -> bool:
    """The artifact run without the live flags returns the CPU flash kernel's
    layout, not the math kernel's contiguous one the live call returned."""
    return [(m.level, m.field) for m in c.fidelity.mismatches] == [("execute", "stride")]


def test_dynamo_capture_without_the_probe_differs_from_the_live_graph() -> None:
    """Dynamo's aten graph decomposes SDPA at capture, by the flags in force:
    live under MATH it is the math decomposition; a deferred capture without
    the probe records the CPU flash kernel that never ran."""
    torch.manual_seed(0)
    model = Attention().eval()
    x = torch.rand(1, 5, 8)
    with sdpa_kernel([SDPBackend.MATH]):
        live = _ops(torch._dynamo.export(model, aten_graph=True,
                                         assume_static_by_default=True)(x).graph_module)
    default = _ops(torch._dynamo.export(model, aten_graph=True,
                                        assume_static_by_default=True)(x).graph_module)
    flash = "aten._scaled_dot_product_flash_attention_for_cpu.default"
    assert flash in default and flash not in live and "aten.bmm.default" in live

    without = _session(model, WITHOUT, "dynamo")
    assert _capture_ops(without) == default != live         # what the capture gets wrong
    assert _wrong_layout(without)  # the values agree; the execute check sees the layout

    with_probe = _session(model, None, "dynamo")
    assert with_probe.fidelity.ok
    assert _capture_ops(with_probe) == live
    with sdpa_kernel([SDPBackend.MATH]):
        under_math = ctxreplay.probes.get_probe("sdpa_backend").observe()
    # what sdpa_kernel([MATH]) sets on this torch (2.7's leaves overrideable on)
    assert with_probe.snapshot["sdpa_backend"] == under_math
    assert "math" in under_math.enabled and "flash" not in under_math.enabled
    assert "sdpa_backend" in with_probe.ambient_only


def test_export_capture_carries_the_flags_for_a_later_decomposition() -> None:
    """torch.export keeps SDPA as one op; the flags decide its decomposition
    later.  With the probe the capture says so (``ambient_only``) and its
    snapshot reproduces the live decomposition; without it nothing does."""
    torch.manual_seed(0)
    model = Attention().eval()
    x = torch.rand(1, 5, 8)
    ep = torch.export.export(model, (x,), strict=False)  # as ctxreplay (2.7: strict default)
    with sdpa_kernel([SDPBackend.MATH]):
        live = _ops(ep.run_decompositions().graph_module)
    default = _ops(ep.run_decompositions().graph_module)
    assert live != default and "aten.clone.default" in default - live

    without = _session(model, WITHOUT, "export")
    assert _wrong_layout(without)
    assert "aten.scaled_dot_product_attention.default" in _capture_ops(without)
    assert "sdpa_backend" not in without.ambient_only
    assert _ops(without.artifact.run_decompositions().graph_module) == default != live

    with_probe = _session(model, None, "export")
    assert with_probe.fidelity.ok
    assert "sdpa_backend" in with_probe.ambient_only
    assert _ops(with_probe.artifact.run_decompositions().graph_module) == default
    with with_probe.snapshot.replay():
        assert _ops(with_probe.artifact.run_decompositions().graph_module) == live


def test_sdpa_kernel_inside_an_exported_callable_is_not_recorded() -> None:
    """Why the probe is not traceable: the program of a forward that enters
    ``sdpa_kernel`` itself is the same as without it, so its decomposition
    outside the context loses the choice."""

    class Inside(Attention):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with sdpa_kernel([SDPBackend.MATH]):
                return super().forward(x)

    torch.manual_seed(0)
    plain, inside = Attention().eval(), Inside().eval()
    inside.load_state_dict(plain.state_dict())
    x = torch.rand(1, 5, 8)
    a, b = torch.export.export(plain, (x,)), torch.export.export(inside, (x,))
    assert _ops(a.graph_module) == _ops(b.graph_module)
    assert _ops(a.run_decompositions().graph_module) == _ops(b.run_decompositions().graph_module)
    with sdpa_kernel([SDPBackend.MATH]):
        math_ops = _ops(a.run_decompositions().graph_module)
    assert _ops(b.run_decompositions().graph_module) != math_ops

    probe = ctxreplay.probes.get_probe("sdpa_backend")
    assert not probe.traceable
    with sdpa_kernel([SDPBackend.MATH]):
        state = probe.observe()
    inside_part, around = probe.split_replay(state)
    assert inside_part is None and around is not None


def test_replay_restores_flags_priority_and_reduction_exactly() -> None:
    probe = ctxreplay.probes.get_probe("sdpa_backend")
    before, raw = probe.observe(), _raw_flags()
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH], set_priority=True):
        torch._C._set_math_sdp_allow_fp16_bf16_reduction(True)
        try:
            live, live_raw = probe.observe(), _raw_flags()
        finally:
            torch._C._set_math_sdp_allow_fp16_bf16_reduction(False)
    assert raw == _raw_flags() and live_raw != raw
    with pytest.raises(KeyError), leak_check("sdpa replay", probes=()), probe.replay(live):
        assert _raw_flags() == live_raw
        raise KeyError("body")
    assert _raw_flags() == raw and probe.observe() == before
    assert "priority: cudnn>math" in probe.describe(live)


def test_the_leak_oracle_sees_the_sdpa_flags() -> None:
    """``global_state()`` carries the flags, so the suite's oracle (and
    ``leak_check(probes=())``) would fail a replay that left one changed."""
    before = global_state()
    torch._C._set_sdp_use_mem_efficient(False)
    try:
        assert global_state() != before
        with pytest.raises(AssertionError, match="sdpa"), leak_check("oracle", probes=()):
            torch._C._set_sdp_use_mem_efficient(True)
            torch._C._set_sdp_use_flash(False)
    finally:
        torch._C._set_sdp_use_flash(True)
        torch._C._set_sdp_use_mem_efficient(True)
    assert global_state() == before


def test_neutral_is_torchs_default() -> None:
    probe = ctxreplay.probes.get_probe("sdpa_backend")
    fresh = probe.observe()
    assert fresh == probe.neutral_state() and probe.neutral(fresh)
    assert probe.describe(fresh) == "default"
    assert fresh.enabled == ("cudnn", "flash", "mem_efficient", "math", "overrideable")
    # this release's own default (2.7's repeats math in its fifth slot);
    # tests/_base/test_torchcaps.py checks it against a fresh process
    assert fresh.priority == CAPS.sdp_default_priority
    with sdpa_kernel([SDPBackend.MATH]):
        assert not probe.neutral(probe.observe())


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only watch list")
def test_a_cpu_process_watches_only_what_the_cpu_selection_reads() -> None:
    """Per block call: flash, math and the math reduction flag -- what
    ``select_sdp_backend_cpp`` and the math decomposition read.  The rest is
    checked once per forward (``watch_forward``), so a switch of it is still
    seen before a cached snapshot is reused."""
    probe = SdpaBackendProbe()
    assert probe.watched == ("flash", "math")
    state = probe.observe()
    assert len(probe.watch(state)) == 3
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]):  # mem_efficient etc. off
        assert all(g() == e for g, e in probe.watch(state))
        assert not all(g() == e for g, e in probe.watch_forward(state))
        # and it changed nothing a CPU trace records
        q = torch.rand(1, 1, 4, 8)
        assert int(torch._fused_sdp_choice(q, q, q)) == int(SDPBackend.FLASH_ATTENTION)


def test_check_probe_with_a_state_for_every_knob() -> None:
    probe = ctxreplay.probes.get_probe("sdpa_backend")
    fresh = probe.observe()
    states = []
    for backends in ([SDPBackend.MATH], [SDPBackend.FLASH_ATTENTION],
                     [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
        with sdpa_kernel(backends):
            states.append(probe.observe())
    with sdpa_kernel([SDPBackend.OVERRIDEABLE, SDPBackend.MATH, SDPBackend.FLASH_ATTENTION,
                      SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION],
                     set_priority=True):
        states.append(probe.observe())  # every backend on, another order
    torch._C._set_math_sdp_allow_fp16_bf16_reduction(True)
    try:
        states.append(probe.observe())
    finally:
        torch._C._set_math_sdp_allow_fp16_bf16_reduction(False)
    if hasattr(torch._C, "_set_sdp_use_fa3"):
        torch._C._set_sdp_use_fa3(True)
        try:
            states.append(probe.observe())
        finally:
            torch._C._set_sdp_use_fa3(False)
    assert len(set(states)) == len(states)
    check_probe(probe, states, neutral=fresh)


def test_decode_refuses_an_impossible_priority() -> None:
    probe = ctxreplay.probes.get_probe("sdpa_backend")
    doc = probe.encode(probe.observe())
    # where the release's own default repeats a backend (2.7), so can any order
    repeats = len(set(CAPS.sdp_default_priority)) < len(CAPS.sdp_default_priority)
    once = "expected 5 of" if repeats else "exactly once"
    cases = [(["flash", "math"], once),
             (["flash", "mem_efficient", "math", "cudnn", "warp"], r"priority\[4\]")]
    if not repeats:
        cases.append((["flash", "flash", "math", "cudnn", "overrideable"], "exactly once"))
    for bad, match in cases:
        with pytest.raises(ValueError, match=rf"^\$\.state\.priority.*{match}|{match}"):
            probe.decode({**doc, "priority": bad}, "$.state")
    assert probe.decode(doc, "$.state") == probe.observe()
    assert isinstance(probe.decode(doc, "$.state"), SdpaBackendState)


# -- CUDA: the kernel itself -------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_mem_efficient_vs_flash_is_replayed() -> None:
    """On a GPU the flags pick the kernel: live under
    ``sdpa_kernel([EFFICIENT_ATTENTION])`` a dynamo capture must record the
    memory-efficient kernel, not the flash one torch would pick by default."""
    probe = SdpaBackendProbe()
    assert {"mem_efficient", "cudnn"} <= set(probe.watched)  # CUDA present: watched per call
    torch.manual_seed(0)
    model = Attention(dim=64, heads=1).cuda().half().eval()
    x = torch.rand(1, 128, 64, device="cuda", dtype=torch.float16)
    reports = {}
    for name, probes in (("without", WITHOUT), ("with", None)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with ctxreplay.capture_with(model, probes=probes, backend="dynamo",
                                        verify="execute") as s, \
                    sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
                model(x)
        report = s.finalize()
        assert report.ok, report.failures
        reports[name] = _capture_ops(report.captures[0])
    efficient = "aten._scaled_dot_product_efficient_attention.default"
    assert efficient in reports["with"]
    assert efficient not in reports["without"]
