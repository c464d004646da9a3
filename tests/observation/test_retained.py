"""The retained calls' budget counts, per member variant, the calls due to
be kept that it did not keep (``Kept.missed``): the value check reads the
count, so a capture is never proven by calls that were not compared."""

from __future__ import annotations

import threading

import torch

from ctxreplay.observation.retained import Kept, Retention

T = torch.zeros(4)  # 16 bytes
CALL = 2 * 16  # a call's input and output


def _call(r: Retention, kept: Kept) -> bool:
    """One call retained into ``kept`` if its inputs fit (False: they did not)."""
    inputs = r.inputs((T,), {}, kept)
    if inputs is None:
        return False
    r.keep(kept, inputs, T)
    return True


def test_a_sample_given_up_for_another_members_first_call_is_missed() -> None:
    r = Retention(2 * CALL, threading.Lock(), sample=True)
    a, b = r.new(), r.new()
    assert _call(r, a) and _call(r, a)  # a's first call, then a sample
    assert len(a.calls()) == 2 and a.missed == 0
    assert _call(r, b)  # b's first call: a's sample makes room for it
    assert len(a.calls()) == 1 and a.missed == 1 and b.missed == 0


def test_outputs_that_do_not_fit_are_missed_and_give_their_inputs_back() -> None:
    r = Retention(CALL + 16, threading.Lock(), sample=True)
    a = r.new()
    assert _call(r, a)
    assert _call(r, a)  # the inputs fit, the outputs do not
    assert len(a.calls()) == 1 and a.missed == 1 and r.held == CALL


def test_values_counts_a_last_call_given_up_for_the_newest() -> None:
    r = Retention(2 * CALL, threading.Lock())
    a = r.new()
    assert _call(r, a) and _call(r, a)  # the first and the last
    assert a.missed == 0
    assert _call(r, a)  # the newest is the last: the old one had no room between
    assert len(a.calls()) == 2 and a.missed == 1


def test_a_sample_the_reservoir_replaces_is_not_missed() -> None:
    # room for everything: what the sample itself gives up is no budget loss
    r = Retention(1 << 20, threading.Lock())
    a = r.new()
    for _ in range(40):
        assert _call(r, a)
    assert len(a.calls()) == 8 and a.missed == 0
