"""Integration probes, in this process: diffusers' attention backend observed,
keyed, replayed into the graph, carried by saved documents and guarded at
install; the SDPA lowering behind it; and the ``requires`` rule that keeps a
framework's probe out of the default set until the framework is imported.

The oracle is always an eager rerun of the same model under the backend in
question (diffusers' own kernels), compared by value -- never ctxreplay's
verdict alone -- and every test first shows the backends really differ, so
a graph of the wrong kernel would fail it.
"""

from __future__ import annotations

import json
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import ctxreplay
from ctxreplay._base.torchcaps import CAPS
from ctxreplay.core.probe import ContextProbe
from ctxreplay.integrations import lowering_math_sdpa, math_sdpa
from ctxreplay.probes import (
    ProbeObservationError,
    default_probes,
    get_probe,
    register_probe,
    unregister_probe,
)
from ctxreplay.testing import check_probe

pytestmark = [pytest.mark.models,
              pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning")]

diffusers = pytest.importorskip("diffusers")
dispatch = pytest.importorskip("diffusers.models.attention_dispatch")
attention_backend = dispatch.attention_backend

BACKENDS = ("_native_math", "flex")  # the CPU backends that differ from native


def _wan() -> nn.Module:
    torch.manual_seed(0)
    return diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4,
        out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=3,
        cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32).eval()


def _inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {"hidden_states": torch.rand(1, 4, 2, 8, 8, generator=g),
            "timestep": torch.tensor([3]),
            "encoder_hidden_states": torch.rand(1, 4, 16, generator=g)}


N_BLOCKS = 3


def _run(model: nn.Module, backend: str) -> torch.Tensor:
    # flex attention has no CPU backward: diffusers runs it without grad
    with torch.no_grad(), attention_backend(backend):
        out: torch.Tensor = model(**_inputs()).sample
    return out


def _capture(model: nn.Module, backend: str) -> ctxreplay.CaptureReport:
    with ctxreplay.capture_with(model, targets="repeated", verify="execute") as session, \
            torch.no_grad(), attention_backend(backend):
        model(**_inputs())
    return session.finalize()


@pytest.fixture(scope="module")
def wan() -> nn.Module:
    return _wan()


@pytest.fixture(scope="module")
def eager(wan: nn.Module) -> dict[str, torch.Tensor]:
    out = {b: _run(wan, b) for b in ("native", *BACKENDS)}
    for b in BACKENDS:  # else a graph of the wrong kernel could pass unnoticed
        assert not torch.equal(out[b], out["native"]), b
    return out


@pytest.fixture(scope="module")
def native_report(wan: nn.Module) -> ctxreplay.CaptureReport:
    report = _capture(wan, "native")
    assert report.ok, (report.failures, report.problems)
    return report


def test_the_probe_joins_the_default_set_once_diffusers_is_imported() -> None:
    assert "diffusers_attention" in default_probes()
    info = ctxreplay.probes.available_probes()["diffusers_attention"]
    assert info.default and info.inactive is None and info.origin == "builtin"
    assert ctxreplay.snapshot().describe()["diffusers_attention"] == "native"
    with attention_backend("_native_math"):
        assert ctxreplay.snapshot().describe()["diffusers_attention"] == "_native_math"
    assert ctxreplay.snapshot().describe()["diffusers_attention"] == "native"


def test_the_probe_keeps_the_contract() -> None:
    probe = get_probe("diffusers_attention")
    states = []
    for b in BACKENDS:
        with attention_backend(b):
            states.append(probe.observe())
    check_probe(probe, states, neutral=probe.neutral_state())


