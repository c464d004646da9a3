"""Decoding with a StaticCache: saved decode captures dispatch in a fresh process.

A decoder layer's call takes the cache as an argument object.  Its saved
signature writes the object's class by import path and its constants by a
key digest, so a fresh process compares the live call with it and binds
the live cache's tensors (the flattened binding takes the call's tensor
leaves): the decode steps' in-place ``index_copy_`` lands in the live cache.

The oracle is the fresh process's own: ``generate()`` without ctxreplay
(tokens and cache tensors), and forward pre-hooks of its own on each layer
and on each layer's attention -- a layer call whose attention did not run
eagerly ran a captured graph.  The control strips what the new writer adds
(the class paths and constant keys), as an older ctxreplay wrote it: then
nothing dispatches, and ``check()`` names the part it cannot compare.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import real_models
import torch
from digests import redigest
from torch import nn

import ctxreplay

pytestmark = [pytest.mark.models,
              pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning")]

NEW_TOKENS = 12
_STATIC: dict[str, Any] = {"max_new_tokens": NEW_TOKENS, "do_sample": False, "pad_token_id": 0,
                           "cache_implementation": "static"}


def _prompt() -> torch.Tensor:
    return torch.randint(0, real_models.VOCAB, (1, 5),
                         generator=torch.Generator().manual_seed(1))


def _generate(model: nn.Module) -> Any:
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.inference_mode():
        return model.generate(_prompt(), **_STATIC)


def _saved(directory: Path) -> ctxreplay.CaptureReport:
    model = real_models.qwen2()
    with ctxreplay.capture_with(model, targets="repeated") as session:
        _generate(model)
    report = session.finalize()
    report.save_all(directory)
    return report


_FRESH = real_models.QWEN2_FRESH + textwrap.dedent("""
    def generate():
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.inference_mode():
            return model.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0,
                                  cache_implementation="static",
                                  return_dict_in_generate=True)
    def cache_tensors(result):
        return [t for layer in result.past_key_values.layers
                for t in (layer.keys, layer.values)]
    counts = {"layer": 0, "attention": 0}
    def counter(name):
        def hook(module, args, kwargs=None):
            counts[name] += 1
        return hook
    for layer in model.model.layers:
        layer.register_forward_pre_hook(counter("layer"))
    # the attention's runs are counted without a hook on it: a hook inside a
    # layer makes install run the layer eagerly
    attention = type(model.model.layers[0].self_attn)
    attention_forward = attention.forward
    def counted_forward(self, *args, **kwargs):
        counts["attention"] += 1
        return attention_forward(self, *args, **kwargs)
    attention.forward = counted_forward
    eager = generate()
    eager_counts = dict(counts)
    counts.update(layer=0, attention=0)
    loaded = ctxreplay.load(sys.argv[1])
    out = {"check": {c.label: [[d.kind, d.field, d.found] for d in c.check()
                               if d.kind == "dispatch"] for c in loaded.captures},
           "eager_counts": eager_counts}
    with ctxreplay.install(model, loaded, object_args="dispatch") as handle:
        got = generate()
        stats = handle.stats()
    out["counts"] = dict(counts)
    out["hits"] = stats.total_hits
    out["reasons"] = stats.reasons
    out["unusable"] = stats.unusable
    out["same_tokens"] = torch.equal(got.sequences, eager.sequences)
    out["same_cache"] = [torch.equal(a, b) for a, b in zip(cache_tensors(got),
                                                            cache_tensors(eager), strict=True)]
    print(json.dumps(out))
""")


def _fresh(directory: Path) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-c", _FRESH, str(directory)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def test_qwen2_static_cache_decode_captures_dispatch_in_a_fresh_process(
        tmp_path: Path) -> None:
    report = _saved(tmp_path / "caps")
    # one capture per layer for prefill and one per layer for decode
    assert len([c for c in report.captures if c.scope == "model.layers.0"]) <= 4
    out = _fresh(tmp_path / "caps")
    layer_calls = out["counts"]["layer"]
    assert layer_calls == out["eager_counts"]["layer"] == 2 * NEW_TOKENS
    # a layer call whose attention did not run eagerly ran a graph
    dispatched = layer_calls - out["counts"]["attention"]
    assert dispatched >= 0.9 * layer_calls, out
    assert dispatched == out["hits"]
    assert out["same_tokens"] and all(out["same_cache"]), out
    # the prefill calls initialise the lazily made cache: refused, and named
    assert out["reasons"] == {"mutates_argument": 2}
    prefill = sorted(label for label, found in out["check"].items() if found)
    assert prefill == sorted(out["unusable"]) and len(prefill) == 2
    for label in prefill:
        [[kind, field, found]] = out["check"][label]
        assert (kind, field) == ("dispatch", "mutates_argument")
        assert found.startswith("its forward changes an argument object in Python "
                                "(StaticCache.layers[")


def _strip(node: Any) -> Any:
    """A signature node as the writer before class paths and key digests wrote it."""
    if isinstance(node, dict):
        return {k: _strip(v) for k, v in node.items() if k not in ("class", "kind", "key")}
    if isinstance(node, list):
        return [_strip(v) for v in node]
    return node


def test_control_documents_without_class_paths_and_keys_dispatch_nothing(
        tmp_path: Path) -> None:
    _saved(tmp_path / "caps")
    for side in (tmp_path / "caps").glob("*.pt2.json"):
        doc = json.loads(side.read_text())
        doc["inputs"]["args"] = _strip(doc["inputs"]["args"])
        doc["inputs"]["kwargs"] = _strip(doc["inputs"]["kwargs"])
        side.write_text(json.dumps(doc))
    redigest(tmp_path / "caps")  # written so by an older ctxreplay, not edited after
    out = _fresh(tmp_path / "caps")
    assert out["hits"] == 0 and out["counts"]["attention"] == out["counts"]["layer"]
    assert out["same_tokens"] and all(out["same_cache"])
    decode = [label for label, why in out["unusable"].items() if why == "not_rebuildable"]
    assert len(decode) == 2
    for label in decode:
        [[kind, field, found]] = out["check"][label]
        assert (kind, field) == ("dispatch", "not_rebuildable")
        # the part it cannot compare, by its path in the call
        assert found.startswith("kwargs['cache']: an object of type StaticCache"), found
