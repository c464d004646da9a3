"""Bounds under adversarial input: a session's tables and memory stay bounded
whatever the live forward throws at it -- every input a new shape, every
step a new forward-context object, more structures than ``max_scopes``."""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import torch
from metadata_check import assert_metadata_only
from torch import nn

import ctxreplay

CALLS = 10_000
MAX_VARIANTS = 8
SLACK = 64 * 1024  # bytes: "a small constant", whatever the number of calls


class Scale(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


class Shift(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1


class Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = Scale()
        self.shift = Shift()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shift(self.scale(x))


def _shape(i: int) -> tuple[int, int]:
    return (i % 100 + 1, i // 100 + 1)  # 10,000 distinct small shapes


_OURS = [tracemalloc.Filter(True, str(Path(ctxreplay.__file__).parent / "*"), all_frames=True)]


def _traced_memory(fn: Callable[[], None]) -> tuple[int, int]:
    """``(all live traced bytes, live bytes allocated under ctxreplay's code)``
    after running ``fn``."""
    fn()
    gc.collect()
    ours = tracemalloc.take_snapshot().filter_traces(_OURS)
    return tracemalloc.get_traced_memory()[0], sum(t.size for t in ours.traces)


def test_ten_thousand_shapes_keep_eight_variants_per_scope_and_bounded_memory() -> None:
    model = Two()
    session = ctxreplay.capture_with(
        model, targets=lambda name, m: isinstance(m, (Scale, Shift)),
        max_variants=MAX_VARIANTS, backend="symbolic")
    calls = iter(range(CALLS))

    def run(n: int) -> None:
        for _ in range(n):
            model(torch.zeros(_shape(next(calls))))

    tracemalloc.start(2)
    try:
        after_100 = _traced_memory(lambda: run(100))
        after_all = _traced_memory(lambda: run(CALLS - 100))
    finally:
        tracemalloc.stop()
    session.close()
    growth, ours = after_all[0] - after_100[0], after_all[1] - after_100[1]
    assert growth < SLACK, f"process memory grew by {growth} bytes over {CALLS - 100} calls"
    assert ours < SLACK, f"ctxreplay's memory grew by {ours} bytes over {CALLS - 100} calls"

    assert len(session.scopes) == 2
    for scope in session.scopes:
        assert len(scope.variants) == MAX_VARIANTS, scope.name
        assert scope.dropped_calls == CALLS - MAX_VARIANTS
    report = session.finalize()
    # the distinct dropped variants are counted exactly up to a bound (256 per
    # scope), so bookkeeping stays constant; the dropped calls always exactly
    assert report.dropped == {"variants": 2 * 256, "variant_calls": 2 * (CALLS - MAX_VARIANTS),
                              "scopes": 0}
    assert len(report.captures) == 2 * MAX_VARIANTS and report.failures == ()
    assert not report.ok
    assert [(p.reason, p.calls, p.exact) for p in report.problems] == [
        ("variant_limit", CALLS - MAX_VARIANTS, False)] * 2
    assert sum(c.calls for c in report.captures) == 2 * MAX_VARIANTS
    print(f"\nadversarial shapes: {CALLS} calls x 2 scopes -> {len(report.captures)} variants "
          f"({MAX_VARIANTS} per scope), dropped {report.dropped}, memory growth {growth} B "
          f"(ctxreplay's own: {ours} B)")
    assert_metadata_only(report.to_json())


class Layers(nn.Module):
    """``n`` linear layers of distinct widths: ``n`` distinct structures."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(i + 1, 1) for i in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([layer(x[..., : i + 1]) for i, layer in enumerate(self.layers)], -1)


def test_scopes_beyond_max_scopes_are_dropped_and_counted() -> None:
    n, max_scopes = 200, 16
    model = Layers(n)
    x = torch.rand(2, n)
    expected = model(x)
    with ctxreplay.capture_with(model, targets="repeated", max_scopes=max_scopes,
                                backend="symbolic") as session:
        for _ in range(3):
            assert torch.equal(model(x), expected)
    assert len(session.scopes) == max_scopes
    wrapped = sum("forward" in m.__dict__ for m in model.layers)
    assert wrapped == 0  # closed
    report = session.finalize()
    assert report.dropped["scopes"] == n - max_scopes
    assert len(report.captures) == max_scopes
    assert all(c.calls == 3 for c in report.captures)
    print(f"\nscopes: {n} structures, max_scopes={max_scopes} -> "
          f"{len(report.captures)} captured, dropped {report.dropped['scopes']}")


def test_dropped_calls_are_not_wrapped_or_slowed() -> None:
    """Modules of dropped scopes keep their own forward: no wrapper at all."""
    model = Layers(8)
    with ctxreplay.capture_with(model, targets="repeated", max_scopes=2,
                                backend="symbolic"):
        assert sum("forward" in m.__dict__ for m in model.layers) == 2


_current: list[object | None] = [None]


def _get() -> object | None:
    return _current[0]


@contextmanager
def _set(value: object) -> Iterator[None]:
    before = _current[0]
    _current[0] = value
    try:
        yield
    finally:
        _current[0] = before


class Step:
    """A framework's per-step forward context: a new object every call."""

    def __init__(self, i: int) -> None:
        self.i = i


def test_a_new_forward_context_every_call_keeps_the_probe_bounded() -> None:
    probe = ctxreplay.probes.ForwardContextProbe(_get, _set, name="step_context", max_held=4)
    model = Scale()
    setter: Callable[[object], AbstractContextManager[Any]] = _set
    session = ctxreplay.capture_with(model, probes=["grad_mode", probe],
                                     max_variants=MAX_VARIANTS, backend="symbolic")
    x = torch.zeros(2, 2)
    calls = iter(range(CALLS))
    # The framework keeps its step objects, so no identity is ever reused.
    history: list[Step] = []

    def run(n: int) -> None:
        for _ in range(n):
            history.append(Step(next(calls)))
            with setter(history[-1]):
                model(x)

    tracemalloc.start(2)
    try:
        after_100 = _traced_memory(lambda: run(100))
        after_all = _traced_memory(lambda: run(CALLS - 100))
    finally:
        tracemalloc.stop()
    session.close()
    ours = after_all[1] - after_100[1]
    assert ours < SLACK, f"ctxreplay's memory grew by {ours} bytes over {CALLS - 100} contexts"
    [scope] = session.scopes
    assert len(scope.variants) <= MAX_VARIANTS
    assert sum(v.calls for v in scope.variants.values()) + scope.dropped_calls == CALLS
    report = session.finalize()
    assert len(report.captures) == 4  # the four held contexts replay and capture
    # every context past max_held is one "not retained" state: one variant, one failure
    assert [(f.reason, f.exc_type) for f in report.failures] == [("replay_failed",
                                                                   "LookupError")]
    assert report.failures[0].context["step_context"] == "not retained"
    print(f"\nforward contexts: {CALLS} distinct -> {len(scope.variants)} variants, "
          f"ctxreplay memory growth {ours} B")