def test_a_backend_the_installed_diffusers_lacks_is_refused_by_name() -> None:
    probe = get_probe("diffusers_attention")
    state = probe.decode({"backend": "no_such_backend"}, "$.state")
    refused = r"no attention backend 'no_such_backend'.*_native_math"
    with pytest.raises(ValueError, match=refused), probe.replay(state):
        pass
    with pytest.raises(ValueError, match=r"\$\.state\.backend"):
        probe.decode({"backend": "a b"}, "$.state")


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_default_capture_never_runs_under_another_backend(
        wan: nn.Module, eager: dict[str, torch.Tensor], native_report: ctxreplay.CaptureReport,
        backend: str, tmp_path: Path) -> None:
    assert native_report.save_all(tmp_path).ok
    src = ctxreplay.load(tmp_path)
    handle = ctxreplay.install(wan, src)
    try:
        out = _run(wan, backend)
        stats = handle.stats()
        assert stats.total_hits == 0 and stats.reasons == {"context": N_BLOCKS}
        assert torch.equal(out, eager[backend])
        out = _run(wan, "native")  # the captured backend: dispatched, bit-identical
        assert handle.stats().total_hits == N_BLOCKS
        assert torch.equal(out, eager["native"])
    finally:
        handle.remove()
    assert src.check() == ()
    with attention_backend(backend):
        found = [d.text for d in src.check()]
    assert found and all(t.startswith(f"diffusers_attention: needs native, now {backend}")
                         for t in found), found


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_capture_under_a_backend_reproduces_it_by_value(
        wan: nn.Module, eager: dict[str, torch.Tensor], backend: str, tmp_path: Path) -> None:
    report = _capture(wan, backend)
    if backend == "flex" and CAPS.version < (2, 9):
        # torch 2.7's export cannot trace diffusers' flex attention: said, never ok
        assert not report.ok and {f.reason for f in report.failures} == {"unsupported_graph"}
        return
    assert report.ok, (report.failures, report.problems)
    assert {c.snapshot.describe()["diffusers_attention"] for c in report.captures} == {backend}
    handle = ctxreplay.install(wan, report)
    try:
        out = _run(wan, backend)
        assert handle.stats().total_hits == N_BLOCKS
        assert torch.equal(out, eager[backend])  # not native's kernel
        _run(wan, "native")  # another backend: eager, never this graph
        assert handle.stats().reasons == {"context": N_BLOCKS}
    finally:
        handle.remove()
    saved = report.save_all(tmp_path)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    states = [c["capture"]["snapshot"]["probes"]["diffusers_attention"]["state"]
              for c in manifest["captures"]]
    assert states and all(s == {"backend": backend} for s in states), states
    if backend == "flex" and not saved.ok:
        # torch.export cannot serialize flex attention's higher-order op on
        # some releases (2.13; 2.9.1 can): the capture stays usable in this
        # process and the manifest says so
        assert {r for _, _, r in saved.not_saved} == {"serialize_failed"}
    else:
        assert saved.ok
        sidecar = json.loads(next(tmp_path.glob("*.pt2.json")).read_text())
        assert sidecar["snapshot"]["probes"]["diffusers_attention"]["state"] == {
            "backend": backend}


def test_a_saved_math_capture_reproduces_it_in_this_process(
        wan: nn.Module, eager: dict[str, torch.Tensor], tmp_path: Path) -> None:
    report = _capture(wan, "_native_math")
    assert report.save_all(tmp_path).ok
    src = ctxreplay.load(tmp_path)
    with attention_backend("_native_math"):
        assert [d.text for d in src.check()] == []
    handle = ctxreplay.install(wan, src)
    try:
        out = _run(wan, "_native_math")
        assert handle.stats().total_hits == N_BLOCKS
        assert torch.equal(out, eager["_native_math"])
    finally:
        handle.remove()


def test_a_moved_private_name_is_an_observation_error_naming_the_version(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(dispatch, "_AttentionBackendRegistry")
    with pytest.raises(ProbeObservationError, match=rf"diffusers {diffusers.__version__}: "
                       r".*_AttentionBackendRegistry\._active_backend"):
        ctxreplay.snapshot(["diffusers_attention"])
    model = nn.Linear(3, 3)
    with ctxreplay.capture_with(model) as session:
        model(torch.rand(2, 3))
    report = session.finalize()
    assert not report.ok
    (problem,) = [p for p in report.problems if p.reason == "observation_error"]
    assert f"observe:FrameworkStateError (diffusers {diffusers.__version__})" in problem.names
    assert "probe diffusers_attention" in problem.names


# -- the SDPA lowering ----------------------------------------------------------


def _sdpa_cases() -> Iterator[tuple[torch.dtype, str | None, bool, bool]]:
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        for mask in (None, "bool", "float"):
            for causal in (False, True):
                for gqa in (False, True):
                    if not (mask and causal):
                        yield dtype, mask, causal, gqa


@pytest.mark.parametrize("dtype,mask,causal,gqa", list(_sdpa_cases()))
def test_math_sdpa_is_the_math_kernel_bit_for_bit(dtype: torch.dtype, mask: str | None,
                                                  causal: bool, gqa: bool) -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 9, 8, generator=g).to(dtype)
    k = torch.randn(2, 2 if gqa else 4, 11, 8, generator=g).to(dtype)
    v = torch.randn(k.shape, generator=g).to(dtype)
    m = None if mask is None else (torch.rand(9, 11, generator=g) > 0.3 if mask == "bool"
                                   else torch.randn(9, 11, generator=g).to(dtype))
    kw: dict[str, Any] = {"attn_mask": m, "is_causal": causal, "enable_gqa": gqa, "scale": 0.3}
    with sdpa_kernel(SDPBackend.MATH):
        ref = F.scaled_dot_product_attention(q, k, v, **kw)
    assert torch.equal(math_sdpa(q, k, v, **kw), ref)


