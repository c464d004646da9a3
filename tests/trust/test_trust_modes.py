"""A user's ``TorchFunctionMode`` active during the live call is never
captured away silently: the default set observes the modes' types, so such a
call's capture fails naming the mode and saying how to opt in to replaying
it; opted in, the capture computes what ran; a call without a mode is
captured as before.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

import ctxreplay
from ctxreplay.probes import ModeStackProbe

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


class DoubleLinear(TorchFunctionMode):
    """A framework's mode: every ``F.linear`` returns twice its result."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        return out * 2 if func is F.linear else out


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x)) + 1.0


def _live(probes: Any, *, mode: bool, verify: str = "execute"
          ) -> tuple[ctxreplay.CaptureReport, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model, x = Block().eval(), torch.rand(2, 4)
    with ctxreplay.capture_with(model, probes=probes, backend="export", verify=verify) as s:
        if mode:
            with DoubleLinear():
                live = model(x)
        else:
            live = model(x)
    return s.finalize(), x, live


def test_a_user_mode_makes_the_capture_fail_naming_it() -> None:
    report, _, _ = _live(None, mode=True)
    assert not report.ok and not report.captures
    (failure,) = report.failures
    assert failure.reason == "replay_failed" and failure.exc_type == "ModeNotReplayableError"
    assert failure.context["mode_stack"] == "DoubleLinear (not replayable)"
    assert f"{__name__}.DoubleLinear" in failure.message
    assert "ModeStackProbe(replay_instances=True)" in failure.message  # how to opt in
    assert "DoubleLinear" in json.dumps(report.to_json())   # the type, in the metadata


def test_strict_finalize_raises_naming_the_mode() -> None:
    torch.manual_seed(0)
    model, x = Block().eval(), torch.rand(2, 4)
    with ctxreplay.capture_with(model, backend="export") as s, DoubleLinear():
        model(x)
    with pytest.raises(ctxreplay.FidelityError, match="DoubleLinear"):
        s.finalize(strict=True)


def test_opted_in_the_mode_is_replayed_and_the_capture_computes_what_ran() -> None:
    # the recipe the failure gives: the default set (which holds the
    # types-only mode_stack) with the configured probe taking its place
    defaults = ctxreplay.probes.default_probes()
    assert "mode_stack" in defaults
    probe = ModeStackProbe(replay_instances=True)
    try:
        report, x, live = _live([*defaults, probe], mode=True)
        assert report.ok, report.failures
        (c,) = report.captures
        assert c.snapshot.names == defaults
        assert c.snapshot.probes[c.snapshot.names.index("mode_stack")] is probe
        out = c.artifact.module()(x)     # no mode active now: the artifact carries it
        assert torch.equal(out, live)
        torch.manual_seed(0)
        plain = Block().eval()(x)
        assert not torch.equal(out, plain)                      # the mode mattered
    finally:
        probe.clear()


def test_a_call_without_a_mode_is_captured_as_before() -> None:
    without = [n for n in ctxreplay.probes.default_probes() if n != "mode_stack"]
    before, x, live = _live(without, mode=False)
    now, x2, live2 = _live(None, mode=False)
    assert before.ok and now.ok, (before.failures, now.failures)
    (a,), (b,) = before.captures, now.captures
    probe = b.snapshot.probes[b.snapshot.names.index("mode_stack")]
    state = b.snapshot.states[b.snapshot.names.index("mode_stack")]
    assert probe.neutral(state) and "mode_stack" not in b.ambient_only
    assert (b.variant, b.calls, b.graph_digest, b.ambient_only, b.embedded) == \
        (a.variant, a.calls, a.graph_digest, a.ambient_only, a.embedded)
    assert torch.equal(x, x2) and torch.equal(live, live2)
    assert torch.equal(b.artifact.module()(x), live)


def test_only_the_call_under_the_mode_fails() -> None:
    torch.manual_seed(0)
    model, x = Block().eval(), torch.rand(2, 4)
    with ctxreplay.capture_with(model, backend="export", verify="execute") as s:
        live = model(x)
        with DoubleLinear():
            model(x)
    report = s.finalize()
    assert not report.ok
    (c,) = report.captures
    (failure,) = report.failures
    assert failure.variant != c.variant and "DoubleLinear" in failure.message
    assert torch.equal(c.artifact.module()(x), live)
