"""Variant keys of non-tensor arguments, and outputs whose size depends on data."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

import ctxreplay


class StepMeta:
    """A framework's per-step metadata: a fresh object every call, compared by
    identity (no __eq__), with scalar fields that do shape the graph."""

    def __init__(self, scale: int, mode: str) -> None:
        self.scale = scale
        self.mode = mode


class UsesMeta(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, meta: StepMeta) -> torch.Tensor:
        y = self.lin(x) * meta.scale
        return y.relu() if meta.mode == "prefill" else y


def test_fresh_metadata_objects_with_equal_fields_share_a_variant() -> None:
    model = UsesMeta()
    with ctxreplay.capture_with(model, verify="execute") as session:
        for _ in range(5):
            model(torch.rand(2, 4), StepMeta(2, "prefill"))
        model(torch.rand(2, 4), StepMeta(3, "prefill"))  # another scalar value ...
        model(torch.rand(2, 4), StepMeta(2, "decode"))  # ... another mode
    report = session.finalize()
    assert report.ok, (report.failures, [c.fidelity for c in report.captures])
    assert sorted(c.calls for c in report.captures) == [1, 1, 5]
    assert all(c.binding == "flattened" for c in report.captures)


def test_callables_are_keyed_by_identity_not_structure() -> None:
    class Apply(nn.Module):
        def forward(self, x: torch.Tensor, fn: object) -> torch.Tensor:
            return fn(x)  # type: ignore[operator, no-any-return]

    model = Apply()
    with ctxreplay.capture_with(model, backend="export") as session:
        model(torch.rand(3), torch.relu)
        model(torch.rand(3), torch.sigmoid)
    assert len(session.finalize().captures) == 2


class Positives(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x[x > 0.5] * 2).to(torch.float64)


def test_data_dependent_output_size_is_not_a_mismatch_but_dtype_still_is() -> None:
    model = Positives()
    with ctxreplay.capture_with(model, backend="export", verify="execute") as session:
        model(torch.rand(64))
    capture = session.finalize().captures[0]
    assert capture.fidelity.ok, capture.fidelity.mismatches
    assert capture.fidelity.checked == ("signature", "execute")
    # the graph leaves that size symbolic: any size matches it, a dtype does not
    from ctxreplay.fidelity.compare import compare_specs, symbolic_dims
    from ctxreplay.fidelity.verify import flat_tensor_spec
    from ctxreplay.specs.signature import TensorSpec

    free = symbolic_dims(flat_tensor_spec(capture.graph_outputs))  # type: ignore[arg-type]
    assert free == {"out[0]": frozenset({0})}
    live = TensorSpec((17,), (1,), torch.float64, "cpu")
    other = TensorSpec((40,), (1,), torch.float32, "cpu")
    found = compare_specs(live, other, free_dims={"out": frozenset({0})})
    assert [m.field for m in found] == ["dtype"]
    assert [m.field for m in compare_specs(live, other)] == ["dtype", "shape"]


class Pair:
    """Registered with torch's pytree, flattening in the reverse of its
    attribute order: leaves must follow the pytree, not ``__dict__``."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor) -> None:
        self.a = a
        self.b = b


@dataclasses.dataclass
class Holder:
    pair: Pair
    bias: torch.Tensor


class UsesHolder(nn.Module):
    def forward(self, h: Holder) -> torch.Tensor:
        return h.pair.a.sum(-1) * 2 + h.pair.b.float() + h.bias


def test_flattened_leaves_follow_the_pytree_order_of_registered_types() -> None:
    import torch.utils._pytree as pytree

    pytree.register_pytree_node(
        Pair, lambda p: ([p.b, p.a], None), lambda xs, _ctx: Pair(xs[1], xs[0]))
    try:
        model = UsesHolder()
        h = Holder(Pair(torch.rand(3, 5), torch.arange(3)), torch.rand(3))
        with ctxreplay.capture_with(model, backend="export", verify="execute") as session:
            live = model(h)
        capture = session.finalize().captures[0]
        assert capture.binding == "flattened"
        assert capture.fidelity.ok, capture.fidelity.mismatches
        assert [p for p, _ in capture.signature.leaves()] == [
            "args[0].pair.<0>", "args[0].pair.<1>", "args[0].bias"]
        # the artifact takes the leaves in that order: b (int64), a (3x5), bias
        out = capture.artifact.module()(torch.arange(3), torch.ones(3, 5), torch.zeros(3))
        assert out.shape == live.shape and torch.equal(out, torch.arange(3) + 10.0)
    finally:
        pytree._deregister_pytree_node(Pair)