@pytest.mark.parametrize("autocast", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mask", [None, "bool", "float"])
@pytest.mark.parametrize("inputs", [torch.float32, torch.bfloat16, "mixed"])
def test_math_sdpa_under_autocast_is_the_math_kernel_bit_for_bit(
        autocast: torch.dtype, mask: str | None, inputs: Any) -> None:
    """Under autocast the entry point casts its inputs and runs the kernel
    below autocast; the math op alone is on no autocast list, so the lowering
    must do both itself (float32 inputs, as a norm autocast keeps in float32
    hands them over, are the case that was 0.016 away)."""
    g = torch.Generator().manual_seed(0)
    dtypes = (torch.float32, torch.bfloat16, torch.float32) if inputs == "mixed" \
        else (inputs,) * 3
    q, k, v = (torch.randn(2, 4, 9, 8, generator=g).to(d) for d in dtypes)
    m = None if mask is None else (torch.rand(9, 9, generator=g) > 0.3 if mask == "bool"
                                   else torch.randn(9, 9, generator=g))
    with torch.autocast("cpu", dtype=autocast):
        with sdpa_kernel(SDPBackend.MATH):
            ref = F.scaled_dot_product_attention(q, k, v, attn_mask=m)
        got = math_sdpa(q, k, v, attn_mask=m)
        assert torch.is_autocast_enabled("cpu")  # left as it was
    assert got.dtype == ref.dtype == autocast
    assert torch.equal(got, ref)
    # the control: the math op as it came, under autocast, is another value
    with torch.autocast("cpu", dtype=autocast):
        plain = torch.ops.aten._scaled_dot_product_attention_math(
            q, k, v, None if m is None or m.dtype == torch.bool else m)[0]
    if mask != "bool":
        assert not torch.equal(plain.to(ref.dtype), ref)


class _MathAttention(nn.Module):
    """Chooses the math kernel inside its forward, as diffusers' _native_math does."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(2, 33, 3, 2, 8).permute(2, 0, 3, 1, 4).unbind(0)
        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(query=q, key=k, value=v)


class _Lowered(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mode = lowering_math_sdpa()
        assert mode is not None
        with mode:
            out: torch.Tensor = self.inner(x)
            return out


def test_the_lowering_writes_the_math_kernel_into_an_exported_graph() -> None:
    torch.manual_seed(0)
    model, x = _MathAttention(), torch.randn(2, 33, 16)
    live = model(x)
    plain = torch.export.export(model, (x,), strict=False).module()(x)
    assert not torch.equal(plain, live)  # the kernel choice was lost: flash ran
    lowered = torch.export.export(_Lowered(model), (x,), strict=False)
    assert torch.equal(lowered.module()(x), live)
    # outside a math-only selection the lowering leaves SDPA alone
    q = torch.randn(1, 2, 5, 8)
    mode = lowering_math_sdpa()
    assert mode is not None
    with mode:
        assert torch.equal(F.scaled_dot_product_attention(q, q, q),
                           torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                               q, q, q)[0])


# -- the requires rule ------------------------------------------------------------


class _NeedsAFramework(ContextProbe[int]):
    name = "test_needs_a_framework"
    description = "test: active once its framework is imported"
    default = True
    requires = ("ctxreplay_test_fake_framework",)

    def observe(self) -> int:
        return 0

    def replay(self, state: int) -> Any:
        import contextlib
        return contextlib.nullcontext()


def test_a_probe_that_requires_a_module_is_default_only_once_it_is_imported(
        monkeypatch: pytest.MonkeyPatch) -> None:
    register_probe(_NeedsAFramework)
    try:
        assert "test_needs_a_framework" not in default_probes()
        assert "test_needs_a_framework" not in ctxreplay.snapshot().names
        info = ctxreplay.probes.available_probes()["test_needs_a_framework"]
        assert info.inactive == "ctxreplay_test_fake_framework is not imported"
        monkeypatch.setitem(sys.modules, "ctxreplay_test_fake_framework",
                            types.ModuleType("ctxreplay_test_fake_framework"))
        # imported after ctxreplay and after the last snapshot: still seen
        assert "test_needs_a_framework" in default_probes()
        assert "test_needs_a_framework" in ctxreplay.snapshot().names
        assert ctxreplay.probes.available_probes()["test_needs_a_framework"].inactive is None
        monkeypatch.delitem(sys.modules, "ctxreplay_test_fake_framework")
        assert "test_needs_a_framework" not in ctxreplay.snapshot().names
    finally:
        unregister_probe("test_needs_a_framework")


# -- a backend set on the attention processors alone ----------------------------------

def _set_processors(model: nn.Module, backend: str | None) -> int:
    """Set each attention processor's own backend directly (the global
    backend stays as it is), as diffusers' ``set_attention_backend`` does
    for its processors; the number of processors set."""
    n = 0
    for m in model.modules():
        proc = getattr(m, "processor", None)
        if proc is not None and hasattr(proc, "_attention_backend"):
            proc._attention_backend = backend
            n += 1
    return n


def _run_plain(model: nn.Module) -> torch.Tensor:
    inputs = {k: v.to(next(model.parameters()).dtype) if v.is_floating_point() else v
              for k, v in _inputs().items()}
    with torch.no_grad():
        out: torch.Tensor = model(**inputs).sample
    return out


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def procs(request: pytest.FixtureRequest) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A Wan model in the dtype, and its eager outputs with every processor
    naming ``_native_math`` and with none naming a backend."""
    model = _wan().to(request.param)
    assert _set_processors(model, "_native_math") == 2 * N_BLOCKS
    math = _run_plain(model)
    _set_processors(model, None)
    native = _run_plain(model)
    assert not torch.equal(math, native)  # else a graph of the wrong kernel could pass
    return model, {"_native_math": math, "native": native}


