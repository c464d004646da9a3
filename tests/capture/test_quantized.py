"""Quantized weights (wrapper tensor subclasses) are captured, checked at
every level and dispatched.

A quantized Linear weight is a wrapper subclass: torchao's ``Int8Tensor``
(``Int8WeightOnlyConfig``) or a hand-written int8 wrapper
(``quantized.Int8Weight``).  It has no storage of its own: reading
``untyped_storage().data_ptr()`` raises "Attempted to access the data
pointer on an invalid python storage", and ``torch.equal`` on it may be an
operator the subclass never implemented.  ctxreplay's own bookkeeping
(the watch that puts back weights a check run writes) did read it, so at
``verify="execute"`` every capture was reported as the program's mismatch
(``live='ran', captured='RuntimeError'``) although each program ran to the
eager output bit for bit.  The oracle is eager: the model's own outputs.
"""

from __future__ import annotations

import pytest
import torch
from quantized import KINDS, Int8Weight, QStack, stack_or_skip

import ctxreplay
import ctxreplay.capture.rngguard as rngguard
from ctxreplay.capture.rngguard import rng_guard

pytestmark = [pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]


def _calls(model: QStack, x: torch.Tensor) -> list[torch.Tensor]:
    """Three contexts: no_grad float32, bf16 autocast, bf16 autocast under no_grad."""
    outs = []
    with torch.no_grad():
        outs.append(model(x))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outs.append(model(x))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        outs.append(model(x))
    return outs


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("verify", ["signature", "execute", "values"])
def test_quantized_weights_are_checked_and_dispatched_bit_exact(kind: str, verify: str) -> None:
    model = stack_or_skip(kind)
    assert isinstance(model.blocks[0].fc1.weight, torch.Tensor)
    assert type(model.blocks[0].fc1.weight) is not torch.nn.Parameter  # a wrapper subclass
    x = torch.randn(2, 4, 16)
    with ctxreplay.capture_with(model, targets="repeated", verify=verify) as session:
        eager = _calls(model, x)
    report = session.finalize()
    assert report.ok, (report.failures, [c.fidelity.mismatches for c in report.captures])
    assert not report.failures
    assert all(c.fidelity.ok and c.fidelity.level == verify for c in report.captures)
    with ctxreplay.install(model, report) as handle:
        installed = _calls(model, x)
    stats = handle.stats()
    assert sum(stats.hits.values()) == 3 * 3, stats
    assert not stats.reasons, stats
    for a, b in zip(eager, installed):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_a_check_run_writing_into_a_quantized_weight_is_put_back() -> None:
    """The watch finds a write into a wrapper weight's inner tensor and puts
    it back; it used to raise on the wrapper's storage before anything ran."""
    model = stack_or_skip("int8")
    weight = model.blocks[0].fc1.weight
    assert isinstance(weight, Int8Weight)
    before = weight.qdata.clone()
    with rng_guard(weights=model) as written:
        weight.qdata.add_(1)
    assert torch.equal(weight.qdata, before)
    assert list(written.values()) == ["blocks.0.fc1.weight"]


def test_a_failure_of_ctxreplays_own_watch_is_its_own_reason_not_a_mismatch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the watch around a check run fails, the program is not to blame:
    the capture fails ``verify_failed`` (the check could not run), never a
    mismatch of the user's program."""
    model = stack_or_skip("int8", depth=2)
    x = torch.randn(2, 4, 16)

    def broken(t: torch.Tensor) -> int:
        raise RuntimeError("storage of an unknown kind")

    monkeypatch.setattr(rngguard, "storage_ptr", broken)
    with ctxreplay.capture_with(model, targets="repeated", verify="execute") as session, \
            torch.no_grad():
        model(x)
    report = session.finalize()
    assert not report.ok
    assert not report.captures
    assert {f.reason for f in report.failures} == {"verify_failed"}
    assert [f.exc_type for f in report.failures] == ["BookkeepingError"], report.failures
