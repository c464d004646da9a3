"""A forward that assigns new tensors and constants to its argument objects.

The program returns the assigned tensors after its outputs; the checks
compare them with the member's own; an installed call assigns them (and the
constants) to the live objects.  The oracle is the eager forward on an equal
object: the same attributes, equal tensors.
"""

from __future__ import annotations

import torch
from torch import nn

import ctxreplay
from ctxreplay.capture.assigned import assigned_by, read, write
from ctxreplay.capture.mutation import arguments_state


class Layer:
    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.ready = False


class Cache:
    def __init__(self) -> None:
        self.layers = [Layer()]


class Grows(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, cache: Cache) -> torch.Tensor:
        layer = cache.layers[0]
        if not layer.ready:  # a lazy set-up: a constant and a tensor assigned
            layer.ready = True
            layer.keys = torch.zeros(1, 0, 4)
        assert layer.keys is not None
        layer.keys = torch.cat([layer.keys, self.lin(x)], dim=1)
        out: torch.Tensor = layer.keys.sum(1)
        return out


def _steps(model: nn.Module, cache: Cache, n: int = 3) -> list[torch.Tensor]:
    torch.manual_seed(1)
    with torch.no_grad():
        return [model(torch.rand(1, 1, 4), cache) for _ in range(n)]


def test_the_assigned_paths_and_constants_of_a_run() -> None:
    cache = Cache()
    before, held = arguments_state((cache,), {})
    cache.layers[0].keys = torch.ones(1)
    cache.layers[0].ready = True
    found = assigned_by((cache,), {}, before)
    del held
    assert found is not None
    assert ["".join(p) for p in found.tensors] == ["args[0].layers[0].keys"]
    assert [("".join(p), v) for p, v in found.constants] == [("args[0].layers[0].ready", True)]
    other = Cache()
    write((other,), {}, found, [torch.full((1,), 2.0)])
    assert other.layers[0].ready is True
    assert torch.equal(read((other,), {}, found.tensors[0]), torch.full((1,), 2.0))


def test_an_append_is_no_assignment() -> None:
    cache = Cache()
    before, held = arguments_state((cache,), {})
    cache.layers.append(Layer())
    assert assigned_by((cache,), {}, before) is None
    del held


def test_a_growing_cache_is_captured_and_installed_writes_it() -> None:
    torch.manual_seed(0)
    model = Grows()
    eager_cache = Cache()
    eager = _steps(model, eager_cache)
    with ctxreplay.capture_with(model) as session:
        _steps(model, Cache())
    report = session.finalize()
    assert report.ok, report.summary
    # the first call (lazy set-up) and each length are variants of their own
    assert len(report.captures) == 3
    first = report.captures[0]
    assert first.assigned is not None
    assert [("".join(p), v) for p, v in first.assigned.constants] == \
        [("args[1].layers[0].ready", True)]
    with ctxreplay.install(model, report, object_args="dispatch") as handle:
        cache = Cache()
        got = _steps(model, cache)
        assert handle.stats().total_hits == 3
    assert all(torch.equal(a, b) for a, b in zip(got, eager, strict=True))
    assert cache.layers[0].ready is True
    assert cache.layers[0].keys is not None and eager_cache.layers[0].keys is not None
    assert torch.equal(cache.layers[0].keys, eager_cache.layers[0].keys)
