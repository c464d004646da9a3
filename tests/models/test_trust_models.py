"""Identity and isolation on real architectures: ``transformers`` Qwen3 decode
with a ``DynamicCache`` and a ``StaticCache``, and Whisper cached decode
(tiny configs built in code, no downloads), live under CPU bfloat16 autocast
and inference mode.

Every call of every decoder (and encoder) layer is recorded by the test's
own hooks and replayed through the capture that lists its layer, with that
layer's own weights (tests/helpers/trust_oracle.py); it must match the live values
within bfloat16 tolerance, and the report must be ok exactly then.  The
negative controls: a capture forced to share across ``layer_idx``, a grown
cache run through the capture of the call before it, and ``replay="off"``
-- each is caught by the oracle, and none of them is reported ok.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest
import real_models
import torch
from torch import nn
from trust_oracle import Call, members_of, record, replay_failure, unreproduced

import ctxreplay

pytestmark = [pytest.mark.models,
              pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning")]

VOCAB = real_models.VOCAB


def _cache_kw(model: nn.Module) -> str:
    # transformers 5 renamed past_key_values to cache
    return "cache" if "cache" in inspect.signature(model.forward).parameters \
        else "past_key_values"


def _capture(model: nn.Module, members: list[str], live: Callable[[nn.Module], None],
             **options: Any) -> tuple[ctxreplay.CaptureReport, list[Call]]:
    options.setdefault("verify", "execute")
    with record(model, members) as calls, \
            ctxreplay.capture_with(model, targets="repeated", **options) as session, \
            torch.autocast("cpu", dtype=torch.bfloat16), torch.inference_mode():
        live(model)
    return session.finalize(), calls


_RUNS: dict[str, tuple[ctxreplay.CaptureReport, list[Call], list[str]]] = {}


def _default_run(name: str) -> tuple[ctxreplay.CaptureReport, list[Call], list[str]]:
    """The plain capture of a model's decode, made once per module: several
    tests read it (each replays copies of the recorded inputs)."""
    if name not in _RUNS:
        if name == "whisper":
            model = _whisper()
            members = _whisper_members(model)
            live = _whisper_decode
        else:
            model, config = _qwen3()
            members = members_of(model, "model.layers")
            live = _decode(name, config)
        report, calls = _capture(model, members, live)
        _RUNS[name] = (report, calls, members)
    return _RUNS[name]


def _assert_every_call_reproduced(report: ctxreplay.CaptureReport, calls: list[Call],
                                  n_calls: int) -> None:
    """Every call's outputs are reproduced by its capture (the oracle); a
    capture is ok exactly when it has no ``argument`` mismatch (a cache that
    grows or initialises itself by assignment is not one: its program
    returns the assigned tensors)."""
    assert len(calls) == n_calls
    assert not report.failures, [(f.scope, f.variant, f.reason) for f in report.failures]
    assert unreproduced(report, calls) == []
    changes = [c for c in report.captures
               if any(m.field == "argument" for m in c.fidelity.mismatches)]
    assert report.ok == (not changes)
    for c in report.captures:
        assert c.fidelity.checked == ("signature", "execute")
        assert c.fidelity.ok == (c not in changes)
        assert all(m.field == "argument" for m in c.fidelity.mismatches)
        assert c.backend == "export" and "autocast" in c.embedded
        assert set(c.ambient_only) <= {"grad_mode"}
    covered = sum(c.calls for c in report.captures)
    assert covered == n_calls


# -- Qwen3 decode ------------------------------------------------------------------

def _qwen3() -> tuple[nn.Module, Any]:
    return real_models.qwen3()


def _decode(kind: str, config: Any, steps: int = 2) -> Callable[[nn.Module], None]:
    import transformers

    def live(model: nn.Module) -> None:
        cache = transformers.DynamicCache(config=config) if kind == "dynamic" else \
            transformers.StaticCache(config=config, max_cache_len=16)
        kw = _cache_kw(model)
        model(torch.randint(0, VOCAB, (1, 6)), use_cache=True, **{kw: cache})
        for _ in range(steps):
            model(torch.randint(0, VOCAB, (1, 1)), use_cache=True, **{kw: cache})
    return live


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_qwen3_decode_every_call_matches_through_its_own_layers_capture(kind: str) -> None:
    report, calls, members = _default_run(kind)
    # a prompt and two steps through two layers
    _assert_every_call_reproduced(report, calls, 6)
    # layer_idx differs: no capture stands for both layers
    assert all(len(c.members) == 1 and c.weights_from == c.members[0]
               for c in report.captures)
    assert report.ok, report.summary
    changed = [c for c in report.captures if c.assigned is not None]
    if kind == "dynamic":  # each step's cache is longer: a variant per layer and step
        assert len(report.captures) == 6
        # and each step assigns the layer's keys a longer tensor: the program returns it
        assert len(changed) == 6
    else:  # the static cache keeps its shapes: both steps share one variant per layer
        steps = [c for c in report.captures if c.calls == 2]
        assert sorted(c.members for c in steps) == [(members[0],), (members[1],)]
        # the prompt initialises the cache's tensors (assigned: the program
        # returns them); the steps update them in place, as mutated inputs
        assert sorted(c.members for c in changed) == [(members[0],), (members[1],)]
        assert all(c.assigned is None for c in steps)


@pytest.mark.parametrize("verify", ["execute", "values"])
def test_qwen3_static_cache_forced_to_share_across_layer_idx_is_caught(verify: str) -> None:
    # The case without the fix: both layers' decode steps through layer 0's
    # graph, which reads layer 0's cache slot whatever the weights.
    model, config = _qwen3()
    members = members_of(model, "model.layers")
    report, calls = _capture(model, members, _decode("static", config), verify=verify,
                             ignore_attributes=("layer_idx",))
    shared = [c for c in report.captures if len(c.members) == 2]
    assert shared and all(c.weights_from == members[0] for c in shared)
    bad = unreproduced(report, calls)
    assert bad and all(f"of {members[1]} via" in b for b in bad), bad
    assert not report.ok
    for c in shared:
        assert not c.fidelity.ok
        assert {m for mm in c.fidelity.mismatches for m in mm.members} == {members[1]}


def test_qwen3_dynamic_cache_a_grown_cache_through_the_previous_steps_capture_fails() -> None:
    # What a variant key blind to the cache's tensors would do: the second
    # step's call (its cache one position longer) run through the first's.
    report, calls, members = _default_run("dynamic")
    mine = sorted((c for c in report.captures if c.members == (members[1],)),
                  key=lambda c: c.variant)
    step1, step2 = [c for c in calls if c.member == members[1]][1:]
    assert replay_failure(mine[1], step1) is None
    assert replay_failure(mine[2], step2) is None
    assert replay_failure(mine[1], step2, check_shapes=False) is not None


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_qwen3_decode_without_replay_is_caught_and_not_ok(kind: str) -> None:
    model, config = _qwen3()
    members = members_of(model, "model.layers")
    report, calls = _capture(model, members, _decode(kind, config), replay="off")
    # run as the self-contained program an embedded capture is
    assert len(unreproduced(report, calls, ambient=False)) == len(calls)
    assert not report.ok
    assert all(not c.fidelity.ok for c in report.captures)


# -- Whisper cached decode -------------------------------------------------------

def _whisper() -> nn.Module:
    return real_models.whisper()


def _whisper_decode(model: nn.Module) -> None:
    kw = _cache_kw(model)
    out = model(input_features=torch.rand(1, 8, 32), decoder_input_ids=torch.tensor([[1, 5, 6]]),
                use_cache=True)
    for _ in range(2):
        out = model(encoder_outputs=(out.encoder_last_hidden_state,),
                    decoder_input_ids=torch.randint(3, 64, (1, 1)), use_cache=True,
                    **{kw: getattr(out, kw)})


def _whisper_members(model: nn.Module) -> list[str]:
    return members_of(model, "model.encoder.layers") + members_of(model, "model.decoder.layers")


def test_whisper_cached_decode_every_call_matches_through_its_own_layers_capture() -> None:
    report, calls, members = _default_run("whisper")
    # the encoder once (2 layers), the decoder for the prompt and two steps
    _assert_every_call_reproduced(report, calls, 2 + 3 * 2)
    decoder = [c for c in report.captures if ".decoder." in c.scope]
    assert all(len(c.members) == 1 for c in decoder) and len(decoder) == 6
    # the decoder's cache grows by assignment at every call (the program
    # returns the new tensors); the encoder takes none
    assert all(c.fidelity.ok and c.assigned is not None for c in decoder)
    assert all(c.assigned is None for c in report.captures if c not in decoder)
    assert all(c.fidelity.ok for c in report.captures if c not in decoder)
    # the encoder layers have one identity: one capture, both members, own weights
    (encoder,) = [c for c in report.captures if ".encoder." in c.scope]
    assert encoder.members == tuple(members[:2])


def test_whisper_cached_decode_grown_cache_and_no_replay_are_caught() -> None:
    report, calls, members = _default_run("whisper")
    layer = members[3]  # the second decoder layer
    mine = sorted((c for c in report.captures if c.members == (layer,)),
                  key=lambda c: c.variant)
    step1, step2 = [c for c in calls if c.member == layer][1:]
    assert replay_failure(mine[1], step1) is None
    assert replay_failure(mine[2], step2) is None
    assert replay_failure(mine[1], step2, check_shapes=False) is not None

    report, calls = _capture(_whisper(), members, _whisper_decode, replay="off")
    assert len(unreproduced(report, calls, ambient=False)) == len(calls)
    assert not report.ok
