"""The trust sweep: every real model the suite builds (tests/helpers/real_models.py)
and the plain torch stacks, run through realistic call patterns -- several
shapes, CPU bfloat16 autocast on and off, inference mode and no_grad,
train and eval, caches on and off, ``targets`` repeated / a list / the
whole model / a predicate -- and every ``ok`` the report gives checked
against what really ran.

The oracle is the test's own (tests/helpers/trust_oracle.py): forward hooks
registered on every member before the session record each live call's
inputs, outputs, the CPU generator's state (dropout in training draws from
it) and what it left in its arguments; each recorded call is then run
through every capture that can claim it, with that member's own weights.
A *false OK* is a capture whose fidelity is ok over a call it does not
reproduce, or a report that is ok over a call no capture reproduces
(``trust_oracle.false_oks``).  A capture honestly not ok is no finding
here: the sweep asserts only that no ``ok`` is contradicted.

Members are chosen by the test itself (the documented rule for
``"repeated"``: the children of every ``nn.ModuleList`` of one class and of
every ``nn.Sequential`` of two or more blocks of one non-``torch.nn``
class), so a member the session silently misses is a call no capture covers.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import pytest
import real_models
import torch
from engine_models import MatmulBlock, Stack
from torch import nn
from trust_oracle import Call, false_oks, record

import ctxreplay

pytestmark = [pytest.mark.models,
              pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning")]

VOCAB = real_models.VOCAB


@contextlib.contextmanager
def ctx(name: str) -> Iterator[None]:
    """The ambient states the live calls run under."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(name[:4])
    with contextlib.ExitStack() as stack:
        if dtype is not None:
            stack.enter_context(torch.autocast("cpu", dtype=dtype))
        if name.endswith("inference"):
            stack.enter_context(torch.inference_mode())
        elif name.endswith("no_grad"):
            stack.enter_context(torch.no_grad())
        yield


@contextlib.contextmanager
def mode(model: nn.Module, training: bool) -> Iterator[None]:
    """``model`` in train or eval mode for the calls inside, as it was after."""
    was = model.training
    model.train(training)
    try:
        yield
    finally:
        model.train(was)


def stack_members(model: nn.Module) -> list[str]:
    """The test's own reading of ``targets="repeated"``."""
    out = []
    for name, mod in model.named_modules():
        kinds = {type(m) for m in mod.children()}
        stack = (isinstance(mod, nn.ModuleList) and len(kinds) == 1) or (
            type(mod) is nn.Sequential and len(mod) >= 2 and len(kinds) == 1
            and not next(iter(kinds)).__module__.startswith("torch.nn.modules"))
        if stack:
            out += [f"{name}.{child}" if name else child for child, _ in mod.named_children()]
    return out


@dataclasses.dataclass(frozen=True)
class Case:
    """One model under one call pattern."""

    build: Callable[[], nn.Module]
    live: Callable[[nn.Module], None]
    targets: Any = "repeated"
    verify: str = "values"
    options: tuple[tuple[str, Any], ...] = ()

    def members(self, model: nn.Module) -> list[str]:
        if self.targets == "repeated":
            return stack_members(model)
        if self.targets is None:
            return [""]
        if callable(self.targets):
            return [n for n, m in model.named_modules() if self.targets(n, m)]
        return list(self.targets)


def run_case(case: Case) -> tuple[ctxreplay.CaptureReport, list[Call]]:
    model = case.build()
    torch.manual_seed(1)
    # room for every variant a pattern makes: a dropped one is honest (not
    # ok), but leaves its calls out of what the sweep can check
    options = {"max_variants": 32, **dict(case.options)}
    with record(model, case.members(model)) as calls, \
            ctxreplay.capture_with(model, targets=case.targets, verify=case.verify,
                                   **options) as session:
        case.live(model)
    return session.finalize(), calls


# -- call patterns -------------------------------------------------------------------

def _ids(n: int, batch: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, n))


def lm_mixed(model: nn.Module) -> None:
    """Prompts of several shapes (one repeated with other tokens), bf16
    autocast on and off, inference mode and no_grad, eval then train, a
    left-padded batch; no cache."""
    for where, training, n, batch in (("bf16_inference", False, 8, 1),
                                      ("bf16_inference", False, 5, 1),
                                      ("bf16_inference", False, 8, 1),
                                      ("fp32_no_grad", False, 8, 1),
                                      ("bf16_no_grad", True, 5, 2),
                                      ("fp32_no_grad", False, 5, 2)):
        with mode(model, training), ctx(where):
            model(input_ids=_ids(n, batch), use_cache=False)
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, :2] = 0
    with ctx("bf16_inference"):
        model(input_ids=_ids(6, 2), attention_mask=mask, use_cache=False)


