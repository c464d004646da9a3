"""Explain and failure causes: ``explain`` with a framework's forward
context names the probes that matter and never blames one for state that
``finalize()`` released; a capture failure keeps its cause (type and first
line, never in JSON; the traceback on the "ctxreplay" logger); a probe that
cannot observe is reported by name.

The framework here is the vLLM / FastVideo pattern: a module-level context,
``get_forward_context()`` that raises when none is set, and a
``set_forward_context(ctx)`` context manager.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from metadata_check import assert_metadata_only, check_report
from torch import nn

import ctxreplay
from ctxreplay.report.explain import explain_captures

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

ROOT = Path(__file__).resolve().parents[2]


# -- the framework --------------------------------------------------------------------

@attrs.frozen
class ForwardContext:
    scale: float


_CTX: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    if _CTX is None:
        raise AssertionError("Forward context is not set\n(set it with set_forward_context)")
    return _CTX


def is_forward_context_available() -> bool:
    return _CTX is not None


@contextmanager
def set_forward_context(ctx: ForwardContext) -> Iterator[None]:
    global _CTX
    before = _CTX
    _CTX = ctx
    try:
        yield
    finally:
        _CTX = before


class Block(nn.Module):
    """Reads the framework's context: its scale is a constant of the graph."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x)) * get_forward_context().scale


