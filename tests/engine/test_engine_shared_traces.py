"""One trace per graph, not per layer: members of a stack that differ only in
plain attributes their forward never reads (a decoder layer's ``layer_idx``
indexing a cache the call did not get) are served by one trace, each still
checked with its own weights; an attribute the trace read -- in the
forward, in a branch, in a submodule, through ``vars()`` -- keeps a trace
per member, and identical graphs are merged as before.  Sizes that fold:
one fold serves every layer the same way.

Each test records what really ran (tests/helpers/trust_oracle.py) and
replays every call through the capture that claims it, with that member's
weights, by value."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from capability import FOLDS
from engine_models import CountingExport
from torch import nn
from trust_oracle import members_of, record, unreproduced

import ctxreplay

# torch's own export internals warn about a deprecated pytree spelling
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

DIM = 16
DEPTH = 6


class Layer(nn.Module):
    """A decoder layer: ``layer_idx`` is only read where a cache is passed."""

    def __init__(self, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, cache: list[torch.Tensor] | None = None
                ) -> torch.Tensor:
        y = x + torch.relu(self.proj(x))
        if cache is not None:
            cache[self.layer_idx] = y
        return y


class Scaled(Layer):
    def forward(self, x: torch.Tensor, cache: Any = None) -> torch.Tensor:
        return self.proj(x) * (1 + self.layer_idx)


class Branching(Layer):
    def forward(self, x: torch.Tensor, cache: Any = None) -> torch.Tensor:
        if self.layer_idx % 2:
            return torch.relu(self.proj(x))
        return torch.sigmoid(self.proj(x))


class Introspecting(Layer):
    """Reads its whole ``__dict__``: every attribute counts as read."""

    def forward(self, x: torch.Tensor, cache: Any = None) -> torch.Tensor:
        shift = sum(v for v in vars(self).values() if isinstance(v, int))
        return self.proj(x) + shift


class Inner(nn.Linear):
    def __init__(self, idx: int) -> None:
        super().__init__(DIM, DIM)
        self.idx = idx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * (1 + self.idx)


class Nested(nn.Module):
    """The attribute lives on a submodule, read by that submodule's forward."""

    def __init__(self, layer_idx: int) -> None:
        super().__init__()
        self.sub = Inner(layer_idx)

    def forward(self, x: torch.Tensor, cache: Any = None) -> torch.Tensor:
        return self.sub(x)


