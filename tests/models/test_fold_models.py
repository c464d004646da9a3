"""Size folding on real models: a tiny Qwen2 at six prompt lengths and a tiny
Wan DiT at two latent sizes, each under CPU bf16 autocast and inference mode.

Truth: every block call recorded by the test's own hooks and replayed by
tests/helpers/trust_oracle.py, eager reruns of the same model, and -- for what
``install`` dispatched -- hooks on a submodule of each block, which a
dispatched call (the graph runs instead of the forward) never calls.

Where ctxreplay does not fold (torch 2.7: no size guards in its programs)
each test asserts what a user meets instead: Qwen2's lengths spend the
variant budget and the report names ``fold:off:size_guards=False``; Wan's two
sizes are two captures, each dispatched at its own size.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import real_models
import torch
from capability import FOLDS
from forward_count import forwards_run
from torch import nn
from trust_oracle import false_oks, members_of, record, unreproduced

import ctxreplay

pytestmark = pytest.mark.models

LENGTHS = (5, 7, 9, 12, 16, 20)


def _qwen2(layers: int = 4) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=real_models.VOCAB, hidden_size=32, intermediate_size=64,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64)
    return transformers.Qwen2ForCausalLM(config).eval()


def _prompt(length: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(length)
    return torch.randint(0, real_models.VOCAB, (1, length), generator=g)


def _logits(model: nn.Module, length: int) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.inference_mode():
        out: torch.Tensor = model(_prompt(length), use_cache=False).logits
    return out


@contextmanager
def _dispatched(blocks: list[nn.Module], inner: Callable[[nn.Module], nn.Module]
                ) -> Iterator[list[int]]:
    """``[block calls, block calls whose forward ran]``: a block's forward
    calls ``inner(block)``, a dispatched call does not (counted without a
    hook on it, which would make install run the block eagerly)."""
    count = [0, 0]

    def block(*_: Any) -> None:
        count[0] += 1

    handles = [b.register_forward_pre_hook(block) for b in blocks]
    try:
        with forwards_run(inner(b) for b in blocks) as ran:
            yield count
            count[1] = ran[0]
    finally:
        for h in handles:
            h.remove()


def _qwen2_live(fold: bool) -> tuple[nn.Module, ctxreplay.CaptureReport, list[Any]]:
    model = _qwen2()
    with record(model, members_of(model, "model.layers")) as calls, \
            ctxreplay.capture_with(model, targets="repeated", fold=fold) as session:
        for n in LENGTHS:
            _logits(model, n)
    return model, session.finalize(), calls


def test_qwen2_six_prompt_lengths_fold_into_one_graph_that_install_dispatches() -> None:
    model, report, calls = _qwen2_live(fold=True)
    if not FOLDS:  # as without folding, and the report says why
        assert not report.ok and false_oks(report, calls) == []
        limits = [p for p in report.problems if p.reason == "variant_limit"]
        assert limits and all(any(n.startswith("fold:off:size_guards=False") for n in p.names)
                              for p in limits), limits
        return
    assert report.ok, (report.problems, report.failures)
    assert len(calls) == 24
    assert false_oks(report, calls) == []
    assert unreproduced(report, calls) == []
    layers = [c for c in report.captures if c.scope == "model.layers.0"]
    assert 1 <= len(layers) <= 2, [c.folding for c in report.captures]
    folded = [c for c in layers if c.folding is not None]
    assert folded and folded[0].folding is not None
    assert all(lo <= 5 and hi >= 20 for lo, hi in
               [(r.low, r.high) for r in folded[0].folding.ranges])
    blocks = list(model.model.layers)  # type: ignore[union-attr, arg-type]

    def inner(b: nn.Module) -> nn.Module:
        return b.self_attn.q_proj  # type: ignore[union-attr, return-value]

    for lengths, least in ((LENGTHS, 22), ((10,), 4), ((30,), 0), ((3,), 0)):
        eager = [_logits(model, n) for n in lengths]
        with _dispatched(blocks, inner) as count, ctxreplay.install(model, report):
            got = [_logits(model, n) for n in lengths]
        assert count[0] == 4 * len(lengths)
        dispatched = count[0] - count[1]
        assert dispatched >= least if least else dispatched == 0, (lengths, count)
        assert all(torch.equal(a, b) for a, b in zip(got, eager)), lengths


def test_qwen2_six_prompt_lengths_without_folding_spend_the_budget() -> None:
    """The control: each layer (its own ``layer_idx``) and each length is a
    variant of its own."""
    _, report, _ = _qwen2_live(fold=False)
    assert "variant_limit" in [p.reason for p in report.problems]
    assert not report.ok


def _wan_call(frames: int, size: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(frames * 100 + size)
    return {"hidden_states": torch.rand(1, 4, frames, size, size, generator=g),
            "timestep": torch.tensor([3]),
            "encoder_hidden_states": torch.rand(1, 4, 16, generator=g)}


def _sample(model: nn.Module, call: dict[str, Any]) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.inference_mode():
        out: torch.Tensor = model(**call).sample
    return out


def test_wan_at_two_latent_sizes_is_one_folded_graph_and_says_so() -> None:
    model = real_models.wan()
    sizes = [_wan_call(2, 8), _wan_call(2, 12)]
    eager = [_sample(model, c) for c in sizes]
    with record(model, members_of(model, "blocks")) as calls, \
            ctxreplay.capture_with(model, targets="repeated") as session:
        for c in sizes:
            _sample(model, c)
    report = session.finalize()
    assert report.ok, (report.problems, report.failures)
    assert false_oks(report, calls) == [] and unreproduced(report, calls) == []
    blocks = [c for c in report.captures if c.scope == "blocks.0"]
    if not FOLDS:  # a graph per size, each dispatched for its own size
        assert len(blocks) == 2 and all(c.folding is None for c in blocks)
        assert all("folded" not in c.verdict for c in blocks)
        with _dispatched(list(model.blocks), lambda b: b.ffn) as count, \
                ctxreplay.install(model, report):
            got = [_sample(model, c) for c in sizes]
        assert count == [6, 0]
        assert all(torch.equal(a, b) for a, b in zip(got, eager))
        return
    assert len(blocks) == 1  # one graph for both sizes ...
    (capture,) = blocks
    assert capture.folding is not None and len(capture.folded) == 1
    assert capture.folding.sizes == 2
    # ... claimed for the two token counts it ran at (2 frames x 4x4 / 6x6 patches)
    assert [(r.low, r.high) for r in capture.folding.ranges] == [(32, 72)]
    assert "folded: 2 sizes" in capture.verdict
    doc = json.loads(json.dumps(report.to_json()))
    (saved,) = [c for c in doc["captures"] if c["scope"] == "blocks.0"]
    assert saved["folded"] == list(capture.folded)
    assert saved["dynamic"]["ranges"] == [{"name": capture.folding.ranges[0].name,
                                           "low": 32, "high": 72}]
    with _dispatched(list(model.blocks), lambda b: b.ffn) as count, \
            ctxreplay.install(model, report):
        got = [_sample(model, c) for c in sizes]
    assert count == [6, 0]  # every block call ran the folded graph
    assert all(torch.equal(a, b) for a, b in zip(got, eager))
