"""An open session and torch.compile: compiled regions are not observed, and
the wrapper adds no graph break or recompilation."""

from __future__ import annotations

import torch
import torch._dynamo
from torch import nn

import ctxreplay


def test_compiled_model_inside_a_session_has_no_graph_break_and_is_not_observed() -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    x = torch.rand(2, 8)
    expected = model(x)
    torch._dynamo.utils.counters.clear()
    try:
        with ctxreplay.capture_with(model, targets=["0", "2"]) as session:
            compiled = torch.compile(model, backend="eager")
            for _ in range(3):
                assert torch.equal(compiled(x), expected)
            model(x)  # an eager call is observed as usual
        report = session.finalize()
        assert not torch._dynamo.utils.counters["graph_break"]
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
        assert sum(c.calls for c in report.captures) == 2  # the two eager block calls
        # ... and the blocks that ran compiled are named, not silently lost
        assert not report.ok
        [problem] = report.problems
        assert (problem.reason, problem.exact, problem.names) == ("not_observed", False,
                                                                  ("0", "2"))
    finally:
        torch._dynamo.reset()