class Decoder(nn.Module):
    def __init__(self, kind: type[nn.Module], depth: int = DEPTH) -> None:
        super().__init__()
        self.layers = nn.ModuleList([kind(i) for i in range(depth)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _live(kind: type[nn.Module], backend: Any = None, depth: int = DEPTH,
          **options: Any) -> tuple[ctxreplay.CaptureReport, list[Any]]:
    torch.manual_seed(0)
    model = Decoder(kind, depth).eval()
    with record(model, members_of(model, "layers")) as calls, \
            ctxreplay.capture_with(model, targets="repeated", backend=backend or "export",
                                   **options) as session, torch.no_grad():
        model(torch.rand(2, 5, DIM))
    return session.finalize(), calls


@pytest.mark.parametrize("verify", ["signature", "execute"])
def test_layers_differing_in_an_unread_index_cost_one_trace(verify: str) -> None:
    backend = CountingExport()
    report, calls = _live(Layer, backend, verify=verify)
    assert len(backend.calls) == 1  # one per layer before
    assert report.ok and not report.failures
    (c,) = report.captures
    assert c.members == tuple(f"layers.{i}" for i in range(DEPTH))
    # every member was checked against the graph, not taken on trust
    assert c.fidelity.ok and c.fidelity.members == DEPTH
    assert dict(c.member_calls) == {m: 1 for m in c.members}
    assert unreproduced(report, calls) == []


@pytest.mark.parametrize("kind", [Scaled, Branching, Introspecting, Nested])
def test_an_attribute_the_trace_read_keeps_a_trace_per_member(kind: type[nn.Module]) -> None:
    backend = CountingExport()
    report, calls = _live(kind, backend, verify="execute")
    assert len(backend.calls) == DEPTH
    # verify="execute": each member's graph run against the member itself
    assert report.ok and not report.failures
    assert unreproduced(report, calls) == []
    members = sorted(c.members for c in report.captures)
    if kind is Branching:  # two graphs, each standing for its members
        assert members == [("layers.0", "layers.2", "layers.4"),
                           ("layers.1", "layers.3", "layers.5")]
    else:
        assert members == [(f"layers.{i}",) for i in range(DEPTH)]


def test_the_index_read_only_outside_export_is_caught_by_each_members_check() -> None:
    """A forward that reads the attribute only in eager (``is_exporting()``
    false) makes a graph that does not depend on it: one trace serves no
    member its check does not pass, and the report says which are wrong."""

    class EagerOnly(Layer):
        def forward(self, x: torch.Tensor, cache: Any = None) -> torch.Tensor:
            if torch.compiler.is_exporting():
                return self.proj(x)
            return self.proj(x) * (1 + self.layer_idx)

    report, _ = _live(EagerOnly, depth=3, verify="execute")
    assert not report.ok
    bad = {c.members for c in report.captures if not c.fidelity.ok}
    assert bad == {("layers.1",), ("layers.2",)}
    good = [c for c in report.captures if c.fidelity.ok]
    assert [c.members for c in good] == [("layers.0",)]


def test_members_in_another_training_mode_are_traced_on_their_own() -> None:
    backend = CountingExport()
    torch.manual_seed(0)
    model = Decoder(Layer, 4).eval()
    model.layers[3].train()
    with ctxreplay.capture_with(model, targets="repeated", backend=backend,
                                verify="execute") as session, torch.no_grad():
        model(torch.rand(2, 5, DIM))
    report = session.finalize()
    assert report.ok and len(backend.calls) == 2
    # (no layer holds dropout: the two graphs are the same, merged as before)
    assert [c.members for c in report.captures] == [tuple(f"layers.{i}" for i in range(4))]


def test_dynamo_traces_each_member_and_is_not_disturbed() -> None:
    """Dynamo interprets the bytecode (and refuses a Python
    ``__getattribute__``): nothing is recorded, each member is traced."""
    calls: list[int] = []
    original = torch._dynamo.export

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch._dynamo, "export", counting)
        report, _ = _live(Layer, "dynamo", depth=3, verify="execute")
    assert report.ok and not report.failures
    assert {c.backend for c in report.captures} == {"dynamo"}
    assert len(calls) == 3
    assert sum(len(c.members) for c in report.captures) == 3


#: unfolded (torch 2.7) each of 4 layers is a variant at each of 3 sizes:
#: room for all 12, so the sharing, not the limit, is what is seen
UNFOLDED_BUDGET: dict[str, Any] = {} if FOLDS else {"max_variants": 12}


def _folded_live(kind: type[nn.Module], monkeypatch: pytest.MonkeyPatch
                 ) -> tuple[ctxreplay.CaptureReport, list[Any], int]:
    """Four layers, each called at three prompt lengths (sizes fold)."""
    exports: list[int] = []
    real = torch.export.export

    def counting(*args: Any, **kwargs: Any) -> Any:
        exports.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.export, "export", counting)
    torch.manual_seed(0)
    model = Decoder(kind, 4).eval()
    with record(model, members_of(model, "layers")) as calls, \
            ctxreplay.capture_with(model, targets="repeated", backend="export",
                                   verify="execute", **UNFOLDED_BUDGET) as session, \
            torch.no_grad():
        for t in (5, 7, 9):
            model(torch.rand(2, t, DIM))
    return session.finalize(), calls, len(exports)


def test_one_fold_serves_every_layers_sizes(monkeypatch: pytest.MonkeyPatch) -> None:
    report, calls, exports = _folded_live(Layer, monkeypatch)
    assert report.ok and not report.failures
    every = tuple(f"layers.{i}" for i in range(4))
    if not FOLDS:  # no fold: one trace per size, still serving every layer
        assert exports == 3
        assert [(c.members, c.calls, c.folding) for c in report.captures] == [
            (every, 4, None)] * 3
        assert unreproduced(report, calls) == []
        return
    assert exports == 1  # a fold per layer before
    (c,) = report.captures
    assert c.folding is not None and c.members == every
    assert c.calls == 12 and c.fidelity.members == 4
    assert unreproduced(report, calls) == []


def test_a_fold_that_read_the_index_serves_no_other_layer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    report, calls, exports = _folded_live(Scaled, monkeypatch)
    sizes = 1 if FOLDS else 3  # a fold per layer, or a trace per size and layer
    assert exports == 4 * sizes
    assert report.ok and not report.failures
    assert sorted(c.members for c in report.captures) == sorted(
        [(f"layers.{i}",) for i in range(4)] * sizes)
    assert all((c.folding is not None) is FOLDS for c in report.captures)
    assert unreproduced(report, calls) == []


def test_a_strict_export_records_nothing_and_traces_each_member(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Strict export runs the forward under Dynamo, which interprets the
    bytecode: no read is seen, so no graph is served to another member."""
    from ctxreplay.backends import ExportBackend

    exports: list[int] = []
    real = torch.export.export

    def counting(*args: Any, **kwargs: Any) -> Any:
        exports.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.export, "export", counting)
    report, _ = _live(Layer, ExportBackend(strict=True), depth=3, verify="execute")
    assert report.ok and not report.failures
    assert len(exports) == 3
