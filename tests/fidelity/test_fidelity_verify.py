"""Verification acceptance: at every level a capture that really disagrees
with its live call is reported as a mismatch -- never ok -- with a hint that
names the probe whose state the artifact did not carry."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torchstate import default_dtype

import ctxreplay
from ctxreplay import demo as demo_module
from ctxreplay.cli import main

# torch's own export internals warn about a deprecated pytree spelling
pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec:FutureWarning")


class Block(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.lin(x).relu()
        return out


class Stack(nn.Module):
    def __init__(self, depth: int = 2, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Linear(dim, dim)  # so every block sees the same input dtype
        self.blocks = nn.ModuleList([Block(dim) for _ in range(depth)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for b in self.blocks:
            x = b(x)
        return x


class Parallel(nn.Module):
    """Every block sees the float32 input itself."""

    def __init__(self, depth: int = 2, dim: int = 16) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(dim) for _ in range(depth)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([b(x) for b in self.blocks]).sum(0)


def _run_under_autocast(model: nn.Module, shapes: tuple[tuple[int, ...], ...],
                        **options: Any) -> ctxreplay.CaptureReport:
    with ctxreplay.capture_with(model, targets="repeated", **options) as session, \
            torch.autocast("cpu", dtype=torch.bfloat16), torch.inference_mode():
        for shape in shapes:
            model(torch.rand(*shape))
    return session.finalize()


def _only_capture(report: ctxreplay.CaptureReport) -> ctxreplay.Capture:
    assert not report.failures, report.failures
    assert len(report.captures) == 1
    return report.captures[0]


def test_signature_level_reports_the_unreplayed_autocast() -> None:
    report = _run_under_autocast(Stack(), ((2, 16),), replay="off", verify="signature")
    c = _only_capture(report)
    assert not c.fidelity.ok and not report.ok
    assert c.fidelity.checked == ("signature",)
    (m,) = c.fidelity.mismatches
    assert (m.level, m.field, m.live, m.captured) == ("signature", "dtype", "bfloat16",
                                                      "float32")
    assert m.hint is not None and "autocast=cpu:bfloat16" in m.hint


def test_signature_level_is_ok_when_replayed() -> None:
    report = _run_under_autocast(Stack(), ((2, 16),), verify="signature")
    c = _only_capture(report)
    assert c.fidelity.ok and c.fidelity.mismatches == ()
    assert c.outputs is not None and c.graph_outputs is not None
    (leaf,) = ctxreplay.fidelity.verify.flat_tensor_spec(c.graph_outputs).items
    assert leaf.dtype == torch.bfloat16  # type: ignore[union-attr]


def test_execute_level_catches_ambient_replay_that_signature_misses() -> None:
    # Ambient replay: node metadata is right (bfloat16) but the artifact holds
    # no casts, so it runs float32 outside autocast (DESIGN.md fact 2).
    report = _run_under_autocast(Parallel(), ((2, 16),), replay="ambient", verify="execute")
    c = _only_capture(report)
    assert not c.fidelity.ok
    assert c.fidelity.checked == ("signature", "execute")
    assert [m.level for m in c.fidelity.mismatches] == ["execute"]
    (m,) = c.fidelity.mismatches
    assert (m.field, m.live, m.captured) == ("dtype", "bfloat16", "float32")
    assert m.hint is not None and "autocast=cpu:bfloat16" in m.hint
    assert "autocast" not in c.embedded


def test_an_ambient_replay_capture_reproduces_only_where_its_needs_hold() -> None:
    # not ok on its own (above), but run again with its ambient_only states
    # re-established it reproduces the call: what a loaded capture's guard needs
    report = _run_under_autocast(Parallel(), ((2, 16),), replay="ambient", verify="execute")
    c = _only_capture(report)
    assert not c.fidelity.ok and not report.ok
    assert (c.fidelity.ok_with_needs, c.fidelity.status) == (True, "ok_with_needs")
    assert c.fidelity.to_json()["status"] == "ok_with_needs"
    # an embedded capture needed no second run
    embedded = _only_capture(_run_under_autocast(Parallel(), ((2, 16),), verify="execute"))
    assert (embedded.fidelity.ok_with_needs, embedded.fidelity.status) == (None, "ok")


def test_a_capture_traced_without_its_context_fails_even_with_its_needs() -> None:
    # replay="off": the graph was traced in float32, so re-establishing
    # autocast around it cannot make its recorded outputs bfloat16
    report = _run_under_autocast(Parallel(), ((2, 16),), replay="off", verify="execute")
    c = _only_capture(report)
    assert "autocast" in c.ambient_only
    assert (c.fidelity.ok, c.fidelity.ok_with_needs, c.fidelity.status) == (
        False, False, "failed")


def test_execute_level_reports_an_artifact_that_cannot_run_without_autocast() -> None:
    # Blocks fed bfloat16 by the autocast embedding: without the casts the
    # artifact meets float32 weights and fails -- a mismatch, with the hint.
    report = _run_under_autocast(Stack(), ((2, 16),), replay="ambient", verify="execute")
    c = _only_capture(report)
    assert not c.fidelity.ok
    (m,) = c.fidelity.mismatches
    assert (m.level, m.field, m.live) == ("execute", "execution", "ran")
    assert m.hint is not None and "autocast=cpu:bfloat16" in m.hint


def test_execute_level_is_ok_when_embedded() -> None:
    report = _run_under_autocast(Stack(), ((2, 16),), verify="execute")
    c = _only_capture(report)
    assert c.fidelity.ok, c.fidelity
    assert "autocast" in c.embedded


class OnesPlus(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ones(3) + x


class ArangeHalf(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.arange(3) * 0.5 + x


FACTORY_MODULES: dict[str, Callable[[], nn.Module]] = {"ones": OnesPlus,
                                                       "arange": ArangeHalf}


def _capture_under_float64(make: Callable[[], nn.Module], **options: Any
                           ) -> tuple[torch.dtype, ctxreplay.Capture]:
    model = make()
    with ctxreplay.capture_with(model, backend="export", verify="execute",
                                **options) as session, default_dtype(torch.float64):
        live = model(torch.rand(3, dtype=torch.float32)).dtype
    return live, _only_capture(session.finalize())


@pytest.mark.parametrize("name", sorted(FACTORY_MODULES))
def test_default_dtype_without_pinning_is_an_execute_mismatch(name: str) -> None:
    live, c = _capture_under_float64(FACTORY_MODULES[name], pin_factories=False)
    assert live == torch.float64
    assert not c.fidelity.ok
    # the graph metadata was traced under the replayed default: only execution tells
    assert [m.level for m in c.fidelity.mismatches] == ["execute"]
    (m,) = c.fidelity.mismatches
    assert (m.field, m.live, m.captured) == ("dtype", "float64", "float32")
    assert m.hint is not None and "default_dtype=float64" in m.hint
    assert "default_dtype" in c.ambient_only


@pytest.mark.parametrize("name", sorted(FACTORY_MODULES))
def test_default_dtype_with_pinning_is_ok(name: str) -> None:
    live, c = _capture_under_float64(FACTORY_MODULES[name])
    assert live == torch.float64
    assert c.fidelity.ok, c.fidelity
    assert "default_dtype" not in c.ambient_only
    # and the artifact itself, run here under the float32 default, says float64
    assert torch.get_default_dtype() == torch.float32
    out = c.artifact.module()(torch.rand(3))
    assert out.dtype == torch.float64


def test_strict_finalize_lists_every_mismatch() -> None:
    model = Stack()
    with ctxreplay.capture_with(model, targets="repeated", replay="off",
                                verify="signature") as session, \
            torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.rand(2, 16))
        model(torch.rand(3, 5, 16))
    with pytest.raises(ctxreplay.FidelityError) as info:
        session.finalize(strict=True)
    report = info.value.report
    assert len(report.captures) == 2 and not report.ok
    text = str(info.value)
    for c in report.captures:
        assert c.fidelity.mismatches
        for m in c.fidelity.mismatches:
            assert f"{c.scope}#{c.variant}: {m.path} {m.field} live={m.live}" in text
    assert text.count("autocast=cpu:bfloat16") == 2


def test_strict_finalize_passes_a_faithful_capture() -> None:
    model = Stack()
    with ctxreplay.capture_with(model, targets="repeated", verify="execute") as session, \
            torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.rand(2, 16))
    report = session.finalize(strict=True)
    assert report.ok


def test_ambient_only_lists_grad_mode_under_inference_mode() -> None:
    # inference mode cannot be embedded (DESIGN.md fact 13): the artifact
    # does not carry it, and the capture says so
    report = _run_under_autocast(Stack(), ((2, 16),), verify="execute")
    c = _only_capture(report)
    assert "grad_mode" in c.ambient_only
    assert "autocast" not in c.ambient_only


def test_ambient_only_leaves_out_plain_no_grad() -> None:
    model = Stack()
    with ctxreplay.capture_with(model, targets="repeated") as session, torch.no_grad():
        model(torch.rand(2, 16))
    c = _only_capture(session.finalize())
    assert "grad_mode" not in c.ambient_only


# -- the demo's fidelity column and exit code -------------------------------------

def _ambient_instead_of_embedded(monkeypatch: pytest.MonkeyPatch) -> None:
    real = demo_module.capture_with

    def patched(model: nn.Module, **options: Any) -> ctxreplay.CaptureSession:
        if options.get("replay", "embedded") == "embedded":
            options["replay"] = "ambient"
        return real(model, **options)

    monkeypatch.setattr(demo_module, "capture_with", patched)


def test_demo_reports_a_mismatch_and_is_not_ok(monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    _ambient_instead_of_embedded(monkeypatch)
    report, _base, ok = demo_module.run_demo(depth=2, dim=32, explain=False)
    assert not ok and not report.ok
    out = capsys.readouterr().out
    assert "MISMATCH" in out and "SOME CAPTURES DISAGREE" in out


def test_demo_command_exits_non_zero_on_a_mismatch(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    _ambient_instead_of_embedded(monkeypatch)
    assert main(["demo", "--depth", "2"]) == 1
    assert "MISMATCH" in capsys.readouterr().out


def test_demo_fidelity_column_says_ok(capsys: pytest.CaptureFixture[str]) -> None:
    report, base, ok = demo_module.run_demo(depth=2, dim=32, explain=False)
    assert ok and report.ok and len(report.captures) == 2
    assert not base.ok  # the no-replay baseline disagrees
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.startswith("variant"))
    assert "fidelity" in header.split()
    rows = [line for line in lines if line.startswith("blocks.0#")]
    assert len(rows) == 2 and all(" ok " in row for row in rows)
