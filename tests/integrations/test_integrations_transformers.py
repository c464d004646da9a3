"""The transformers integration: a model switched between attention
implementations between calls gets a capture per implementation, each
reproducing its calls by value, named in the report, and installed graphs
follow the switch -- here and in a fresh process.

The oracle is an eager rerun of the model under each implementation; the
two implementations differ on this model, so a graph traced under the
wrong one (the behaviour without the probe) fails the comparison.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import ctxreplay
from ctxreplay.probes import default_probes, get_probe

pytestmark = [pytest.mark.models,
              pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning")]

transformers = pytest.importorskip("transformers")

IMPLEMENTATIONS = ("eager", "sdpa")
N_LAYERS = 2

_MODEL = """
def llama():
    import torch, transformers
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config).eval()


def run(model, implementation):
    import torch
    model.set_attn_implementation(implementation)
    ids = torch.arange(8).remainder(128).view(1, 8) * 7 % 128
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits
"""
_ns: dict[str, object] = {}
exec(_MODEL, _ns)
llama, run = _ns["llama"], _ns["run"]


@pytest.fixture(scope="module")
def model() -> nn.Module:
    m: nn.Module = llama()  # type: ignore[operator]
    return m


@pytest.fixture(scope="module")
def eager(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {i: run(model, i) for i in IMPLEMENTATIONS}  # type: ignore[operator]
    assert not torch.equal(out["eager"], out["sdpa"])  # the oracle can tell them apart
    return out


@pytest.fixture(scope="module")
def report(model: nn.Module) -> ctxreplay.CaptureReport:
    with ctxreplay.capture_with(model, targets="repeated", verify="execute") as session:
        for implementation in ("eager", "eager", "sdpa", "sdpa"):
            run(model, implementation)  # type: ignore[operator]
    return session.finalize()


def test_the_probe_is_default_once_transformers_is_imported() -> None:
    assert "transformers_attention" in default_probes()
    probe = get_probe("transformers_attention")
    assert probe.observe() == probe.neutral_state()  # the registered probe reads no model


def test_a_capture_per_implementation_named_in_the_report(
        report: ctxreplay.CaptureReport) -> None:
    assert report.ok, (report.failures, report.problems)
    named = sorted(c.snapshot.describe()["transformers_attention"] for c in report.captures)
    assert named == ["LlamaConfig: eager", "LlamaConfig: sdpa"]
    doc = report.to_json()
    states = sorted(c["snapshot"]["probes"]["transformers_attention"]["state"]
                    ["implementations"][0][1] for c in doc["captures"])
    assert states == ["eager", "sdpa"]


def test_installed_graphs_follow_the_switch_by_value(
        model: nn.Module, eager: dict[str, torch.Tensor],
        report: ctxreplay.CaptureReport) -> None:
    with ctxreplay.install(model, report) as handle:
        for n, implementation in enumerate(("eager", "sdpa", "eager"), 1):
            out = run(model, implementation)  # type: ignore[operator]
            assert handle.stats().total_hits == n * N_LAYERS, implementation
            assert torch.equal(out, eager[implementation]), implementation
        assert handle.stats().reasons == {}
    # the registered probe was never bound: sessions and installs bind their own
    probe = get_probe("transformers_attention")
    assert probe.observe() == probe.neutral_state()


def test_each_bound_model_is_read_alone(model: nn.Module) -> None:
    other: nn.Module = llama()  # type: ignore[operator]
    other.set_attn_implementation("eager")
    model.set_attn_implementation("sdpa")
    probe = get_probe("transformers_attention")
    mine, theirs = probe.bind(model), probe.bind(other)
    assert mine.describe(mine.observe()) == "LlamaConfig: sdpa"
    assert theirs.describe(theirs.observe()) == "LlamaConfig: eager"
    assert probe.observe() == probe.neutral_state()


def test_a_config_class_under_two_implementations_is_refused_by_name() -> None:
    probe = get_probe("transformers_attention")
    state = probe.decode({"implementations": [["LlamaConfig", "eager"],
                                              ["LlamaConfig", "sdpa"]]}, "$.state")
    with pytest.raises(ValueError, match="LlamaConfig is bound under two"), \
            probe.replay(state):
        pass
    unknown = probe.decode({"implementations": [["NoSuchConfig", "eager"]]}, "$.state")
    with pytest.raises(ValueError, match="bound to no model with a NoSuchConfig config"), \
            probe.replay(unknown):
        pass
    with pytest.raises(ValueError, match=r"\$\.state\.implementations\[0\]"):
        probe.decode({"implementations": [["LlamaConfig"]]}, "$.state")


_FRESH = _MODEL + """
import json, sys, warnings
warnings.filterwarnings("ignore")
import torch, ctxreplay
model = llama()
eager = {i: run(model, i) for i in ("eager", "sdpa")}
src = ctxreplay.load(sys.argv[1])
result = {"check": [d.text for d in src.check()], "steps": []}
with ctxreplay.install(model, src) as handle:
    for implementation in ("eager", "sdpa", "eager"):
        before = handle.stats().total_hits
        out = run(model, implementation)
        result["steps"].append([implementation, handle.stats().total_hits - before,
                                bool(torch.equal(out, eager[implementation]))])
print(json.dumps(result))
"""


def test_a_fresh_process_follows_the_switch(report: ctxreplay.CaptureReport,
                                            tmp_path: Path) -> None:
    assert report.save_all(tmp_path).ok
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_FRESH), str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["check"] == []  # the graphs carry the implementation they were traced with
    assert result["steps"] == [["eager", N_LAYERS, True], ["sdpa", N_LAYERS, True],
                               ["eager", N_LAYERS, True]]


# -- the cache implementation: an argument, not state a layer reads --------------------

def _decode(model: nn.Module, kind: str) -> list[torch.Tensor]:
    """A prompt and two steps with a cache of ``kind``, as ``generate()``
    builds one from ``generation_config.cache_implementation``."""
    config = model.config  # type: ignore[union-attr]
    cache = transformers.DynamicCache(config=config) if kind == "dynamic" else \
        transformers.StaticCache(config=config, max_cache_len=16)
    outs = []
    with torch.no_grad():
        ids = torch.arange(6).view(1, 6) * 7 % 128
        outs.append(model(input_ids=ids, use_cache=True, past_key_values=cache).logits)
        for step in range(2):
            outs.append(model(input_ids=torch.tensor([[step + 3]]), use_cache=True,
                              past_key_values=cache).logits)
    return outs


def test_a_cache_implementation_reaches_the_layers_only_as_their_cache_argument() -> None:
    # transformers (5.24) reads cache_implementation only where generate()
    # builds the cache; the layers get the object it built, an argument the
    # variant key holds -- so no probe is needed, and none could key more
    model: nn.Module = llama()  # type: ignore[operator]
    model.set_attn_implementation("sdpa")  # type: ignore[operator]
    eager = {k: _decode(model, k) for k in ("static", "dynamic")}
    model.generation_config.cache_implementation = "static"  # type: ignore[union-attr]
    assert all(torch.equal(a, b) for a, b in zip(_decode(model, "dynamic"), eager["dynamic"]))
    with ctxreplay.capture_with(model, targets="repeated", verify="execute") as session:
        _decode(model, "static")
    report = session.finalize()
    assert report.captures
    handle = ctxreplay.install(model, report)
    try:
        out = _decode(model, "dynamic")
        stats = handle.stats()
        assert stats.total_hits == 0 and set(stats.reasons) == {"signature"}, stats
        assert all(torch.equal(a, b) for a, b in zip(out, eager["dynamic"]))
    finally:
        handle.remove()
