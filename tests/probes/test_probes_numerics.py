"""The numerics probe: the CPU's flush-denormal mode and oneDNN's flags.

Acceptance: a block whose output depends on flush-denormal, run live under
``torch.set_flush_denormal(True)``, is captured so that running the artifact
as its capture says (re-establishing ``ambient_only``) reproduces the live
output -- 0 -- by value, while a capture without the probe computes
something else and calls itself ok; the state survives a document, the
install guard sees it, the leak oracle catches a leaked flag, and on a CPU
that cannot flush denormals the probe says so.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import platform
import struct
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import pytest
import torch
import torchstate as ts
from torch import nn
from torch._C._dynamo.guards import GlobalStateGuard

import ctxreplay
from ctxreplay.core.snapshots import ContextSnapshot
from ctxreplay.loading.needs import check_needs, needs_from_document, needs_of
from ctxreplay.probes import NumericsProbe, NumericsState
from ctxreplay.testing import check_probe, global_state, state_changes

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

TINY = 1e-39  # a float32 denormal


class Underflow(nn.Module):
    """Scales its input into the denormal range and back up: every output is
    0 when denormals are flushed, ≈ 0.15 per input element otherwise."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        with torch.no_grad():
            self.lin.weight.fill_(1.5e38)
            self.lin.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x * TINY)


def _capture(probes: Any, x: torch.Tensor, **options: Any
             ) -> tuple[ctxreplay.CaptureReport, torch.Tensor]:
    model = Underflow().eval()
    session = ctxreplay.capture_with(model, probes=probes, backend="export", **options)
    with ts.flush_denormal(True), session:
        live = model(x)
    return session.finalize(), live


def _run_as_recorded(capture: ctxreplay.Capture, x: torch.Tensor) -> torch.Tensor:
    """The artifact on ``x``, with what its capture says it does not carry
    (``ambient_only``) re-established -- what a consumer must do."""
    snap = capture.snapshot
    with ExitStack() as stack:
        for name, probe, state in zip(snap.names, snap.probes, snap.states):
            if name in capture.ambient_only:
                stack.enter_context(probe.replay(state))
        out: torch.Tensor = capture.artifact.module()(x)
        return out


def test_a_flushed_denormal_is_reproduced_by_value() -> None:
    x = torch.rand(2, 4) + 0.5
    report, live = _capture(None, x, verify="execute")
    assert torch.count_nonzero(live) == 0                      # flushed live
    assert report.ok, report.failures
    (c,) = report.captures
    assert c.fidelity.ok and c.fidelity.status == "ok"
    assert "numerics" in c.ambient_only
    assert c.snapshot.describe()["numerics"] == "flush_denormal=True"
    assert not ts.denormals_flushed()                          # the test runs unflushed
    assert torch.equal(_run_as_recorded(c, x), live)           # 0, by value
    assert torch.count_nonzero(c.artifact.module()(x)) > 0     # the graph alone does not carry it

    # The false OK the probe removes (and proof the comparison can fail): the
    # same capture without it records nothing to re-establish, computes ≈ 0.15
    # per element where the live call returned 0, and its checks pass.
    without = [n for n in ctxreplay.probes.default_probes() if n != "numerics"]
    report, live = _capture(without, x, verify="execute")
    (c,) = report.captures
    assert report.ok and c.ambient_only == ()
    assert not torch.equal(_run_as_recorded(c, x), live)


def test_replay_off_records_the_need_but_does_not_trace_under_it() -> None:
    """``replay="off"`` traces without the state; flush-denormal changes no
    graph, so what keeps a consumer right is the recorded need, which the
    snapshot carries all the same."""
    x = torch.rand(2, 4) + 0.5
    report, live = _capture(None, x, verify="values", replay="off")
    (c,) = report.captures
    assert "numerics" in c.ambient_only
    assert torch.equal(_run_as_recorded(c, x), live)


def test_the_state_survives_a_document() -> None:
    with ts.flush_denormal(True), ts.mkldnn_deterministic(True):
        snap = ctxreplay.snapshot()
        state = snap.states[snap.names.index("numerics")]
    assert state.flush_denormal is True and dict(state.mkldnn)["deterministic"] is True
    doc = json.loads(json.dumps(snap.to_json()))
    assert doc["probes"]["numerics"]["state"]["denormals_are_zero"] is True
    back = ContextSnapshot.from_json(doc)
    assert back == snap
    assert back.states[back.names.index("numerics")] == state


@pytest.mark.parametrize("bad", [
    {"denormals_are_zero": 1, "flush_to_zero": True, "mkldnn": {}},
    {"denormals_are_zero": True, "flush_to_zero": True},
    {"denormals_are_zero": True, "flush_to_zero": True, "mkldnn": {"enabled": True}},
    {"denormals_are_zero": True, "flush_to_zero": True, "extra": 1,
     "mkldnn": {"enabled": True, "deterministic": False}},
    {"denormals_are_zero": True, "flush_to_zero": True,
     "mkldnn": {"enabled": True, "deterministic": False, "allow_tf32": True}},
])
def test_documents_are_read_strictly(bad: Any) -> None:
    probe = ctxreplay.probes.get_probe("numerics")
    with pytest.raises(ValueError, match=r"\$\.state"):
        probe.decode(bad, "$.state")


def test_the_install_guard_sees_the_denormal_mode() -> None:
    x = torch.rand(2, 4) + 0.5
    report, _ = _capture(None, x, verify="execute")
    (c,) = report.captures
    recorded = needs_from_document(json.loads(json.dumps(c.to_json())), None, "$.capture")
    for needs in (needs_of(c), recorded):
        (diff,) = [d for d in check_needs(needs) if d.field == "numerics"]
        assert diff.needed == "flush_denormal=True" and diff.found == "default"
        with ts.flush_denormal(True):
            assert not [d for d in check_needs(needs) if d.field == "numerics"]