def lm_small(model: nn.Module) -> None:
    """Two prompt shapes under bf16 autocast and inference mode, one in float32."""
    for where, n in (("bf16_inference", 8), ("bf16_inference", 5), ("fp32_no_grad", 8)):
        with ctx(where):
            model(input_ids=_ids(n), use_cache=False)


def lm_default(model: nn.Module) -> None:
    """The plainest use: ``model(ids)`` with the defaults (a cache the model
    makes and returns), then a batch of one shape with a mask of ones and
    with a padded mask (eager transformers may drop a mask of ones)."""
    for n in (8, 5):
        with ctx("inference"):
            model(_ids(n))
    mask = torch.ones(2, 6, dtype=torch.long)
    ids = _ids(6, 2)
    for pad in (0, 2):
        mask[1, :pad] = 0
        with ctx("inference"):
            model(ids, attention_mask=mask.clone())


def lm_train_step(model: nn.Module) -> None:
    """A training step as profiled: train mode, gradient checkpointing,
    bf16 autocast, a loss and its backward (which runs each layer again)."""
    model.train()
    model.gradient_checkpointing_enable()
    try:
        ids = _ids(8)
        with ctx("bf16"):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
    finally:
        model.gradient_checkpointing_disable()
        model.eval()
        model.zero_grad(set_to_none=True)


def _cache_kw(model: nn.Module) -> str:
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters \
        else "past_key_values"


def lm_decode(where: str, cache: str | None = None) -> Callable[[nn.Module], None]:
    """A prompt then two cached steps, the cache made by the model (``None``)
    or passed in (``"dynamic"`` / ``"static"``)."""
    def live(model: nn.Module) -> None:
        import transformers

        kw: dict[str, Any] = {}
        if cache is not None:
            make = transformers.DynamicCache if cache == "dynamic" else \
                lambda config: transformers.StaticCache(config=config, max_cache_len=16)
            kw[_cache_kw(model)] = make(config=model.config)
        with ctx(where):
            out = model(input_ids=_ids(6), use_cache=True, **kw)
            for _ in range(2):
                if cache is None:
                    kw = {_cache_kw(model): out.past_key_values}
                out = model(input_ids=_ids(1), use_cache=True, **kw)
    return live


def lm_generate(model: nn.Module) -> None:
    """``generate()`` with its defaults (greedy, a cache it makes)."""
    with ctx("bf16_inference"):
        model.generate(_ids(5), attention_mask=torch.ones(1, 5, dtype=torch.long),
                       max_new_tokens=3, do_sample=False, pad_token_id=0)


def t5_mixed(model: nn.Module) -> None:
    """A prompt under bf16 autocast, a padded batch in float32; no cache."""
    with ctx("bf16_inference"):
        model(input_ids=_ids(10), decoder_input_ids=_ids(6), use_cache=False)
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 5:] = 0
    with ctx("fp32_no_grad"):
        model(input_ids=_ids(7, 2), attention_mask=mask, decoder_input_ids=_ids(3, 2),
              use_cache=False)


def whisper_decode(model: nn.Module) -> None:
    kw = _cache_kw(model)
    with ctx("bf16_inference"):
        out = model(input_features=torch.rand(1, 8, 32),
                    decoder_input_ids=torch.tensor([[1, 5, 6]]), use_cache=True)
        out = model(encoder_outputs=(out.encoder_last_hidden_state,),
                    decoder_input_ids=torch.randint(3, 64, (1, 1)), use_cache=True,
                    **{kw: getattr(out, kw)})


def wan_mixed(model: nn.Module) -> None:
    for where, frames, size in (("bf16_inference", 2, 8), ("fp32_no_grad", 1, 8)):
        with ctx(where):
            model(hidden_states=torch.rand(1, 4, frames, size, size),
                  timestep=torch.tensor([3]), encoder_hidden_states=torch.rand(1, 4, 16))


def flux_mixed(model: nn.Module) -> None:
    for where, seq, txt in (("bf16_inference", 16, 4), ("fp32_no_grad", 8, 4)):
        with ctx(where):
            model(hidden_states=torch.rand(1, seq, 4), encoder_hidden_states=torch.rand(1, txt, 16),
                  pooled_projections=torch.rand(1, 16), timestep=torch.tensor([0.5]),
                  img_ids=torch.zeros(seq, 3), txt_ids=torch.zeros(txt, 3))


def cogvideox_mixed(model: nn.Module) -> None:
    for where, frames in (("bf16_inference", 2), ("fp32_no_grad", 1)):
        with ctx(where):
            model(hidden_states=torch.rand(1, frames, 4, 8, 8),
                  encoder_hidden_states=torch.rand(1, 4, 16), timestep=torch.tensor([3]))