class SoftBlock(Block):
    """Runs without a context too (``is_forward_context_available()``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = get_forward_context().scale if is_forward_context_available() else 1.0
        return torch.relu(self.lin(x)) * scale


class Net(nn.Module):
    def __init__(self, block: type[Block] = Block) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([block(), block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def _probe() -> ctxreplay.probes.ForwardContextProbe:
    return ctxreplay.probes.ForwardContextProbe(get_forward_context, set_forward_context)


def _session(model: nn.Module, probes: list[Any]) -> ctxreplay.CaptureSession:
    s = ctxreplay.capture_with(model, targets="repeated", probes=probes, backend="export")
    with s, torch.autocast("cpu", dtype=torch.bfloat16), torch.inference_mode(), \
            set_forward_context(ForwardContext(3.0)):
        model(torch.rand(2, 4))
    return s


PROBES = ["autocast", "grad_mode"]
KEY = ("blocks.0", 0)


# -- explain with a forward context ---------------------------------------------------

def test_explain_during_finalize_names_the_context_and_autocast() -> None:
    model = Net().eval()
    report = check_report(_session(model, [*PROBES, _probe()]).finalize(explain=True))
    assert report.ok
    ce = report.explanations[KEY]
    auto = ce["autocast"]
    assert auto.status == "changed" and auto.retyped > 0
    assert (auto.live_outputs, auto.outputs) == (("bfloat16",), ("float32",))
    # without the context the block cannot run at all: the context matters
    fc = ce["forward_context"]
    assert (fc.status, fc.reason) == ("failed", "trace_error")
    assert ce["grad_mode"].status == "no effect"  # inference mode: the same ops
    assert ce.changing == ("autocast", "forward_context")
    # what finalize computed is in the report's JSON
    doc = report.to_json()
    assert_metadata_only(doc)
    stored = {e["probe"]: e["status"] for e in doc["captures"][0]["explain"]}
    assert stored == {"autocast": "changed", "forward_context": "failed",
                      "grad_mode": "no effect"}


def test_explain_after_finalize_blames_no_probe_for_released_state() -> None:
    """What ``report.explain(model)`` computes, without storing it in the
    report (whose JSON the next test checks)."""
    model = Net().eval()
    report = check_report(_session(model, [*PROBES, _probe()]).finalize())
    assert report.options is not None
    explanation = explain_captures(report.captures, model, report.options)
    ce = explanation[KEY]
    for e in ce.effects:  # every probe is non-neutral here
        assert e.status == "unavailable", e
        assert e.reason is not None and e.reason.startswith("replay_released")
    assert ce.changing == ()
    assert "capture fails without it" not in explanation.table()


def test_explain_after_finalize_keeps_the_report_metadata_only() -> None:
    model = Net().eval()
    report = check_report(_session(model, [*PROBES, _probe()]).finalize())
    ce = report.explain(model)[KEY]  # the conftest audit checks the JSON here
    assert {e.status for e in ce.effects} == {"unavailable"}
    check_report(report)


def test_explain_after_finalize_without_live_state_still_explains() -> None:
    """The control: with no live state to release, explain after finalize
    recaptures -- "unavailable" above is about the released context only."""
    model = Net(SoftBlock).eval()
    report = check_report(_session(model, PROBES).finalize())
    ce = report.explain(model)[KEY]
    assert ce["autocast"].status == "changed"
    assert ce["grad_mode"].status == "no effect"


def test_explain_again_keeps_what_finalize_computed() -> None:
    model = Net().eval()
    report = check_report(_session(model, [*PROBES, _probe()]).finalize(explain=True))
    report.explain(model)
    ce = report.explanations[KEY]
    assert ce["autocast"].status == "changed"
    assert ce["forward_context"].status == "failed"


def test_a_context_that_changes_a_graph_constant_is_reported_changed() -> None:
    model = Net(SoftBlock).eval()
    report = check_report(_session(model, [*PROBES, _probe()]).finalize(explain=True))
    assert report.ok
    ce = report.explanations[KEY]
    assert ce["forward_context"].status == "changed"
    assert ce.changing == ("autocast", "forward_context")


# -- failures keep their cause ---------------------------------------------------------

def _forgotten_context(backend: str) -> ctxreplay.CaptureSession:
    """The user forgot the forward-context probe: the live call has a context,
    the capture does not."""
    model = Block()
    s = ctxreplay.capture_with(model, backend=backend)
    with s, set_forward_context(ForwardContext(2.0)):
        model(torch.rand(2, 4))
    return s


BACKENDS = [
    "export", "symbolic", "auto",
]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_failure_keeps_its_cause(backend: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="ctxreplay"):
        report = check_report(_forgotten_context(backend).finalize(),
                              sentinels=["Forward context is not set"])
    (f,) = report.failures
    assert f.exc_type == "AssertionError"
    assert f.message == "Forward context is not set"  # the first line only
    # metadata-only JSON: the type, never the text (the sentinel check above)
    assert report.to_json()["failures"][0]["exc_type"] == "AssertionError"
    # the full traceback is on the "ctxreplay" logger at DEBUG
    logged = [r for r in caplog.records if r.name == "ctxreplay" and r.exc_info]
    assert logged and logged[0].levelno == logging.DEBUG
    text = logging.Formatter().formatException(logged[0].exc_info)  # type: ignore[arg-type]
    assert "Forward context is not set" in text and "Traceback" in text


@pytest.mark.parametrize("backend", BACKENDS)
def test_strict_names_the_cause(backend: str) -> None:
    with pytest.raises(ctxreplay.FidelityError) as info:
        _forgotten_context(backend).finalize(strict=True)
    assert "(AssertionError: Forward context is not set)" in str(info.value)


class Raising:
    """A backend whose exception text is long, or quotes a tensor."""

    name = "raising"

    def __init__(self, text: str) -> None:
        self.text = text

    def capture(self, module: nn.Module, args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> Any:
        raise ValueError(self.text)


def _fail_with(text: str) -> ctxreplay.CaptureFailure:
    model = nn.Linear(4, 4)
    with ctxreplay.capture_with(model, backend=Raising(text)) as s:
        model(torch.rand(2, 4))
    (f,) = check_report(s.finalize(), sentinels=[text[:40]]).failures
    return f


def test_a_failure_message_is_capped_at_200_characters() -> None:
    f = _fail_with("x" * 500 + "\nsecond line")
    assert f.exc_type == "ValueError"
    assert len(f.message) == 200 and f.message.startswith("x" * 150)
    assert "second line" not in f.message


def test_a_failure_message_holds_no_tensor_values() -> None:
    values = torch.tensor([0.123456, 6.54321])
    f = _fail_with(f"bad input {values}")
    assert f.message.startswith("bad input")
    assert "0.1235" not in f.message and "6.5432" not in f.message
    assert "0.1235" in f"bad input {values}"  # the exception's text did quote them


# -- a probe that cannot observe is reported by name -----------------------------------

class CannotObserve(ctxreplay.probes.ContextProbe[str]):
    name = "test_cannot_observe"

    def observe(self) -> str:
        raise KeyError("the probe's own failure")

    def replay(self, state: str) -> AbstractContextManager[None]:
        return nullcontext()


def test_snapshot_names_a_probe_that_cannot_observe() -> None:
    with pytest.raises(ctxreplay.probes.ProbeObservationError) as info:
        ctxreplay.snapshot(["autocast", CannotObserve(), "grad_mode"])
    err = info.value
    assert err.probe == "test_cannot_observe" and err.exc_type == "KeyError"
    assert isinstance(err.__cause__, KeyError)
    assert "test_cannot_observe" in str(err)
    # the control: the same call without it observes
    assert ctxreplay.snapshot(["autocast", "grad_mode"]).names == ("autocast", "grad_mode")


# torch's per-backend precision API cannot be undone: a subprocess
_LEGACY_SCRIPT = r'''
import json, warnings
warnings.filterwarnings("ignore")
from contextlib import nullcontext
import torch
from torch import nn
import ctxreplay

class LegacyPrecision(ctxreplay.probes.ContextProbe):
    """What the matmul probe did before it watched the per-backend settings."""
    name = "legacy_precision"
    def observe(self):
        return torch.get_float32_matmul_precision()
    def replay(self, state):
        return nullcontext()

out = {}
try:
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    out["setting"] = None
except AttributeError as exc:  # a torch without the per-backend API
    out["setting"] = type(exc).__name__
try:
    torch.get_float32_matmul_precision()
    out["torch_raises"] = None
except RuntimeError as exc:
    out["torch_raises"] = type(exc).__name__
out["default_snapshot"] = list(ctxreplay.snapshot().names)
try:
    ctxreplay.snapshot([LegacyPrecision()])
    out["snapshot"] = None
except ctxreplay.probes.ProbeObservationError as exc:
    out["snapshot"] = [type(exc).__name__, exc.probe, exc.exc_type]
except Exception as exc:
    out["snapshot"] = ["bare", type(exc).__name__]
model = nn.Linear(4, 4)
with ctxreplay.capture_with(model, probes=["autocast", LegacyPrecision()]) as s:
    for _ in range(3):
        model(torch.rand(2, 4))
try:
    r = s.finalize(strict=True)
    out["strict"] = {"captures": [c.calls for c in r.captures], "problems": []}
except ctxreplay.FidelityError as exc:
    r = exc.report
    out["strict"] = {"captures": len(r.captures),
                     "problems": [[p.reason, p.calls, list(p.names)] for p in r.problems]}
print(json.dumps(out))
'''


def test_a_probe_torch_makes_raise_is_named_and_counted() -> None:
    """Torch >= 2.9 makes the legacy getter raise once the per-backend
    setting is made.  A torch without that API refuses the setting, and the
    same probe observes and captures as any other."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-c", _LEGACY_SCRIPT], capture_output=True,
                          text=True, timeout=240, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "matmul_precision" in out["default_snapshot"]  # the built-in copes
    if not hasattr(torch._C, "_get_fp32_precision_getter"):
        assert out["setting"] == "AttributeError" and out["torch_raises"] is None
        assert out["snapshot"] is None
        assert out["strict"] == {"captures": [3], "problems": []}
        return
    assert out["setting"] is None
    assert out["torch_raises"] == "RuntimeError"
    assert out["snapshot"] == ["ProbeObservationError", "legacy_precision", "RuntimeError"]
    assert out["strict"] == {"captures": 0, "problems": [
        ["observation_error", 3, ["observe:RuntimeError", "probe legacy_precision"]]]}
