"""On disk and in the check: a saved file is held to the live calls
it stands for, and a block ``torch.export`` captures is verified, not failed
by the check's own runs.

* A tiny ``transformers`` T5 (``use_cache=False``, ``targets="repeated"``):
  every saved file, loaded back with ``torch.export.load`` as a consumer
  would, runs each live call of its member (recorded by the test's own
  hooks) and returns the live outputs.  The negative control writes the
  lowering torch gives without ctxreplay's view relaxation: the file fails
  on the live inputs (the oracle shows it) and ``saved.fidelity`` says so.
* The saved check's inputs carry the live strides (a channels-last input).
* CogVideoX with diffusers' Pyramid Attention Broadcast: ``verify="execute"``
  captures every variant (it failed with ``GuardOnDataDependentSymNode``
  when the check's reference run reached the user's hook state through a
  closure), ``finalize()`` leaves that state as it was, and each capture
  reproduces its member's first live call.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from torch import nn
from trust_oracle import Call, candidates, differs, record

import ctxreplay
from ctxreplay.artifacts.pt2 import Pt2Format
from ctxreplay.artifacts.saving import artifact_inputs
from ctxreplay.backends import passes

pytestmark = [pytest.mark.models,
              pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning")]

T5_BLOCKS = ["encoder.block.0", "encoder.block.1", "decoder.block.0", "decoder.block.1"]


def _t5() -> tuple[ctxreplay.CaptureReport, list[Call]]:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        feed_forward_proj="gated-gelu", decoder_start_token_id=0, pad_token_id=0)
    model = transformers.T5Model(config).eval()
    with record(model, T5_BLOCKS) as calls, \
            ctxreplay.capture_with(model, targets="repeated") as session, torch.no_grad():
        for enc, dec in [(10, 6), (7, 3)]:
            model(input_ids=torch.randint(0, 64, (1, enc)),
                  decoder_input_ids=torch.randint(0, 64, (1, dec)), use_cache=False)
    return session.finalize(), calls


def _file_failure(path: Path, capture: ctxreplay.Capture, call: Call) -> str | None:
    """The saved file, loaded fresh, on the call's real inputs, run as a consumer
    would: from torch's defaults plus only the states the capture says must
    surround it (``ambient_only``), and inside the live call's own context
    (where ``install`` runs it).  ``None`` when both return the live outputs.
    The two differ in which kernel a composite op picks: on CPU,
    ``scaled_dot_product_attention`` runs its flash kernel under ``no_grad``
    and its math kernel (another output layout) with grad enabled."""
    keep = set(capture.ambient_only)
    snap = capture.snapshot
    consumer = snap.without(*[n for n in snap.names if n not in keep])
    try:
        program = torch.export.load(path).module()
        assert capture.weights_from == call.member  # the file holds this member's weights
        outs = []
        for context in (consumer, call.snapshot):
            args, kwargs = call.fresh_inputs()
            with context.replay():
                outs.append(program(*args, **kwargs))
    except Exception as exc:
        return f"raised {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    for out in outs:
        why = differs(call.out, tuple(t.detach() for t in out if isinstance(t, torch.Tensor)))
        if why is not None:
            return why
    return None


def _saved_against_oracle(report: ctxreplay.CaptureReport, calls: list[Call], root: Path,
                          *, lowered: bool) -> list[tuple[str, bool, str | None]]:
    """``(call, saved.fidelity.ok, what the oracle found)`` for every live call."""
    out = []
    for i, call in enumerate(calls):
        found = candidates(report, call)
        assert len(found) == 1, (call.member, [(c.scope, c.variant) for c in found])
        capture = found[0]
        assert capture.binding == "native"  # the file takes the block's own arguments
        path = root / f"{i}.pt2"
        saved = capture.save(path)
        assert saved.lowered == (lowered and passes.has_wrapper_hops(
            capture.artifact.graph_module))
        out.append((f"call {i} of {call.member}", saved.fidelity.ok,
                    _file_failure(path, capture, call)))
    return out


def _refuse_wrappers(monkeypatch: pytest.MonkeyPatch) -> None:
    """A serialiser that refuses context wrappers (torch before 2.6 did): the
    file then holds the program lowered to explicit casts."""
    real = Pt2Format.save

    def save(self: Pt2Format, artifact: Any, path: Path) -> None:
        if passes.has_wrapper_hops(artifact.graph_module):
            raise RuntimeError("wrapper higher-order ops are not serialisable here")
        real(self, artifact, path)

    monkeypatch.setattr(Pt2Format, "save", save)


@pytest.mark.parametrize("form", ["as_captured", "lowered"])
def test_t5_saved_files_run_the_live_calls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           form: str) -> None:
    if form == "lowered":
        _refuse_wrappers(monkeypatch)
    report, calls = _t5()
    assert report.ok and len(calls) == 8
    results = _saved_against_oracle(report, calls, tmp_path, lowered=form == "lowered")
    assert [(name, why) for name, _, why in results if why is not None] == []
    assert all(ok for _, ok, _ in results)


def test_a_saved_file_that_fails_the_live_call_is_not_ok(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _refuse_wrappers(monkeypatch)
    # the lowering as torch gives it: views chosen from the fake strides of
    # scaled_dot_product_attention, which its CPU kernel does not return
    monkeypatch.setattr(passes, "relax_views", lambda gm: 0)
    report, calls = _t5()
    results = _saved_against_oracle(report, calls, tmp_path, lowered=True)
    failing = [(name, ok) for name, ok, why in results if why is not None]
    assert failing, "the unrelaxed lowering ran every live call: the control shows nothing"
    assert any("view size is not compatible" in (why or "") for _, _, why in results)
    assert [name for name, ok in failing if ok] == []  # never saved as ok
    manifest = report.save_all(tmp_path / "all")
    assert not manifest.ok


class _ChannelsLast(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x) * 2  # keeps its input's memory format


def test_the_saved_check_runs_on_the_live_strides(tmp_path: Path) -> None:
    model = _ChannelsLast().eval()
    x = torch.rand(2, 3, 5, 5).to(memory_format=torch.channels_last)
    with ctxreplay.capture_with(model) as session, torch.no_grad():
        live = model(x)
    report = session.finalize()
    (capture,) = report.captures
    args, _ = artifact_inputs(capture)
    assert args[0].stride() == x.stride() != torch.rand(2, 3, 5, 5).stride()
    saved = capture.save(tmp_path / "c.pt2")
    assert saved.fidelity.ok, saved.fidelity.mismatches
    with torch.no_grad():  # the oracle: the file on the live input, strides included
        out = torch.export.load(saved.path).module()(x)
    assert out.stride() == live.stride() and torch.allclose(out, live)


# -- CogVideoX with Pyramid Attention Broadcast -------------------------------------

def _pab_states(model: nn.Module) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Each broadcast hook's iteration and the identity of its cached tensors."""
    out = {}
    for name, sub in model.named_modules():
        registry = getattr(sub, "_diffusers_hook", None)
        for hook in getattr(registry, "hooks", {}).values():
            state = getattr(hook, "state", None)
            if state is None:
                continue
            cache = state.cache if isinstance(state.cache, tuple) else (state.cache,)
            assert all(type(t) is torch.Tensor for t in cache), [type(t) for t in cache]
            out[name] = (state.iteration, tuple(id(t) for t in cache))
    return out