def test_check_probe() -> None:
    probe = ctxreplay.probes.get_probe("numerics")
    states = []
    for make in (lambda: ts.flush_denormal(True), lambda: ts.mkldnn_enabled(False),
                 lambda: ts.mkldnn_deterministic(True)):
        with make():
            states.append(probe.observe())
    with ts.flush_denormal(True), ts.mkldnn_enabled(False):
        states.append(probe.observe())
    check_probe(probe, states, neutral=probe.neutral_state())


def test_the_denormal_mode_is_what_torch_kernels_do() -> None:
    """The probe reads the mode from Python float arithmetic; torch's float32
    CPU kernels obey the same control register."""
    for on in (False, True):
        with ts.flush_denormal(on):
            state = ctxreplay.probes.get_probe("numerics").observe()
            assert state.flush_denormal is ts.denormals_flushed() is on


def test_it_is_read_once_per_model_call_not_per_block() -> None:
    probe = ctxreplay.probes.get_probe("numerics")
    state = probe.observe()
    assert probe.watch(state) == ()
    watched = [g for g, _ in probe.watch_forward(state)]
    assert ctxreplay.probes.numerics.denormal_mode in watched


@pytest.mark.parametrize("leak", ["flush_denormal", "mkldnn_enabled", "mkldnn_deterministic"])
def test_the_leak_oracle_catches_a_leaked_flag(leak: str) -> None:
    """torch's guard is blind to all three; ``global_state()`` is not (no
    probe snapshot is compared here)."""
    guard, before = GlobalStateGuard(), global_state()
    if leak == "flush_denormal":
        torch.set_flush_denormal(True)
        field = "denormal_mode"
    elif leak == "mkldnn_enabled":
        torch._C._set_mkldnn_enabled(False)
        field = leak
    else:
        torch._C._set_mkldnn_deterministic(True)
        field = leak
    try:
        assert guard.check()
        problems = state_changes(guard, before)
        assert [p for p in problems if p.startswith(f"{field}:")], problems
    finally:
        torch.set_flush_denormal(False)
        torch._C._set_mkldnn_enabled(True)
        torch._C._set_mkldnn_deterministic(False)
    assert state_changes(guard, before) == []


def test_a_cpu_that_cannot_flush_observes_a_constant_and_says_so(
        monkeypatch: pytest.MonkeyPatch) -> None:
    real = torch.set_flush_denormal
    monkeypatch.setattr(torch, "set_flush_denormal", lambda mode: False)
    probe = NumericsProbe()
    monkeypatch.undo()
    assert not probe.flush_settable
    fixed = probe.observe()
    assert fixed.flush_denormal is False
    with ts.flush_denormal(True):  # (real: this CPU can; the probe believes it cannot)
        assert probe.observe() == fixed
    assert probe.watch_forward(fixed) and all(
        g is not ctxreplay.probes.numerics.denormal_mode for g, _ in probe.watch_forward(fixed))
    assert "cannot flush denormals" in probe.describe(fixed)
    flushed = NumericsState(True, True, fixed.mkldnn)
    before = global_state()
    with pytest.raises(RuntimeError, match="cannot change the denormal mode"), \
            probe.replay(flushed):
        pass
    assert global_state() == before and real is torch.set_flush_denormal


# -- one bit only (set by other means than torch) ---------------------------------

def _mxcsr_env() -> tuple[Any, int] | None:
    """glibc on x86-64: ``fegetenv``/``fesetenv`` carry MXCSR at byte 28 of
    the 32-byte ``fenv_t``."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return None
    name = ctypes.util.find_library("m")
    return (ctypes.CDLL(name), 28) if name else None


@contextmanager
def _mxcsr_bits(bits: int) -> Iterator[None]:
    env = _mxcsr_env()
    assert env is not None
    libm, at = env
    saved = ctypes.create_string_buffer(32)
    assert libm.fegetenv(saved) == 0
    raw = bytearray(saved.raw)
    mxcsr = struct.unpack_from("<I", raw, at)[0]
    struct.pack_into("<I", raw, at, (mxcsr & ~0x8040) | bits)
    assert libm.fesetenv(ctypes.create_string_buffer(bytes(raw), 32)) == 0
    try:
        yield
    finally:
        assert libm.fesetenv(saved) == 0


@pytest.mark.skipif(_mxcsr_env() is None, reason="needs glibc on x86-64 to set one MXCSR bit")
def test_one_bit_alone_is_observed_and_never_half_restored() -> None:
    probe = ctxreplay.probes.get_probe("numerics")
    with _mxcsr_bits(0x0040):  # denormals-are-zero only
        daz = probe.observe()
    with _mxcsr_bits(0x8000):  # flush-to-zero only
        ftz = probe.observe()
    assert (daz.denormals_are_zero, daz.flush_to_zero, daz.flush_denormal) == (True, False, None)
    assert (ftz.denormals_are_zero, ftz.flush_to_zero, ftz.flush_denormal) == (False, True, None)
    assert "only" in probe.describe(daz)
    before = global_state()
    with pytest.raises(RuntimeError, match="cannot set"), probe.replay(daz):
        pass
    assert global_state() == before
    with ts.flush_denormal(True):
        flushed = probe.observe()
    with _mxcsr_bits(0x8000):
        with pytest.raises(RuntimeError, match="cannot restore"), probe.replay(flushed):
            pass
        assert probe.observe() == ftz
    with _mxcsr_bits(0x8000), probe.replay(ftz):  # already current: nothing to do
        assert probe.observe() == ftz
