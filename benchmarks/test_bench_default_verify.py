"""The default verification (``verify="sampled"``) on real-size models: what
an open session costs the live forward at steady state, and what finalize
costs beside ``verify="execute"``.

Two models built from configs with random weights, fp32 weights under bf16
autocast, one thread:

* a Qwen2 decoder at the 0.5B shape (24 layers, hidden 896; the vocabulary
  shrunk: no layer reads it), a 32-token prompt, no cache;
* a Wan 2.1 transformer at the 1.3B shape (30 layers, dim 1536, 12 heads,
  FFN 8960), a small latent (64 tokens) and 32 text tokens.

Targets: the observed forward within 1.05x eager once every variant has
been seen (the sampled calls are the session's first few: by then the
calls take the fast path); finalize's time at the default is reported
beside ``"execute"``'s (a reference, no target).  Under
``--benchmark-disable`` both shrink to a few small layers.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from benchutil import fast, interleaved_medians, report
from torch import nn

import ctxreplay

QWEN2_05B = {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
             "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 1024}
QWEN2_TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128}
WAN_13B = {"num_attention_heads": 12, "attention_head_dim": 128, "ffn_dim": 8960,
           "num_layers": 30, "text_dim": 4096, "freq_dim": 256, "in_channels": 16,
           "out_channels": 16}
WAN_TINY = {"num_attention_heads": 2, "attention_head_dim": 8, "ffn_dim": 32,
            "num_layers": 3, "text_dim": 16, "freq_dim": 16, "in_channels": 4,
            "out_channels": 4}


def _qwen2(small: bool) -> tuple[nn.Module, Callable[[], Any]]:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.Qwen2Config(**(QWEN2_TINY if small else QWEN2_05B))
    model = transformers.Qwen2Model(config).eval()
    ids = torch.randint(0, config.vocab_size, (1, 32))
    return model, lambda: model(ids, use_cache=False)


def _wan(small: bool) -> tuple[nn.Module, Callable[[], Any]]:
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    config = WAN_TINY if small else WAN_13B
    model = diffusers.WanTransformer3DModel(patch_size=(1, 2, 2), rope_max_seq_len=64,
                                            cross_attn_norm=True,
                                            qk_norm="rms_norm_across_heads", **config).eval()
    latent = torch.randn(1, config["in_channels"], 1, 16, 16)  # 64 tokens of 2x2 patches
    text = torch.randn(1, 32, config["text_dim"])
    t = torch.tensor([500])
    return model, lambda: model(latent, t, text, return_dict=False)


MODELS = {"qwen2-0.5b": _qwen2, "wan-1.3b": _wan}


def _live(fn: Callable[[], Any]) -> Callable[[], Any]:
    def run() -> Any:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            return fn()
    return run


def _finalize_seconds(model: nn.Module, call: Callable[[], Any], verify: str,
                      calls: int) -> tuple[float, ctxreplay.CaptureReport]:
    session = ctxreplay.capture_with(model, targets="repeated", backend="export",
                                     verify=verify)
    with session:
        for _ in range(calls):
            call()
    t0 = time.perf_counter()
    rep = session.finalize()
    return time.perf_counter() - t0, rep


@pytest.mark.parametrize("name", sorted(MODELS))
def test_default_verify_cost(benchmark: Any, request: pytest.FixtureRequest,
                             name: str) -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)
    small = fast(request.config)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, fn = MODELS[name](small)
        call = _live(fn)

        def measure() -> dict[str, float]:
            out: dict[str, float] = {}
            session = ctxreplay.capture_with(model, targets="repeated", backend="export")
            with session:
                for _ in range(8):  # past the sampled first calls: steady state
                    call()
                session_call = call
                med = interleaved_medians({"eager": _eager_of(session, call),
                                           "session": session_call},
                                          number=1, rounds=3 if small else 7)
            out["steady"] = med["session"] / med["eager"]
            out["sampled"], rep = _finalize_seconds(model, call, "sampled", 4)
            assert rep.ok, (rep.failures, rep.problems)
            out["checked"] = sum(c.checked for c in rep.captures)
            out["execute"], rep = _finalize_seconds(model, call, "execute", 4)
            assert rep.ok, (rep.failures, rep.problems)
            return out

        got = benchmark.pedantic(measure, rounds=1, iterations=1)
    finally:
        torch.set_num_threads(threads)
    report(f"observed forward / eager at steady state, default verify [{name}]",
           got["steady"], "<= 1.05")
    report(f"finalize at the default verify / at execute [{name}]",
           got["sampled"] / got["execute"], "none, a reference",
           f"sampled {got['sampled']:.1f} s ({got['checked']:.0f} calls compared by value), "
           f"execute {got['execute']:.1f} s")


def _eager_of(session: ctxreplay.CaptureSession, call: Callable[[], Any]
              ) -> Callable[[], Any]:
    """The same forward without observation, on the same module and weights:
    each member's wrapper (its instance attribute ``forward``) taken off for
    the call and put back after, so the session's memo stays as it was."""
    held = [m.module for m in session._observation.members]

    def run() -> Any:
        wrappers = [mod.__dict__.pop("forward") for mod in held]
        try:
            return call()
        finally:
            for mod, w in zip(held, wrappers):
                mod.__dict__["forward"] = w
    return run