def test_pyramid_attention_broadcast_is_captured_beneath_its_hooks_and_verified() -> None:
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    model = diffusers.CogVideoXTransformer3DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
        time_embed_dim=16, text_embed_dim=16, num_layers=2, sample_width=8, sample_height=8,
        sample_frames=9, patch_size=2, temporal_compression_ratio=4,
        max_text_seq_length=4).eval()
    step = {"t": 0}
    diffusers.apply_pyramid_attention_broadcast(model, diffusers.PyramidAttentionBroadcastConfig(
        spatial_attention_block_skip_range=2, spatial_attention_timestep_skip_range=(100, 800),
        current_timestep_callback=lambda: step["t"]))
    x, text = torch.randn(1, 3, 4, 8, 8), torch.randn(1, 4, 16)
    blocks = ["transformer_blocks.0", "transformer_blocks.1"]
    hooked = [f"{b}.attn1" for b in blocks]
    with record(model, hooked) as calls, \
            ctxreplay.capture_with(model, targets="repeated", verify="execute") as session, \
            torch.no_grad():
        for t in (700, 600):
            step["t"] = t
            model(hidden_states=x, encoder_hidden_states=text, timestep=torch.tensor([t]))
    before = _pab_states(model)
    assert len(before) == 2
    report = session.finalize()
    assert [(f.scope, f.reason, f.exc_type) for f in report.failures] == []
    # the hook reuses its stored attention output on every second step:
    # captured whole, a block's graph would freeze that decision.  The hooked
    # attention modules are captured beneath the hook instead (the hook stays
    # Python), and the rest of each block runs eagerly
    assert report.ok, report.summary
    assert sorted({m for c in report.captures for m in c.members}) == hooked
    assert [n.names for n in report.notices if n.reason == "step_cache_inside"] == [
        tuple(f"{b}: {b}.attn1" for b in blocks)]
    assert _pab_states(model) == before  # finalize() left the user's hook state alone
    first: dict[str, Call] = {}
    for call in calls:
        first.setdefault(call.member, call)
    assert sorted(first) == hooked
    for member, call in first.items():
        weights = model.get_submodule(member)
        (capture,) = [c for c in report.captures if member in c.members
                      and _runs(c, call, weights) is None][:1] or [None]
        assert capture is not None, (member, [_runs(c, call, weights)
                                              for c in report.captures])


