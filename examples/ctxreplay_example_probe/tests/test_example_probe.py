"""The example package's probe, tested the way a downstream package would:
with ``ctxreplay.testing.check_probe`` and a model whose forward reads the
framework's forward context."""

from __future__ import annotations

import pytest
import torch
from ctxreplay_example_probe import (
    ForwardContext,
    get_forward_context,
    probe,
    set_forward_context,
)

import ctxreplay
from ctxreplay.testing import check_probe, leak_check


class Scaled(torch.nn.Module):
    """A block whose output depends on ambient framework state."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * get_forward_context().scale


def _observe(ctx: ForwardContext) -> object:
    with set_forward_context(ctx):
        return probe.observe()


def test_the_probe_is_registered_through_its_entry_point() -> None:
    assert ctxreplay.probes.get_probe("example_forward_context") is probe
    info = ctxreplay.probes.available_probes()["example_forward_context"]
    assert info.origin == "entry_point"
    assert info.distribution == "ctxreplay-example-probe"


def test_check_probe() -> None:
    unset = probe.observe()
    flash, sdpa = ForwardContext("flash", 0.5), ForwardContext("sdpa", 2.0)
    check_probe(probe, [_observe(flash), _observe(sdpa)], neutral=unset)


def test_equal_contexts_share_a_state() -> None:
    # The probe's key is (attn_backend, scale): a new but equal context per
    # step is the same variant.
    a = _observe(ForwardContext("flash", 0.5))
    b = _observe(ForwardContext("flash", 0.5))
    c = _observe(ForwardContext("flash", 1.0))
    assert a == b and a != c
    probe.clear()


def test_a_replayed_context_reproduces_the_live_forward() -> None:
    torch.manual_seed(0)
    model = Scaled()
    x = torch.rand(2, 4)
    with set_forward_context(ForwardContext("flash", scale=3.0)):
        live = model(x)
        snap = ctxreplay.snapshot(["example_forward_context",
                                   *ctxreplay.probes.default_probes()])

    # Later, outside the live forward: the context is gone ...
    with pytest.raises(AssertionError, match="forward context is not set"):
        model(x)
    # ... and replaying the snapshot brings it back.
    with leak_check("replay", probes=["example_forward_context"]), snap.replay():
        assert get_forward_context().scale == 3.0
        torch.testing.assert_close(model(x), live)
        with set_forward_context(ForwardContext("flash", scale=1.0)):
            assert not torch.allclose(model(x), live)  # the context matters

    # Live states are not portable: the document marks them.
    doc = snap.to_json()
    assert doc["probes"]["example_forward_context"]["portable"] is False
    unresolved = ctxreplay.ContextSnapshot.from_json(doc).unresolved
    assert unresolved == ("example_forward_context",)

    probe.clear()
    with pytest.raises(LookupError), snap.replay():
        pass
