"""No silent ok over missing work: ``report.ok`` is False -- and
``finalize(strict=True)`` raises -- whenever some observed call is not
covered by a faithful capture, with a reason code and exact counts.

Each case is paired with the case that must stay ok (the same model with the
missing work put back), so a verdict that is always False cannot pass.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
import torch._dynamo
from metadata_check import finalize_checked
from torch import nn

import ctxreplay
from ctxreplay.backends import ExportBackend

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

ROOT = Path(__file__).resolve().parents[2]


class Block(nn.Module):
    def __init__(self, dim: int = 4, hidden: int = 4) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    """Two blocks of one structure: one scope, two members."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def _reasons(report: ctxreplay.CaptureReport) -> list[str]:
    return [p.reason for p in report.problems]


def _problem(report: ctxreplay.CaptureReport, reason: str) -> ctxreplay.Problem:
    found = [p for p in report.problems if p.reason == reason]
    assert len(found) == 1, report.problems
    return found[0]


def _strict_raises(session: ctxreplay.CaptureSession, reason: str) -> ctxreplay.CaptureReport:
    with pytest.raises(ctxreplay.FidelityError) as info:
        session.finalize(strict=True)
    assert f"{reason}:" in str(info.value)
    assert not info.value.report.ok
    return info.value.report


@pytest.fixture
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# -- torch.compile ------------------------------------------------------------------------

def test_eager_control_is_ok() -> None:
    """The control of the compile cases: the same model, uncompiled."""
    model = Net()
    with ctxreplay.capture_with(model, targets="repeated") as s, torch.no_grad():
        for _ in range(3):
            model(torch.rand(2, 4))
    report = finalize_checked(s, strict=True)
    assert report.ok and report.problems == ()
    assert [c.calls for c in report.captures] == [6]


@pytest.mark.usefixtures("fresh_dynamo")
def test_a_compiled_model_given_to_capture_with_is_observed_captured_and_served() -> None:
    """Compiled (inductor, ``mode="default"``) and run before the session:
    inside it the compiled entry point runs uncompiled, so both blocks are
    observed and captured and the report is ok (strict), with a notice
    naming it; after it, the compiled code is back.  Installed, the compiled
    model gives eager's outputs, and its uncompiled module dispatches every
    block call to the captures."""
    torch.manual_seed(0)
    model = Net().eval()
    x = torch.rand(2, 4)
    with torch.no_grad():
        expected = model(x)
    compiled = torch.compile(model, mode="default")
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), expected)
    compiled_forward = compiled.__dict__["forward"]
    with ctxreplay.capture_with(compiled, targets="repeated") as s, torch.no_grad():
        for _ in range(3):
            assert torch.equal(compiled(x), expected)  # run uncompiled: bit-equal
    assert compiled.__dict__["forward"] is compiled_forward
    report = finalize_checked(s, strict=True)
    assert report.ok and report.problems == ()
    assert [c.member_calls for c in report.captures] == [
        (("_orig_mod.blocks.0", 3), ("_orig_mod.blocks.1", 3))]
    (notice,) = report.notices
    assert (notice.reason, notice.count, notice.names) == \
        ("compiled_ran_uncompiled", 3, ("OptimizedModule",))
    installed = ctxreplay.install(compiled, report)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), expected)
        assert torch.equal(compiled._orig_mod(x), expected)
    assert sum(installed.stats().hits.values()) == 2


