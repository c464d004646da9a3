"""A Mistral decoder layer with a sliding window shorter than the sequence,
under ``generate()``: every saved program reproduces every call it claims.

The window (4) is shorter than the prompt (8), so the prefill's mask is
banded and each decode step attends to the last window of keys only.  With
the default cache (``DynamicCache(config=...)``) each layer is a
``DynamicSlidingWindowLayer``: it keeps the last ``window - 1`` keys (a
fixed size once full) and counts the tokens seen in ``cumulative_length``, a
Python int that changes every step.  With a plain ``DynamicCache()`` the
layers are full ones, grown one token a step, and the mask grows with them
-- sizes a fold may take.

The oracle is the live call, recorded by the test's own forward pre/post
hooks on the layer (``trust_oracle.record``: copies of the inputs, the cache
included, taken before the forward ran, the outputs and the arguments as
the forward left them).  Each capture is saved to a ``.pt2``, loaded back
with ``torch.export.load(path).module()`` and run on a copy of the inputs of
EVERY recorded call it claims; its outputs and the cache writes it returns
are compared by value with the live call's.  The report's verdict must agree:
ok exactly when every call is reproduced, and every capture whose saved
fidelity is ok reproduces every call it claims.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from trust_oracle import Call, candidates, differs, false_oks, record

import ctxreplay
from ctxreplay.capture.assigned import write
from ctxreplay.specs.signature import CallSpec, ConstSpec, call_spec, children, tensor_values

pytestmark = [pytest.mark.models,
              pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning")]

WINDOW, PROMPT, NEW_TOKENS = 4, 8, 4
LAYER = "model.layers.0"


def _mistral(impl: str) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.MistralConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        sliding_window=WINDOW, attn_implementation=impl)
    return transformers.MistralForCausalLM(config).eval()


def _generate(model: nn.Module, cache: str) -> torch.Tensor:
    transformers = pytest.importorskip("transformers")
    prompt = torch.randint(1, 128, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    extra = {"past_key_values": transformers.DynamicCache()} if cache == "plain" else {}
    with torch.inference_mode():
        out: torch.Tensor = model.generate(
            prompt, attention_mask=torch.ones(1, PROMPT, dtype=torch.long),
            max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, **extra)
    return out


def _saved_failure(capture: ctxreplay.Capture, program: nn.Module, call: Call) -> str | None:
    """``None`` when the loaded file, run on a copy of ``call``'s inputs
    (its tensor leaves in signature order), returns the live outputs and
    leaves the cache as the live call left it; else what differs."""
    args, kwargs = call.fresh_inputs()
    leaves = [t for a in args for t in tensor_values(a)] + \
        [t for v in kwargs.values() for t in tensor_values(v)]
    try:
        with torch.inference_mode():
            values = tuple(tensor_values(program(*leaves)))
    except Exception as exc:
        return f"raised {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    # the program returns what the forward assigns to the cache last
    n = 0 if capture.assigned is None else len(capture.assigned.tensors)
    if n:
        assert capture.assigned is not None
        write(args, kwargs, capture.assigned, values[-n:])
        values = values[:-n]
    why = differs(call.out, values)
    if why is None and call.after is not None:
        why = differs(tuple(tensor_values(call.after)), tuple(tensor_values((args, kwargs))))
        why = None if why is None else f"the cache after the call: {why}"
        live, got = _plain_state(call.after), _plain_state((args, kwargs))
        if why is None and live != got:
            changed = sorted(k for k in live.keys() | got.keys() if live.get(k) != got.get(k))
            why = f"the cache after the call: {changed[0]} live={live.get(changed[0])!r} " \
                  f"replayed={got.get(changed[0])!r}"
    return why


def _plain_state(value: object, path: str = "", depth: int = 0) -> dict[str, object]:
    """The Python scalars held in ``value``'s containers and plain objects,
    by path (a cache layer's ``cumulative_length``, ``is_initialized``)."""
    if isinstance(value, (bool, int, float, str)) or value is None:
        return {path: value}
    if isinstance(value, torch.Tensor) or depth > 8:
        return {}
    if isinstance(value, (list, tuple)):
        items: Any = enumerate(value)
    elif isinstance(value, dict):
        items = value.items()
    elif hasattr(value, "__dict__") and not isinstance(value, nn.Module):
        items = vars(value).items()
    else:
        return {}
    out: dict[str, object] = {}
    for k, v in items:
        out.update(_plain_state(v, f"{path}[{k!r}]", depth + 1))
    return out


def _claims(report: ctxreplay.CaptureReport, capture: ctxreplay.Capture, call: Call) -> bool:
    """Whether ``capture`` stands for ``call``: it takes the call's tensors
    (``trust_oracle.candidates``: member, context, shapes and dtypes) and the
    call passed the same Python values (the cache's token count among them)."""
    if not any(x is capture for x in candidates(report, call)):
        return False
    return _constants(call_spec(call.args, call.kwargs)) == _constants(capture.signature)


def _constants(spec: Any, path: str = "") -> dict[str, Any]:
    """The Python values a call spec holds, by path (its tensors left out:
    the recorded copies are contiguous where a live cache slice was not)."""
    if isinstance(spec, CallSpec):
        out: dict[str, Any] = {}
        for name, s in spec.items():
            out.update(_constants(s, name))
        return out
    if isinstance(spec, ConstSpec):
        return {path: spec.key}
    kids = children(spec)
    return {k: v for suffix, s in kids or () for k, v in _constants(s, path + suffix).items()}


def _unreproduced(report: ctxreplay.CaptureReport, calls: list[Call], directory: Path
                  ) -> tuple[list[str], list[str], dict[int, bool]]:
    """Every (capture, call) the saved file of the capture does not
    reproduce, for every call it claims; those of them whose capture and
    file both say ok (false OKs); and per call whether some capture whose
    file reproduces it claims it."""
    bad: list[str] = []
    false: list[str] = []
    covered = {i: False for i in range(len(calls))}
    for c in report.captures:
        path = directory / f"v{c.variant}.pt2"
        saved = c.save(path)
        program = torch.export.load(path).module()
        mine = [i for i, call in enumerate(calls) if _claims(report, c, call)]
        assert mine, f"#{c.variant} claims none of the recorded calls"
        for i in mine:
            why = _saved_failure(c, program, calls[i])
            if why is None:
                covered[i] = True
            else:
                bad.append(f"#{c.variant} (fidelity ok={c.fidelity.ok}, saved ok="
                           f"{saved.fidelity.ok}) on call {i}: {why}")
                if c.fidelity.ok and saved.fidelity.ok:
                    false.append(bad[-1])
    return bad, false, covered


@pytest.mark.parametrize("cache", ["default", "plain"])
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_every_saved_variant_reproduces_every_call_it_claims(
        impl: str, cache: str, tmp_path: Path) -> None:
    model = _mistral(impl)
    with record(model, [LAYER]) as calls, \
            ctxreplay.capture_with(model, targets=[LAYER]) as session:
        _generate(model, cache)
    report = session.finalize()
    assert len(calls) == NEW_TOKENS  # the prefill and one call per decode step
    bad, false, covered = _unreproduced(report, calls, tmp_path)
    assert false == []  # a saved file that says ok reproduces every call it claims
    assert report.ok == (not bad and all(covered.values())), (report.summary, bad)
    assert false_oks(report, calls) == []
    if cache == "default":
        # the sliding layers' token count is a Python int the forward reads
        # and writes: each step is a variant of its own, and every one holds
        assert report.ok, (report.summary, bad)
        assert len(report.captures) == NEW_TOKENS
        assert all(c.folding is None for c in report.captures)
    else:
        # the prefill appends the cache's layers (no graph op does that):
        # that capture is not ok, the decode steps are
        assert not report.ok
        assert "appended" in report.summary
        assert bad == [b for b in bad if b.startswith("#0 ")], bad
        assert all(covered[i] for i in range(1, len(calls))), covered
    # the verdict install acts on: the tokens are eager generate()'s
    eager = _generate(_mistral(impl), cache)
    with ctxreplay.install(model, report, object_args="dispatch"):
        assert torch.equal(_generate(model, cache), eager)



def test_control_a_key_blind_to_the_token_count_is_caught(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The oracle can fail: with Python ints left out of the call key (the
    cache's ``cumulative_length`` among them) decode steps share a variant
    (the first step's cache slice has other strides: three variants here),
    whose program writes the count of the step it was traced at.  Its outputs still agree (the
    layer's output does not read the count), so ctxreplay's checks say ok;
    the recorded calls do not."""
    import ctxreplay.specs.signature as signature
    keyed = signature._const_key
    monkeypatch.setattr(signature, "_const_key",
                        lambda v: (int,) if type(v) is int else keyed(v))
    model = _mistral("sdpa")
    with record(model, [LAYER]) as calls, \
            ctxreplay.capture_with(model, targets=[LAYER]) as session:
        _generate(model, "default")
    report = session.finalize()
    assert len(report.captures) < NEW_TOKENS, report.summary
    _, false, _ = _unreproduced(report, calls, tmp_path)
    assert false and all("cumulative_length" in f for f in false), false