def dit_mixed(model: nn.Module) -> None:
    for where, label in (("bf16_inference", 1), ("fp32_no_grad", 2)):
        with ctx(where):
            model(torch.rand(1, 4, 8, 8), timestep=torch.tensor([3]),
                  class_labels=torch.tensor([label]))


def unet_once(model: nn.Module) -> None:
    with ctx("bf16_inference"):
        model(torch.rand(1, 4, 8, 8), torch.tensor([10]),
              encoder_hidden_states=torch.rand(1, 4, 32))


def stack_mixed(model: nn.Module) -> None:
    """Plain torch: shapes, autocast (bf16, fp16) on/off, inference/no_grad/
    grad, train/eval, a transposed (non-contiguous) input."""
    for where, training, rows in (("bf16_inference", False, 2), ("bf16_inference", False, 3),
                                  ("fp32_no_grad", False, 2), ("fp32", True, 2),
                                  ("bf16_no_grad", True, 3), ("bf16_inference", False, 2),
                                  ("fp16_no_grad", False, 2)):
        with mode(model, training), ctx(where):
            model(torch.rand(rows, 16))
    with ctx("bf16_inference"):
        model(torch.rand(16, 3).t())


class MatmulStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(MatmulBlock(16), MatmulBlock(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[0](x) + self.blocks[1](x)


def _stack() -> nn.Module:
    torch.manual_seed(0)
    return Stack().eval()


def _matmul_stack() -> nn.Module:
    torch.manual_seed(0)
    return MatmulStack().eval()


def _bf16(build: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    return lambda: build().to(torch.bfloat16)


def _attention_or_mlp(name: str, _m: nn.Module) -> bool:
    return name.endswith(".mlp") or name.endswith("self_attn")


# CACHE_APPENDED marks the cases whose decoder layers are given a cache:
# the layer's forward appends its keys and values to the cache object it was
# passed (``DynamicCache`` / ``EncoderDecoderCache`` Python lists; a
# ``StaticCache`` layer creates its tensors on its first update), which no
# graph op reproduces.  A capture that holds the cache as a constant must
# not be ok over such a call (``mutates_argument``); the oracle compares the
# cache a run of the capture leaves with the one the live call left.  These
# cases failed (ok over every such call) until argument objects were
# compared around the checked runs.  A model that makes its own cache
# (``model(ids)`` with the defaults, ``generate()``) passes one to every
# layer the same way.
CASES: dict[str, Case] = {
    # transformers decoder-only LMs
    "llama-mixed": Case(real_models.llama, lm_mixed),
    "llama-list": Case(real_models.llama, lm_small,
                       targets=["model.layers.0", "model.layers.1.mlp", "model.norm"]),
    "llama-predicate": Case(real_models.llama, lm_small, targets=_attention_or_mlp,
                            verify="execute"),
    "llama-small-default-verify": Case(real_models.llama, lm_small, verify="signature"),
    "llama-train-step-checkpointing": Case(real_models.llama, lm_train_step),
    "llama-decode-bf16-inference": Case(real_models.llama, lm_decode("bf16_inference"),
                                        verify="execute"),  # CACHE_APPENDED
    # the whole model: its own cache is made inside, no layer is observed
    "llama-whole-bf16-weights-default-call": Case(_bf16(real_models.llama), lm_default,
                                                  targets=None),
    "qwen2-small": Case(real_models.qwen2, lm_small),
    "qwen2-bf16-weights-default-call": Case(_bf16(real_models.qwen2),
                                            lm_default),  # CACHE_APPENDED
    "qwen2-decode-dynamic-fp32": Case(real_models.qwen2, lm_decode("fp32_no_grad", "dynamic")
                                      ),  # CACHE_APPENDED
    "qwen2-generate-bf16-inference": Case(real_models.qwen2,
                                          lm_generate),  # CACHE_APPENDED
    # the steps' in-place index_copy_ is reproduced; the prompt's lazy
    # creation of each layer's tensors is not
    "qwen3-decode-static-bf16": Case(lambda: real_models.qwen3()[0],
                                     lm_decode("bf16_inference", "static")
                                     ),  # CACHE_APPENDED
    # its train call runs dropout: reproduced given the generator's state
    "gpt2-mixed": Case(real_models.gpt2, lm_mixed, verify="execute"),
    "gpt2-decode-bf16-no_grad": Case(real_models.gpt2, lm_decode("bf16_no_grad")
                                     ),  # CACHE_APPENDED
    # transformers encoder-decoders
    "t5-mixed": Case(real_models.t5, t5_mixed),
    "whisper-decode": Case(real_models.whisper, whisper_decode),  # CACHE_APPENDED
    # diffusers
    "wan-mixed": Case(real_models.wan, wan_mixed),
    "flux-mixed": Case(real_models.flux, flux_mixed),
    "cogvideox-mixed": Case(real_models.cogvideox, cogvideox_mixed),
    "dit-mixed": Case(real_models.dit, dit_mixed, verify="execute"),
    "unet-bf16-inference": Case(real_models.unet2d_condition, unet_once),
    # plain torch
    "torch-stack-mixed": Case(_stack, stack_mixed),
    "torch-stack-list": Case(_stack, stack_mixed, targets=["blocks.0", "blocks.3", "head"],
                             verify="execute"),
    "torch-matmul-sequential": Case(_matmul_stack, stack_mixed),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_no_capture_and_no_report_is_ok_over_a_call_it_does_not_reproduce(name: str) -> None:
    report, calls = run_case(CASES[name])
    assert calls, "the pattern made no call of a member"
    assert report.captures, (report.failures, report.problems)
    found = false_oks(report, calls)
    assert found == [], "\n".join(found)


# -- the oracle can fail -------------------------------------------------------------

def _forged_ok(report: ctxreplay.CaptureReport) -> ctxreplay.CaptureReport:
    """The report with every capture's fidelity set to ok."""
    caps = tuple(attrs.evolve(c, fidelity=attrs.evolve(c.fidelity, ok=True))
                 for c in report.captures)
    return attrs.evolve(report, captures=caps, failures=(), problems=())


def test_the_sweep_catches_captures_that_ran_without_the_live_context() -> None:
    # replay="off": every capture traced outside the live autocast, so a call
    # that ran in bfloat16 is captured in float32.  With ok forged on and
    # each capture run as the self-contained program it claims to be (the
    # report lists autocast as ambient-only: run inside autocast, the float32
    # graph's ops are cast again), the oracle must name exactly the calls
    # that ran under autocast.
    model = real_models.llama()
    members = stack_members(model)
    ran_bf16: list[bool] = []
    for name in members:  # the layers run one after another: the same order as ``calls``
        model.get_submodule(name).register_forward_pre_hook(
            lambda *_: ran_bf16.append(torch.is_autocast_enabled("cpu")))
    report, calls = run_case(Case(lambda: model, lm_mixed, options=(("replay", "off"),)))
    assert not report.ok
    forged = _forged_ok(report)
    assert forged.ok
    found = false_oks(forged, calls, ambient=False)
    flagged = {int(f.split("call ")[1].split()[0]) for f in found if "reproduced by none" in f}
    assert len(ran_bf16) == len(calls) and 0 < sum(ran_bf16) < len(calls)
    assert flagged == {i for i, bf16 in enumerate(ran_bf16) if bf16}, found
    # and each capture that claims such a call is named by the capture check
    assert any("fidelity ok over" in f for f in found), found


def test_the_sweep_catches_a_report_ok_over_calls_no_capture_claims() -> None:
    report, calls = run_case(Case(_stack, stack_mixed, verify="signature"))
    assert false_oks(report, calls) == []
    gone = max(report.captures, key=lambda c: c.calls)
    dropped = attrs.evolve(report, captures=tuple(c for c in report.captures if c is not gone))
    assert dropped.ok
    found = false_oks(dropped, calls)
    assert sum("reproduced by none" in f for f in found) == gone.calls, found
    assert any(f.startswith("report ok but captures claim") for f in found), found


def test_the_sweep_catches_a_graph_that_does_not_update_a_cache_it_was_given() -> None:
    # a dynamic cache grows by assigning each layer new key and value tensors,
    # which a capture now returns as extra outputs (``Capture.assigned``) and
    # the oracle writes back as install does.  Without that write-back -- the
    # captures forged to carry no assignments, and ok -- the state the live
    # calls left in their cache is not what a run of the artifact leaves
    report, calls = run_case(Case(real_models.qwen2, lm_decode("fp32_no_grad", "dynamic"),
                                  verify="signature"))
    assert all(c.assigned is not None for c in report.captures)
    assert not false_oks(report, calls)  # with the write-back: no false OK
    forged = _forged_ok(report)
    forged = attrs.evolve(forged, captures=tuple(attrs.evolve(c, assigned=None)
                                                 for c in forged.captures))
    found = false_oks(forged, calls)
    # every forged capture is caught: its program's outputs hold the new
    # cache tensors, which nothing writes back into the live call's cache
    caught = {f.split(" ")[0] for f in found if "reproduces 0 of" in f}
    assert caught == {f"{c.scope}#{c.variant}" for c in report.captures}, found
    assert sum(f.startswith("report ok but call") for f in found) == len(calls), found