class SkipLayers(nn.Module):
    """Each block called inside a ``torch.cond`` branch: a skip-layer pattern."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(4, 4) for _ in range(2))

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = torch.cond(skip, lambda t: t.clone(), lambda t, b=b: b(t), (x,))
        return x


@pytest.mark.usefixtures("fresh_dynamo")
def test_blocks_inside_torch_cond_leave_the_forward_working_and_are_refused_naming_it() -> None:
    # Dynamo traces cond's branches, and refuses a store into an outer object
    # there ("Non-nullified side effect"): observation stored a flag, and the
    # user's forward raised under capture_with
    torch.manual_seed(0)
    model = SkipLayers().eval()
    x = torch.rand(2, 4)
    with torch.no_grad():
        expected = [model(x, torch.tensor(i == 1)) for i in range(3)]
    with ctxreplay.capture_with(model, targets="repeated") as s, torch.no_grad():
        got = [model(x, torch.tensor(i == 1)) for i in range(3)]
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    report = finalize_checked(s)
    assert not report.ok and report.captures == ()
    p = _problem(report, "control_flow")  # named as such, not as a compiled region
    assert p.names == ("torch.cond", "blocks.0", "blocks.1")
    assert "blocks.0, blocks.1 ran inside a torch.cond branch" in p.message
    assert [q.reason for q in report.problems] == ["control_flow"]


@pytest.mark.usefixtures("fresh_dynamo")
def test_blocks_inside_torch_cond_in_code_compiled_during_the_session_name_torch_cond() -> None:
    """Compiled while observed, with each block in a cond branch: Dynamo traces
    the branch through its own cond variable, and the problem still names
    ``torch.cond`` (the control: the same compiled model without cond is a
    plain ``not_observed``)."""
    torch.manual_seed(0)
    for model, reason, names in ((SkipLayers().eval(), "control_flow",
                                  ("torch.cond", "blocks.0", "blocks.1")),
                                 (Net().eval(), "not_observed", ("blocks.0", "blocks.1"))):
        torch._dynamo.reset()
        x = torch.rand(2, 4)
        args = (x, torch.tensor(False)) if isinstance(model, SkipLayers) else (x,)
        with torch.no_grad():
            expected = model(*args)
        with ctxreplay.capture_with(model, targets="repeated") as s, torch.no_grad():
            assert torch.equal(torch.compile(model, backend="eager")(*args), expected)
        report = finalize_checked(s)
        assert [(p.reason, p.names) for p in report.problems] == [(reason, names)]


def _skipping(model: nn.Module, x: torch.Tensor, skip: bool) -> torch.Tensor:
    """The whole model as one ``torch.cond`` branch."""
    return torch.cond(torch.tensor(skip), lambda t: t.clone(), lambda t: model(t), (x,))


@pytest.mark.usefixtures("fresh_dynamo")
def test_a_model_observed_whole_inside_torch_cond_keeps_its_forward() -> None:
    # the wrapper of the model passed to capture_with is traced inside the
    # branch too: on torch 2.7 reading what it wraps raised there
    torch.manual_seed(0)
    model = Net().eval()
    x = torch.rand(2, 4)
    with torch.no_grad():
        expected = [_skipping(model, x, i == 1) for i in range(3)]
    with ctxreplay.capture_with(model, targets="repeated") as s, torch.no_grad():
        got = [_skipping(model, x, i == 1) for i in range(3)]
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    report = finalize_checked(s)
    assert not report.ok and report.captures == ()
    assert _problem(report, "control_flow").names == ("torch.cond", "blocks.0", "blocks.1")


@pytest.mark.usefixtures("fresh_dynamo")
def test_installed_blocks_inside_torch_cond_run_their_own_forward() -> None:
    # captured from direct block calls; installed, the model then calls them
    # inside cond's branches, where Dynamo traces the dispatch wrapper: the
    # branch runs each block's own forward (no graph of ours is traced into
    # it), and the outputs are eager's
    torch.manual_seed(0)
    model = SkipLayers().eval()
    x = torch.rand(2, 4)
    with ctxreplay.capture_with(model, targets="repeated") as s, torch.no_grad():
        for b in model.blocks:
            b(x)
    report = finalize_checked(s, strict=True)
    assert [c.calls for c in report.captures] == [2]
    with torch.no_grad():
        expected = [model(x, torch.tensor(i == 1)) for i in range(3)]
    with ctxreplay.install(model, report) as handle, torch.no_grad():
        got = [model(x, torch.tensor(i == 1)) for i in range(3)]
        direct = model.blocks[0](x)  # called outside cond: the graph serves it
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    with torch.no_grad():
        assert torch.equal(direct, model.blocks[0](x))
    assert handle.stats().hits == {"blocks.0#0": 1}


@pytest.mark.usefixtures("fresh_dynamo")
def test_a_block_compiled_before_the_session_is_observed_with_the_others() -> None:
    """Only block 0 compiled (``Module.compile()``): it runs uncompiled while
    observed, so both blocks are one capture and the report is ok; a notice
    names the compiled block, and it is compiled again afterwards."""
    model = Net()
    model.blocks[0].compile(backend="eager")
    compiled_call = model.blocks[0].__dict__["_compiled_call_impl"]
    with ctxreplay.capture_with(model, targets="repeated") as s, torch.no_grad():
        for _ in range(3):
            model(torch.rand(2, 4))
    report = finalize_checked(s, strict=True)
    assert [c.member_calls for c in report.captures] == [(("blocks.0", 3), ("blocks.1", 3))]
    assert report.ok
    (notice,) = report.notices
    assert (notice.reason, notice.count, notice.names) == \
        ("compiled_ran_uncompiled", 3, ("blocks.0",))
    assert model.blocks[0].__dict__["_compiled_call_impl"] is compiled_call


@pytest.mark.usefixtures("fresh_dynamo")
def test_a_model_compiled_inside_the_session_with_only_compiled_calls_is_not_ok() -> None:
    model = Net()
    with ctxreplay.capture_with(model, targets="repeated") as s, torch.no_grad():
        compiled = torch.compile(model, backend="eager")
        compiled(torch.rand(2, 4))
        compiled(torch.rand(2, 4))
    report = finalize_checked(s)
    assert not report.ok and report.captures == ()


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("eager_calls", [0, 1])
def test_a_model_compiled_inside_the_session_counts_its_compiled_calls(
        eager_calls: int) -> None:
    model = Net()
    with ctxreplay.capture_with(model, targets="repeated") as s, torch.no_grad():
        for _ in range(eager_calls):
            model(torch.rand(2, 4))
        compiled = torch.compile(model, backend="eager")
        compiled(torch.rand(2, 4))
        compiled(torch.rand(2, 4))
    report = finalize_checked(s)
    assert not report.ok
    # compiled after capture_with: that the blocks ran compiled is known, how
    # often is not (a count read inside the compiled code would make Dynamo
    # recompile on every call)
    p = _problem(report, "not_observed")
    assert not p.exact and p.names == ("blocks.0", "blocks.1")
    assert "not countable" in p.message
    assert "capture_with(torch.compile(model))" in p.message  # the call to use instead


def test_the_compile_recipe_describes_what_the_engine_does() -> None:
    text = (ROOT / "docs" / "recipes.md").read_text(encoding="utf-8")
    section = text.split("## torch.compile users", 1)[1].split("\n## ", 1)[0]
    assert "graph-break" not in section
    assert "not_observed" in section


# -- max_variants ---------------------------------------------------------------------

class Wide(Block):
    def __init__(self) -> None:
        super().__init__(4, 8)


class TwoScopes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = Block()
        self.b = Wide()


def _many_shapes(max_variants: int) -> ctxreplay.CaptureSession:
    model = TwoScopes()
    s = ctxreplay.capture_with(model, targets=["a", "b"], max_variants=max_variants,
                               backend="symbolic")
    with s, torch.no_grad():
        for n in range(1, 43):  # 42 shapes, each called twice
            model.a(torch.rand(n, 4))
            model.a(torch.rand(n, 4))
        for n in range(1, 11):  # 10 shapes, once each
            model.b(torch.rand(n, 4))
    return s


def test_variants_past_max_variants_are_counted_exactly_per_scope() -> None:
    report = finalize_checked(_many_shapes(8))
    assert len(report.captures) == 16
    assert not report.ok
    a, b = report.problems
    assert (a.reason, a.scope, a.variants, a.calls, a.exact, a.limit) == (
        "variant_limit", "a", 34, 68, True, 8)
    assert (b.reason, b.scope, b.variants, b.calls, b.exact, b.limit) == (
        "variant_limit", "b", 2, 2, True, 8)
    # the totals count variants (not scopes that dropped some) and calls
    assert report.dropped == {"variants": 36, "variant_calls": 70, "scopes": 0}
    assert sum(c.calls for c in report.captures) == 8 * 2 + 8
    assert "34 variants (68 calls) past max_variants=8" in a.message


def test_variants_past_max_variants_fail_strict_and_enough_room_is_ok() -> None:
    _strict_raises(_many_shapes(8), "variant_limit")
    report = finalize_checked(_many_shapes(64), strict=True)
    assert report.ok and len(report.captures) == 52 and report.dropped["variants"] == 0


# -- sessions with nothing to show ------------------------------------------------------

class NeverBackend:
    name = "never"

    def capture(self, module: nn.Module, args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> Any:
        raise RuntimeError("this backend captures nothing")


def test_a_session_that_saw_calls_but_captured_nothing() -> None:
    model = Block()
    with ctxreplay.capture_with(model, backend=NeverBackend()) as s:
        model(torch.rand(2, 4))
        model(torch.rand(2, 4))
        model(torch.rand(3, 4))
    report = finalize_checked(s)
    assert report.captures == () and not report.ok
    assert [(f.variant, f.reason) for f in report.failures] == [(0, "trace_error"),
                                                               (1, "trace_error")]
    p = _problem(report, "no_captures")
    assert (p.variants, p.calls) == (2, 3)


def test_a_session_that_captured_nothing_fails_strict() -> None:
    model = Block()
    with ctxreplay.capture_with(model, backend=NeverBackend()) as s:
        model(torch.rand(2, 4))
    _strict_raises(s, "no_captures")


def test_finalize_with_no_forward_is_not_ok() -> None:
    s = ctxreplay.capture_with(Block())
    report = finalize_checked(s)
    assert not report.ok and _reasons(report) == ["nothing_observed"]
    _strict_raises(ctxreplay.capture_with(Block()), "nothing_observed")


def test_forwards_run_only_after_close_are_not_ok() -> None:
    model = Block()
    s = ctxreplay.capture_with(model)
    s.close()
    model(torch.rand(2, 4))
    report = finalize_checked(s)
    assert not report.ok and _reasons(report) == ["nothing_observed"]
    assert report.captures == ()
    s = ctxreplay.capture_with(model)
    s.close()
    model(torch.rand(2, 4))
    _strict_raises(s, "nothing_observed")


def test_a_second_finalize_after_more_calls_is_a_clear_error() -> None:
    model = Block()
    s = ctxreplay.capture_with(model)
    model(torch.rand(2, 4))
    first = finalize_checked(s)
    assert first.ok and [c.calls for c in first.captures] == [1]
    model(torch.rand(3, 4))  # after finalize: never observed
    with pytest.raises(ctxreplay.SessionError, match=r"session\.report"):
        s.finalize()
    with pytest.raises(ctxreplay.SessionError):
        s.finalize(strict=True)
    # the first report is not changed behind the caller's back either
    assert s.report is first and [c.calls for c in first.captures] == [1]
    assert "forward" not in model.__dict__


# -- live calls that raised ---------------------------------------------------------------

_RAISE = {"left": 0}


class Flaky(nn.Module):
    """Raises while ``_RAISE["left"]`` is positive (module-level, so the
    block's identity does not change)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _RAISE["left"] > 0:
            _RAISE["left"] -= 1
            raise ValueError("the live call failed")
        out: torch.Tensor = self.lin(x)
        return out


@contextlib.contextmanager
def _raising(n: int) -> Iterator[None]:
    _RAISE["left"] = n
    try:
        yield
    finally:
        _RAISE["left"] = 0


def test_a_variant_whose_first_call_raised_is_verified_by_a_later_call() -> None:
    model = Flaky()
    x = torch.rand(2, 4)
    with ctxreplay.capture_with(model, verify="execute") as s:
        with _raising(1), pytest.raises(ValueError):
            model(x)
        model(x)
        model(x)
    report = finalize_checked(s, strict=True)
    (c,) = report.captures
    assert c.outputs is not None and c.calls == 2  # the call that raised is not one
    assert c.fidelity.checked == ("signature", "execute") and c.fidelity.ok
    assert report.failures == () and report.problems == () and report.ok


class RaisesOnPairs(nn.Module):
    """Every call with a batch of two raises -- live and when traced."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 2:
            raise ValueError("a batch of two is refused")
        out: torch.Tensor = self.lin(x)
        return out


def _pairs_raise() -> ctxreplay.CaptureSession:
    model = RaisesOnPairs()
    with ctxreplay.capture_with(model) as s:
        for _ in range(3):
            with pytest.raises(ValueError):
                model(torch.rand(2, 4))
        model(torch.rand(5, 4))  # another variant completes and is captured
    return s


def test_a_variant_that_only_raised_is_no_variant_but_a_notice() -> None:
    # a call that raised in the user's forward (the caller handled it) was
    # never a call to reproduce: no variant, no problem, a notice per member
    report = finalize_checked(_pairs_raise(), strict=True)
    assert report.ok and report.problems == () and report.failures == ()
    assert [tuple(c.signature.args[0].shape) for c in report.captures] == [  # type: ignore[union-attr]
        (5, 4)]
    assert report.captures[0].fidelity.ok and report.captures[0].calls == 1
    (n,) = [n for n in report.notices if n.reason == "call_raised"]
    assert (n.scope, n.count, n.names) == ("RaisesOnPairs", 3, ("RaisesOnPairs",))


# -- a forward context over a denoising loop --------------------------------------------

_CTX: list[Any] = []


@attrs.frozen
class StepContext:
    scale: float
    step: int
    repeats: int = 1


def get_forward_context() -> Any:
    if not _CTX:
        raise AssertionError("Forward context is not set")
    return _CTX[-1]


@contextlib.contextmanager
def set_forward_context(ctx: Any) -> Iterator[None]:
    _CTX.append(ctx)
    try:
        yield
    finally:
        _CTX.pop()


class Denoiser(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        for _ in range(ctx.repeats):
            x = self.lin(x) * ctx.scale
        return x


def _loop(steps: int, make: Any, **probe_kw: Any) -> ctxreplay.CaptureSession:
    model = Denoiser().eval()
    probe = ctxreplay.probes.ForwardContextProbe(get_forward_context, set_forward_context,
                                          **probe_kw)
    s = ctxreplay.capture_with(model, probes=["autocast", "grad_mode", probe],
                               backend="export")
    with s, torch.no_grad():
        for step in range(steps):
            with set_forward_context(make(step)):
                model(torch.rand(2, 4))
    return s


def test_a_forward_context_without_a_key_over_a_denoising_loop() -> None:
    report = finalize_checked(_loop(12, lambda step: StepContext(2.0, step)))
    assert len(report.captures) == 8 and len({c.fingerprint for c in report.captures}) == 1
    assert not report.ok
    p = _problem(report, "variant_limit")
    assert (p.variants, p.calls, p.exact) == (4, 4, True)
    (n,) = report.notices
    assert (n.reason, n.probe, n.count) == ("probe_too_fine", "forward_context", 8)
    assert "forward_context" in n.message
    _strict_raises(_loop(12, lambda step: StepContext(2.0, step)), "variant_limit")


def test_a_forward_context_with_a_coarse_key_is_one_ok_capture() -> None:
    report = finalize_checked(_loop(12, lambda step: StepContext(2.0, step),
                                    key=lambda ctx: ctx.scale), strict=True)
    assert report.ok and report.notices == ()
    assert [c.calls for c in report.captures] == [12]


def test_a_probe_state_that_differs_in_every_call_is_noticed() -> None:
    """Five steps, five graphs (the context sets how often the layer runs):
    nothing is dropped, but the state differs in every variant."""
    report = finalize_checked(_loop(5, lambda step: StepContext(2.0, step, step + 1)),
                              strict=True)
    assert report.ok and len(report.captures) == 5
    assert [(n.reason, n.probe, n.count) for n in report.notices] == [
        ("probe_varies_every_call", "forward_context", 5)]
    # the control: one context object for every call is one variant, no notice
    ctx = StepContext(2.0, 0, 2)
    same = finalize_checked(_loop(5, lambda step: ctx))
    assert same.ok and same.notices == () and [c.calls for c in same.captures] == [5]


def test_a_per_step_scale_is_not_called_too_fine() -> None:
    report = finalize_checked(_loop(6, lambda step: StepContext(1.0 + step, step)),
                              strict=True)
    assert len(report.captures) == 6
    assert [(n.reason, n.probe) for n in report.notices] == [
        ("probe_varies_every_call", "forward_context")]


# -- an interrupted finalize -------------------------------------------------------------

class InterruptOnBatch3(ExportBackend):
    name = "interrupting"

    def capture(self, module: nn.Module, args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> Any:
        if args[0].shape[0] == 3:
            raise KeyboardInterrupt
        return super().capture(module, args, kwargs)


def _interrupted() -> ctxreplay.CaptureSession:
    model = Block()
    s = ctxreplay.capture_with(model, backend=InterruptOnBatch3())
    with s:
        for n in (2, 3, 5):
            model(torch.rand(n, 4))
    with pytest.raises(KeyboardInterrupt):
        s.finalize()
    assert s.report is None
    return s


def test_after_an_interrupted_finalize_the_captures_made_are_kept() -> None:
    report = finalize_checked(_interrupted())
    assert [(c.variant, c.calls) for c in report.captures] == [(0, 1)]
    assert report.captures[0].fidelity.ok
    assert [(f.variant, f.reason) for f in report.failures] == [(1, "interrupted"),
                                                               (2, "interrupted")]
    assert not report.ok


def test_after_an_interrupted_finalize_strict_raises_and_a_third_is_an_error() -> None:
    s = _interrupted()
    with pytest.raises(ctxreplay.FidelityError, match="interrupted") as info:
        s.finalize(strict=True)
    assert [c.variant for c in info.value.report.captures] == [0]
    assert "module_released" not in str(info.value)
    with pytest.raises(ctxreplay.SessionError):
        s.finalize()


# -- torch >= 2.9's per-backend fp32_precision (in a subprocess: it cannot be undone) ----

HAS_API = hasattr(torch._C, "_get_fp32_precision_getter")

# One interpreter: first the neutral control, then the settings (which
# no torch API can undo, hence the subprocess).  A torch without the
# per-backend API refuses its settings; the same run is made there with the
# legacy ones, which is all a user of that torch can set.
_FP32_SCRIPT = r'''
import json, warnings
warnings.filterwarnings("ignore")
import torch
from torch import nn
import ctxreplay

b = torch.backends
HAS_API = hasattr(torch._C, "_get_fp32_precision_getter")

def view():
    if not HAS_API:
        return {"precision": torch.get_float32_matmul_precision(),
                "cudnn_tf32": b.cudnn.allow_tf32}
    return {"cuda.matmul": b.cuda.matmul.fp32_precision,
            "mkldnn.matmul": b.mkldnn.matmul.fp32_precision,
            "cudnn.conv": b.cudnn.conv.fp32_precision}

def other_state(live):
    if not HAS_API:
        torch.set_float32_matmul_precision("high" if live["precision"] != "high" else "highest")
        b.cudnn.allow_tf32 = not live["cudnn_tf32"]
        return
    b.cuda.matmul.fp32_precision = "ieee"
    b.mkldnn.matmul.fp32_precision = "ieee"
    b.cudnn.conv.fp32_precision = "tf32" if live["cudnn.conv"] != "tf32" else "ieee"

def set_state():
    if not HAS_API:
        torch.set_float32_matmul_precision("medium")
        b.cudnn.allow_tf32 = False
        return
    b.cuda.matmul.fp32_precision = "tf32"
    b.mkldnn.matmul.fp32_precision = "tf32"
    b.cudnn.conv.fp32_precision = "ieee"

def refused():
    """What torch says to the per-backend setting: the exception's name."""
    try:
        b.cuda.matmul.fp32_precision = b.cuda.matmul.fp32_precision
    except AttributeError as exc:
        return type(exc).__name__
    return None

def legacy_getter():
    try:
        torch.get_float32_matmul_precision()
        return "ok"
    except RuntimeError:
        return "raises"

def run():
    out = {"live": view(), "legacy_getter": legacy_getter()}
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    # dynamo, which "auto" falls back to here anyway: in the set state
    # torch.export raises (cudnn.set_flags reads a TF32 flag the mixed state
    # cannot answer) after it has turned oneDNN off, and leaves it off -- a
    # torch leak the numerics probe sees (a state_leak failure)
    with ctxreplay.capture_with(model, verify="execute", backend="dynamo") as s:
        model(torch.rand(2, 4))
        model(torch.rand(2, 4))
    report = s.finalize(strict=True)  # raises FidelityError when not ok
    out["ok"] = report.ok
    out["problems"] = [p.reason for p in report.problems]
    out["errors"] = [list(e) for e in report.observation_errors]
    out["calls"] = [c.calls for c in report.captures]
    snap = report.captures[0].snapshot
    # elsewhere: another per-backend state, then the capture's replay
    live = view()
    other_state(live)
    out["other"] = other = view()
    with snap.replay():
        out["replayed"] = view()
    out["restored"] = view() == other
    doc = json.loads(json.dumps(snap.to_json()))
    out["recorded"] = '"fp32_precision"' in json.dumps(doc)
    with ctxreplay.ContextSnapshot.from_json(doc).replay():
        out["replayed_from_json"] = view()
    return out

out = {"refused": refused()}
out["neutral"] = run()
set_state()
out["set"] = run()
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def fp32_runs() -> dict[str, Any]:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-c", _FP32_SCRIPT], capture_output=True,
                          text=True, timeout=240, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def _reproduced(out: dict[str, Any]) -> None:
    assert out["ok"] is True and out["problems"] == [] and out["errors"] == []
    assert out["calls"] == [2]
    assert out["other"] != out["live"]  # a replay that did nothing would not pass
    assert out["replayed"] == out["live"]
    assert out["replayed_from_json"] == out["live"]
    assert out["restored"] is True
    # the snapshot records per-backend values exactly where torch has them
    assert out["recorded"] is HAS_API


def test_a_session_with_the_per_backend_precision_api_set_captures_and_replays_it(
        fp32_runs: dict[str, Any]) -> None:
    out = fp32_runs["set"]
    if not HAS_API:
        # torch refuses the setting; the legacy ones it has are captured
        # and replayed, and its legacy getter never raises
        assert fp32_runs["refused"] == "AttributeError"
        assert out["legacy_getter"] == "ok"
        assert out["live"] == {"precision": "medium", "cudnn_tf32": False}
        _reproduced(out)
        return
    assert fp32_runs["refused"] is None
    # the state of the issue: torch's own legacy getter raises in it
    assert out["legacy_getter"] == "raises"
    assert out["live"] == {"cuda.matmul": "tf32", "mkldnn.matmul": "tf32",
                           "cudnn.conv": "ieee"}
    _reproduced(out)


def test_the_neutral_control_of_the_per_backend_precision_run(
        fp32_runs: dict[str, Any]) -> None:
    """The legacy getter raises only because of the settings, and the replay
    of the settings' run differs from the neutral one."""
    out = fp32_runs["neutral"]
    assert out["legacy_getter"] == "ok"
    _reproduced(out)
    assert out["live"] != fp32_runs["set"]["live"]


# -- torch.func transforms -------------------------------------------------------------

def _vmapped(model: nn.Module, xs: torch.Tensor) -> torch.Tensor:
    params = dict(model.named_parameters())
    return torch.func.vmap(lambda x: torch.func.functional_call(model, params, (x,)))(xs)


def test_block_calls_under_vmap_are_counted_as_not_observed() -> None:
    # before, observation stepped aside as for a tracer's call: the report
    # said nothing_observed, with no word of the 2 block calls that ran
    model = Net()
    with ctxreplay.capture_with(model, targets="repeated") as s, torch.no_grad():
        _vmapped(model, torch.rand(5, 2, 4))
    report = finalize_checked(s)
    assert not report.ok and report.captures == ()
    p = _problem(report, "transformed")
    assert (p.calls, p.names) == (2, ("blocks.0", "blocks.1"))
    assert [q.reason for q in report.problems] == ["transformed"]


def test_an_installed_model_under_vmap_counts_each_block_call_as_a_miss() -> None:
    torch.manual_seed(0)
    model = Net()
    with ctxreplay.capture_with(model, targets="repeated") as s, torch.no_grad():
        model(torch.rand(2, 4))
    report = finalize_checked(s)
    assert report.ok
    xs = torch.rand(5, 2, 4)
    with torch.no_grad():
        expected = _vmapped(model, xs)
    handle = ctxreplay.install(model, report)
    try:
        with torch.no_grad():
            got = _vmapped(model, xs)
        stats = handle.stats()
    finally:
        handle.remove()
    assert torch.equal(got, expected)
    assert sum(stats.hits.values()) == 0
    assert stats.misses == {"blocks.0": 1, "blocks.1": 1}
    assert dict(stats.reasons) == {"transformed": 2}