def _runs(capture: ctxreplay.Capture, call: Call, weights: nn.Module | None = None
          ) -> str | None:
    """The capture's program on the call's inputs, with ``weights``'
    parameters and buffers (``None``: the member's it holds)."""
    assert capture.binding == "native"
    args, kwargs = call.fresh_inputs()
    program = capture.artifact.module()
    state = {} if weights is None else {**dict(weights.named_parameters()),
                                        **dict(weights.named_buffers())}
    try:
        with torch.no_grad():
            out: Any = torch.func.functional_call(program, state, args, kwargs)
    except Exception as exc:
        return f"raised {type(exc).__name__}"
    return differs(call.out, tuple(out))


# -- the file is checked at the cost of what finalize() did not already prove ------

class _Scale(nn.Module):
    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.factor


def _captured(verify: str) -> ctxreplay.Capture:
    model = _Scale(2.0).eval()
    with ctxreplay.capture_with(model, verify=verify) as session, torch.no_grad():
        model(torch.rand(3, 4))
    (capture,) = session.finalize().captures
    return capture


def test_graph_form_sees_the_computation_not_the_names(tmp_path: Path) -> None:
    x = torch.rand(3, 4)
    two = torch.export.export(_Scale(2.0), (x,))
    three = torch.export.export(_Scale(3.0), (x,))
    torch.export.save(two, tmp_path / "two.pt2")
    back = torch.export.load(tmp_path / "two.pt2")
    assert passes.graph_form(back.graph_module) == passes.graph_form(two.graph_module)
    assert passes.graph_form(three.graph_module) != passes.graph_form(two.graph_module)
    assert Pt2Format().same_program(two, back) and not Pt2Format().same_program(two, three)


def test_a_file_of_the_checked_program_is_not_run_again(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    capture = _captured("execute")
    runs: list[int] = []
    real = Pt2Format.module
    monkeypatch.setattr(Pt2Format, "module", lambda self, a: runs.append(1) or real(self, a))
    saved = capture.save(tmp_path / "a.pt2")
    assert saved.fidelity.ok and saved.fidelity.checked == ("graph",) and runs == []
    # finalize() checked the signature only: the file is that same program,
    # vouched for as far as the capture's own (signature) check goes
    capture = _captured("signature")
    assert capture.fidelity.checked == ("signature",)
    saved = capture.save(tmp_path / "b.pt2")
    assert saved.fidelity.ok and saved.fidelity.checked == ("graph",) and runs == []
    side = json.loads(saved.sidecar.read_text())
    assert side["fidelity"]["checked"] == ["signature"]  # a reader sees nothing ran
    # no check stands behind a verify="off" capture: the file runs once
    saved = _captured("off").save(tmp_path / "c.pt2")
    assert saved.fidelity.ok and saved.fidelity.checked == ("saved",) and runs == [1]


@pytest.mark.parametrize("verify", ["execute", "signature"])
def test_a_file_that_is_not_the_checked_program_is_run(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       verify: str) -> None:
    capture = _captured(verify)
    x = torch.rand(3, 4)
    other = torch.export.export(_Double(), (x,))  # returns float64 where the live call gave float32
    real = Pt2Format.save
    monkeypatch.setattr(Pt2Format, "save", lambda self, a, path: real(self, other, path))
    saved = capture.save(tmp_path / "a.pt2")
    assert saved.fidelity.checked == ("saved",)
    assert not saved.fidelity.ok
    assert {(m.field, m.level) for m in saved.fidelity.mismatches} == {("dtype", "saved")}


class _Double(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.double()


class _Leaky(nn.Module):
    """A forward that stores its output where no copy of the module reaches
    (a dict the class holds) and returns the stored one on later calls."""

    store: ClassVar[dict[str, torch.Tensor]] = {}

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if "out" not in self.store:
            self.store["out"] = self.lin(x)
        return self.store["out"]


def test_a_check_that_meets_the_trace_leftovers_names_them() -> None:
    _Leaky.store.clear()
    model = _Leaky().eval()
    x = torch.rand(3, 4)
    try:
        with ctxreplay.capture_with(model, verify="execute") as session, torch.no_grad():
            model(x)
        _Leaky.store.clear()  # the trace then writes a FakeTensor there
        report = session.finalize()
    finally:
        _Leaky.store.clear()
    assert not report.ok
    assert report.failures == ()  # not a verify_failed crash: a named mismatch
    (capture,) = report.captures
    assert [(m.field, m.live, m.captured) for m in capture.fidelity.mismatches] == [
        ("execution", "reference run", "FakeTensor left by trace")]


def test_a_file_with_other_weights_is_not_the_checked_program(tmp_path: Path) -> None:
    x = torch.rand(3, 4)
    torch.manual_seed(0)
    one = torch.export.export(_Scale(2.0), (x,))
    torch.manual_seed(1)
    other = torch.export.export(_Scale(2.0), (x,))
    assert passes.graph_form(one.graph_module) == passes.graph_form(other.graph_module)
    assert not Pt2Format().same_program(one, other)
