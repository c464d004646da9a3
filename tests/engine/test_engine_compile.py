"""An open session and torch.compile: compiled regions are not observed, and
the wrapper adds no graph break or recompilation."""

from __future__ import annotations

import torch
import torch._dynamo
from capability import dynamo_breaks_on_a_bound_holder
from torch import nn

import ctxreplay


def _compiled_session() -> tuple[ctxreplay.CaptureReport, int, int]:
    """A session over a model compiled inside it: the report, the graph
    breaks and the unique graphs Dynamo counted."""
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
        counters = torch._dynamo.utils.counters
        return (report, sum(counters["graph_break"].values()),
                counters["stats"]["unique_graphs"])
    finally:
        torch._dynamo.reset()


def test_compiled_model_inside_a_session_is_not_observed_and_is_named() -> None:
    report, _, _ = _compiled_session()
    assert sum(c.calls for c in report.captures) == 2  # the two eager block calls
    # ... and the blocks that ran compiled are named, not silently lost
    assert not report.ok
    [problem] = report.problems
    assert (problem.reason, problem.exact, problem.names) == ("not_observed", False,
                                                              ("0", "2"))


def test_compiled_model_inside_a_session_has_no_graph_break() -> None:
    # on every release, torch 2.7 too, where a forward bound to a plain object
    # that calls what it holds breaks the graph (the control below)
    _, breaks, graphs = _compiled_session()
    assert breaks == 0
    assert graphs == 1


def test_the_reproduction_follows_the_measured_releases() -> None:
    """The control of the no-graph-break case: without ctxreplay, a forward
    bound to a plain object that calls the bound method it holds breaks
    Dynamo's graph on torch 2.7.0 (2.9.1, 2.11.0, 2.13.0, 2.14.1 do not);
    ctxreplay's wrappers do not, there either."""
    from ctxreplay._base.torchcaps import CAPS

    measured = {(2, 7, 0): True, (2, 9, 1): False, (2, 11, 0): False, (2, 13, 0): False,
                (2, 14, 1): False}
    if CAPS.version in measured:
        assert dynamo_breaks_on_a_bound_holder() == measured[CAPS.version]
