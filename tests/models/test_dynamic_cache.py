"""generate() with its default DynamicCache: captured, verified and installed.

A decoder layer grows the cache by assignment (``DynamicLayer.update``
sets ``keys`` and ``values`` to ``torch.cat`` results; the first call also
sets ``is_initialized`` and ``device``).  The capture returns the assigned
tensors beside the layer's output, the checks compare them with the
layer's own assignments, and an installed call writes them to the live
cache: prefill and every decode step dispatch, and the tokens (and the
final cache) are those of eager ``generate()``.

The oracle is eager ``generate()`` on the same model, seeded alike, and a
forward pre-hook on each decoder layer counting its calls (a member's own
hooks run around its program).  The controls: a strict export (Dynamo does
not run the Python that reads the assignments back) leaves the old outcome
-- not ok, ``assigned (new Tensor)``, never dispatched -- and a fresh
process refuses the saved captures, naming the reason.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import real_models
import torch
from torch import nn

import ctxreplay
from ctxreplay.backends import ExportBackend

pytestmark = [pytest.mark.models,
              pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning")]

NEW_TOKENS = 4
MODELS = {"llama": real_models.llama, "qwen2": real_models.qwen2,
          "mistral": real_models.mistral}


def _prompts(batch: int) -> torch.Tensor:
    return torch.randint(1, real_models.VOCAB, (batch, 5),
                         generator=torch.Generator().manual_seed(1))


def _generate(model: nn.Module, batch: int, sample: bool) -> Any:
    torch.manual_seed(7)  # sampling draws the same numbers in every run
    with torch.inference_mode():
        return model.generate(_prompts(batch), attention_mask=torch.ones(batch, 5,
                                                                         dtype=torch.long),
                              max_new_tokens=NEW_TOKENS, do_sample=sample, pad_token_id=0,
                              return_dict_in_generate=True)


def _layer_calls(model: nn.Module) -> dict[str, int]:
    counts = {"calls": 0}

    def hook(module: nn.Module, args: Any, kwargs: Any = None) -> None:
        counts["calls"] += 1
    for layer in model.model.layers:
        layer.register_forward_pre_hook(hook)
    return counts


def _cache(result: Any) -> list[torch.Tensor]:
    return [t for layer in result.past_key_values.layers for t in (layer.keys, layer.values)]


@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampling"])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_generate_dynamic_cache_installed(name: str, batch: int, sample: bool) -> None:
    model = MODELS[name]()
    eager = _generate(model, batch, sample)
    with ctxreplay.capture_with(model, targets="repeated") as session:
        _generate(model, batch, sample)
    report = session.finalize()
    assert report.ok, report.summary
    assert report.summary == f"ok: {len(report.captures)} captures"
    assert all(c.assigned is not None and c.assigned.tensors for c in report.captures)
    # prefill (the layer's cache uninitialised) and each decode length are captured
    assert len(report.captures) >= 2
    counts = _layer_calls(model)
    handle = ctxreplay.install(model, report, object_args="dispatch")
    try:
        installed = _generate(model, batch, sample)
        stats = handle.stats()
    finally:
        handle.remove()
    assert torch.equal(installed.sequences, eager.sequences)
    assert all(torch.equal(a, b) for a, b in zip(_cache(installed), _cache(eager), strict=True))
    calls = counts["calls"]
    assert calls == 2 * (NEW_TOKENS)  # 2 layers, one call per generated token
    assert stats.total_hits == calls, (stats.hits, stats.misses, stats.reasons)


def test_a_cache_one_token_longer_is_found_without_keying_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # each decode step passes the same cache object one token longer: a
    # new key each call.  Once a length has been seen, its call is found by
    # its tensors' sizes (no walk of the cache object to key it in full)
    import ctxreplay.dispatch.install as dispatch_install
    model = MODELS["qwen2"]()
    eager = _generate(model, 1, False)
    with ctxreplay.capture_with(model, targets="repeated") as session:
        _generate(model, 1, False)
    report = session.finalize()
    keyed = []
    original = dispatch_install.call_key

    def counting(args: Any, kwargs: Any) -> Any:
        keyed.append(1)
        return original(args, kwargs)

    monkeypatch.setattr(dispatch_install, "call_key", counting)
    with ctxreplay.install(model, report, object_args="dispatch") as handle:
        first = _generate(model, 1, False)
        first_keyed = len(keyed)
        again = _generate(model, 1, False)
        stats = handle.stats()
    assert torch.equal(first.sequences, eager.sequences)
    assert torch.equal(again.sequences, eager.sequences)
    assert stats.total_hits == 2 * 2 * NEW_TOKENS, stats.reasons
    # the first generate() keys each layer's calls (prefill, each length);
    # the second only those whose structure differs from the call before:
    # the prefill (a fresh cache) and the first decode step (after it)
    assert first_keyed == 2 * NEW_TOKENS
    assert len(keyed) - first_keyed == 2 * 2, (first_keyed, len(keyed))


def test_strict_export_keeps_the_assignments_undispatched() -> None:
    """Control: Dynamo interprets the forward's bytecode, so the traced
    function cannot read the assignments back -- the capture is not ok,
    the report says why, and install never dispatches it."""
    model = real_models.llama()
    eager = _generate(model, 1, False)
    strict = ExportBackend(strict=True)
    with ctxreplay.capture_with(model, targets="repeated", backend=strict) as session:
        _generate(model, 1, False)
    report = session.finalize()
    assert not report.ok
    if report.captures:
        # not ok says why, in one line, where no problem is recorded
        assert report.summary.startswith("not ok: ")
        assert "assigned (new Tensor)" in report.summary
        lives = [m.live for c in report.captures for m in c.fidelity.mismatches]
        assert any("layers[0].keys: assigned (new Tensor)" in live for live in lives), lives
    else:
        # torch 2.7's Dynamo does not trace the layer at all: every variant
        # is a failure named so, and nothing is there to dispatch
        assert {(f.reason, f.exc_type) for f in report.failures} == {
            ("unsupported_graph", "Unsupported")}
        assert "unsupported_graph" in report.summary
    handle = ctxreplay.install(model, report, object_args="dispatch")
    try:
        installed = _generate(model, 1, False)
        stats = handle.stats()
    finally:
        handle.remove()
    assert torch.equal(installed.sequences, eager.sequences)
    assert stats.total_hits == 0
    if report.captures:
        assert stats.reasons.get("mutates_argument", 0) > 0, stats.reasons
    else:  # no capture: install holds nothing to look up
        assert stats.misses == {} and stats.reasons == {}
    assert sum(stats.reasons.values()) == sum(stats.misses.values())


_FRESH = real_models.fresh_head("Llama", 1) + textwrap.dedent("""
    def generate():
        with torch.inference_mode():
            return model.generate(prompt, attention_mask=torch.ones(1, 5, dtype=torch.long),
                                  max_new_tokens=4, do_sample=False, pad_token_id=0)
    eager = generate()
    manifest = ctxreplay.load(sys.argv[1])
    reasons = sorted({d.field for c in manifest.captures for d in c.undispatchable()})
    handle = ctxreplay.install(model, manifest, object_args="dispatch")
    out = generate()
    stats = handle.stats()
    print(json.dumps({"same": torch.equal(out, eager), "hits": stats.total_hits,
                      "reasons": dict(stats.reasons), "undispatchable": reasons}))
""")


def test_fresh_process_refuses_with_a_reason(tmp_path: Path) -> None:
    """A loaded capture does not write the assignments back: it is never
    dispatched, and says why (``mutates_argument``), and generate() is eager's."""
    import json

    model = real_models.llama()
    with ctxreplay.capture_with(model, targets="repeated") as session:
        _generate(model, 1, False)
    report = session.finalize()
    assert report.ok
    report.save_all(tmp_path)
    script = tmp_path / "fresh.py"
    script.write_text(_FRESH)
    done = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True,
                          text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["same"] is True
    assert result["hits"] == 0
    assert result["undispatchable"] == ["mutates_argument"]
    assert result["reasons"].get("mutates_argument", 0) > 0
