"""A capture crosses the wire with its program's graph, without weights.

In a distributed report a capture's artifact stays with the rank that made
it; the other ranks receive its graph (``Capture.shared``) and ``install``
rebuilds the program with their own members' weights.  Here one process
plays the receiving rank: a capture as ``from_wire`` makes it (no artifact,
another rank's) is dispatched bit-exact, and one whose graph did not come
is refused with its own reason.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ctxreplay
from ctxreplay.core.registry import get_probe
from ctxreplay.distributed.wire import from_wire, portable, shared_program, to_wire

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("shift", torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) + self.shift


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def _received(report: ctxreplay.CaptureReport) -> list[ctxreplay.Capture]:
    """The report's captures as another rank receives them."""
    probes = {n: get_probe(n) for n in report.probes}
    return [from_wire(portable(to_wire(c.evolve(rank=0))), probes)
            for c in report.captures]


def _calls(model: Stack, x: torch.Tensor) -> list[torch.Tensor]:
    with torch.no_grad():
        a = model(x)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        b = model(x)
    return [a, b]


@pytest.fixture
def captured() -> tuple[Stack, torch.Tensor, list[torch.Tensor], ctxreplay.CaptureReport]:
    torch.manual_seed(0)
    model = Stack().eval()
    x = torch.rand(2, 8)
    with ctxreplay.capture_with(model, targets="repeated") as session:
        eager = _calls(model, x)
    return model, x, eager, session.finalize()


def test_a_capture_from_another_rank_is_rebuilt_with_this_ranks_weights(
        captured: tuple[Stack, torch.Tensor, list[torch.Tensor], ctxreplay.CaptureReport]
) -> None:
    model, x, eager, report = captured
    received = _received(report)
    assert all(c.artifact is None and c.shared is not None for c in received)
    assert all(c.shared is not None and len(c.shared[1]) < 100_000 for c in received)
    with ctxreplay.install(model, received) as handle:
        installed = _calls(model, x)
    stats = handle.stats()
    assert sum(stats.hits.values()) == 6 and not stats.reasons, stats
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(eager, installed))
    # the receiving rank's report stays metadata only, its artifacts absent
    assert all("shared" not in c.to_json() for c in received)


def test_a_capture_whose_graph_did_not_come_is_refused_as_not_on_this_rank(
        captured: tuple[Stack, torch.Tensor, list[torch.Tensor], ctxreplay.CaptureReport]
) -> None:
    model, x, eager, report = captured
    received = [c.evolve(shared=None) for c in _received(report)]
    with ctxreplay.install(model, received) as handle:
        installed = _calls(model, x)
    stats = handle.stats()
    assert not stats.hits or not sum(stats.hits.values())
    assert stats.reasons == {"not_on_this_rank": 6}, stats
    assert set(stats.unusable.values()) == {"not_on_this_rank"}
    assert all(torch.equal(a, b) for a, b in zip(eager, installed))


def test_a_graph_naming_a_tensor_this_rank_lacks_is_not_rebuildable(
        captured: tuple[Stack, torch.Tensor, list[torch.Tensor], ctxreplay.CaptureReport]
) -> None:
    model, x, _eager, report = captured
    received = _received(report)
    for b in model.blocks:
        del b.shift  # this rank's blocks lack the buffer the graph reads
        b.shift = torch.ones(8)  # a plain attribute now
    with ctxreplay.install(model, received) as handle:
        _calls(model, x)
    assert set(handle.stats().unusable.values()) <= {"not_rebuildable"}
    assert handle.stats().unusable


def test_a_dynamo_graph_module_is_not_sent() -> None:
    gm = torch.fx.symbolic_trace(nn.Linear(2, 2))
    assert shared_program(gm) is None
    assert shared_program(None) is None