def test_a_processor_backend_is_replayed_into_the_graph_by_value(
        procs: tuple[nn.Module, dict[str, torch.Tensor]], tmp_path: Path) -> None:
    model, eager = procs
    _set_processors(model, "_native_math")
    try:
        with ctxreplay.capture_with(model, targets="repeated", verify="execute") as session:
            _run_plain(model)
            # changed in place before finalize: the capture traces the backend the calls ran
            _set_processors(model, None)
            report = session.finalize()
    finally:
        _set_processors(model, None)
    assert report.ok, (report.failures, report.problems)
    described = {c.snapshot.describe()["diffusers_attention"] for c in report.captures}
    assert described == {"native; processors: _native_math x6"}, described
    for source in (report, _saved(report, tmp_path)):
        handle = ctxreplay.install(model, source)
        try:
            assert torch.equal(_run_plain(model), eager["native"])  # not the captured backend
            assert handle.stats().total_hits == 0
            assert handle.stats().reasons == {"context": N_BLOCKS}
            _set_processors(model, "_native_math")
            assert torch.equal(_run_plain(model), eager["_native_math"])  # the math kernel ran
            assert handle.stats().total_hits == N_BLOCKS
        finally:
            handle.remove()
            _set_processors(model, None)


def _saved(report: ctxreplay.CaptureReport, where: Path) -> Any:
    assert report.save_all(where).ok
    manifest = json.loads((where / "manifest.json").read_text())
    states = [c["capture"]["snapshot"]["probes"]["diffusers_attention"]["state"]
              for c in manifest["captures"]]
    assert states and all(s["backend"] == "native" and len(s["processors"]) == 2 * N_BLOCKS
                          and {b for _, b in s["processors"]} == {"_native_math"}
                          for s in states), states
    return ctxreplay.load(where)


def test_a_default_capture_never_runs_under_a_processor_backend(
        procs: tuple[nn.Module, dict[str, torch.Tensor]]) -> None:
    model, eager = procs
    with ctxreplay.capture_with(model, targets="repeated", verify="execute") as session:
        _run_plain(model)
    report = session.finalize()
    assert report.ok, (report.failures, report.problems)
    handle = ctxreplay.install(model, report)
    try:
        assert torch.equal(_run_plain(model), eager["native"])
        assert handle.stats().total_hits == N_BLOCKS
        # set after install and after a dispatched call: the next call sees it
        _set_processors(model, "_native_math")
        assert torch.equal(_run_plain(model), eager["_native_math"])
        assert handle.stats().total_hits == N_BLOCKS
        assert handle.stats().reasons == {"context": N_BLOCKS}
    finally:
        handle.remove()
        _set_processors(model, None)


def test_the_bound_probe_reads_its_own_models_processors() -> None:
    model, other = _wan(), _wan()
    probe = get_probe("diffusers_attention")
    mine, theirs = probe.bind(model), probe.bind(other)
    _set_processors(other, "_native_math")
    assert mine.observe() == probe.observe() == probe.neutral_state()
    state = theirs.observe()
    assert not theirs.neutral(state)
    assert {b for _, b in state.processors} == {"_native_math"}
    assert theirs.decode(theirs.encode(state), "$") == state
    with pytest.raises(ValueError, match=r"\$\.processors\[0\]\[1\]"):
        probe.decode({"backend": "native", "processors": [["blocks.0.attn1", "a b"]]}, "$")
    # the once-per-model-call getters see a change the per-call ones do not
    watched = theirs.watch_forward(state)
    assert len(watched) == 2 * N_BLOCKS and all(get() == want for get, want in watched)
    _set_processors(other, None)
    assert not all(get() == want for get, want in watched)
