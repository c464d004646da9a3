"""What is captured (targets, scopes, bounds) and with what (backends)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from capability import FOLDS
from engine_models import BF16, F32, Block, CountingExport, MatmulBlock, Stack, bf16, out_dtypes
from metadata_check import finalize_checked
from torch import nn

import ctxreplay
from ctxreplay.observation.targets import resolve_targets
from ctxreplay.specs.signature import TensorSpec, flatten_spec

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

SMALL = ["blocks.0", "blocks.1", "blocks.2"]  # Block(16, 32)
WIDE = ["blocks.3", "blocks.4"]  # Block(16, 64)


def _live(model: nn.Module) -> None:
    """Three distinct block signatures/contexts, one of them seen twice."""
    model(torch.rand(2, 16))
    model(torch.rand(2, 16))
    model(torch.rand(3, 16))
    with bf16():
        model(torch.rand(2, 16))


# -- 8. targets ----------------------------------------------------------------------

def test_repeated_groups_identical_blocks_and_captures_each_variant_once() -> None:
    model = Stack()
    backend = CountingExport()
    with ctxreplay.capture_with(model, targets="repeated", backend=backend) as s:
        _live(model)
    report = finalize_checked(s)
    assert report.ok and not report.failures

    scopes = {c.scope: c.members for c in report.captures}
    assert sorted(scopes.values()) == [tuple(SMALL), tuple(WIDE)]
    # 2 structures x 3 distinct (input signature, snapshot): 6 captures, and
    # exactly one backend call each -- not one per member or per live call
    assert len(report.captures) == 6
    assert len(backend.calls) == 6
    keys = {(c.scope, c.signature, c.snapshot) for c in report.captures}
    assert len(keys) == 6
    # calls count every member's live call of the variant
    small = sorted((c for c in report.captures if c.members == tuple(SMALL)),
                   key=lambda c: c.variant)
    assert [c.calls for c in small] == [3 * 2, 3, 3]
    assert [c.snapshot.describe()["autocast"] for c in small] == ["off", "off", "cpu:bfloat16"]
    # under autocast the block input is already bfloat16 and so is the graph
    assert out_dtypes(small[2].graph_outputs) == [BF16]
    assert out_dtypes(small[0].graph_outputs) == [F32]
    assert report.settings["targets"] == "repeated"


def test_repeated_without_a_homogeneous_stack_is_an_error() -> None:
    with pytest.raises(ValueError, match="ModuleList"):
        ctxreplay.capture_with(MatmulBlock(), targets="repeated")


def test_targets_by_name() -> None:
    model = Stack()
    with ctxreplay.capture_with(model, targets=["blocks.0", "head"], backend="export") as s:
        _live(model)
    report = finalize_checked(s)
    assert {c.members for c in report.captures} == {("blocks.0",), ("head",)}
    # per member: rows 2 and 3 under one context fold into one graph, beside
    # the autocast variant: 4 captures standing for the 6 variants (6 where
    # ctxreplay does not fold)
    assert len(report.captures) == (4 if FOLDS else 6) and report.ok
    assert sorted(len(c.folded) for c in report.captures) == (
        [0, 0, 1, 1] if FOLDS else [0] * 6)
    assert "forward" not in model.blocks[0].__dict__
    assert "forward" not in model.head.__dict__


@pytest.mark.parametrize(("name", "near"), [("blocks.O", "blocks.0"), ("hed", "head"),
                                           ("block.3.up", "blocks.3.up")])
def test_an_unknown_target_name_lists_near_matches(name: str, near: str) -> None:
    model = Stack()
    with pytest.raises(ValueError, match=repr(name).replace(".", r"\.")) as info:
        ctxreplay.capture_with(model, targets=[name])
    assert repr(near) in str(info.value)
    assert all("forward" not in m.__dict__ for m in model.modules())  # nothing attached


def test_targets_by_predicate() -> None:
    model = Stack()
    backend = CountingExport()

    def ups(name: str, module: nn.Module) -> bool:
        return name.endswith(".up")

    with ctxreplay.capture_with(model, targets=ups, backend=backend) as s:
        model(torch.rand(2, 16))
    report = finalize_checked(s)
    # Linear(16, 32) x3 and Linear(16, 64) x2: two scopes, one capture each
    assert sorted(c.members for c in report.captures) == [
        tuple(f"{m}.up" for m in SMALL), tuple(f"{m}.up" for m in WIDE)]
    assert len(backend.calls) == 2
    assert report.settings["targets"] == "predicate"


def test_max_variants_drops_and_counts() -> None:
    model = Stack()
    backend = CountingExport()
    with ctxreplay.capture_with(model, targets="repeated", backend=backend,
                                max_variants=1) as s:
        _live(model)
    report = finalize_checked(s)
    assert len(report.captures) == 2 and len(backend.calls) == 2
    assert all(c.variant == 0 for c in report.captures)
    # each scope dropped two variants: (3,16) and the autocast call
    assert report.dropped["variants"] == 4
    assert not report.ok and [p.reason for p in report.problems] == ["variant_limit"] * 2
    assert report.dropped["variant_calls"] == (3 + 3) + (2 + 2)
    assert report.dropped["scopes"] == 0


def test_max_scopes_drops_and_counts() -> None:
    model = Stack()
    with ctxreplay.capture_with(model, targets="repeated", backend="export",
                                max_scopes=1) as s:
        model(torch.rand(2, 16))
    report = finalize_checked(s)
    assert [c.members for c in report.captures] == [tuple(SMALL)]
    assert report.dropped["scopes"] == 1
    # the dropped scope's members were never wrapped
    assert all("forward" not in model.blocks[i].__dict__ for i in (3, 4))


@pytest.mark.parametrize("bad", [0, -1, 1.5, None])
def test_bounds_are_validated(bad: Any) -> None:
    with pytest.raises(ValueError, match="max_variants"):
        ctxreplay.capture_with(Block(), max_variants=bad)
    with pytest.raises(ValueError, match="max_scopes"):
        ctxreplay.capture_with(Block(), max_scopes=bad)


# -- 9. backends -----------------------------------------------------------------------

def _static_shapes(spec: Any) -> list[tuple[Any, ...]]:
    return [s.shape for s in flatten_spec(spec) if isinstance(s, TensorSpec)]


@pytest.mark.parametrize(("backend", "used"), [("export", "export"), ("dynamo", "dynamo"),
                                               ("symbolic", "symbolic"), ("auto", "export")])
def test_each_builtin_backend_captures_a_simple_model(backend: str, used: str) -> None:
    model = MatmulBlock()
    with ctxreplay.capture_with(model, backend=backend) as s:
        with bf16():
            model(torch.rand(4, 16))
        model(torch.rand(2, 16))
    report = finalize_checked(s)
    assert not report.failures, report.failures
    assert [c.backend for c in report.captures] == [used, used]
    assert report.settings["backend"] == backend
    assert [out_dtypes(c.graph_outputs) for c in report.captures] == [[BF16], [F32]]
    # static shapes, like the live call (dynamo would make them symbolic)
    assert [_static_shapes(c.graph_outputs) for c in report.captures] == [[(4, 4)], [(2, 2)]]
    assert all(type(d) is int for c in report.captures
               for shape in _static_shapes(c.graph_outputs) for d in shape)
    if used == "symbolic":
        # its graph holds no autocast: the bf16 variant's program does not
        # reproduce its call alone (the default runs it and says so), and does
        # with autocast around it
        bf, plain = report.captures
        assert not bf.fidelity.ok and bf.fidelity.ok_with_needs
        assert bf.ambient_only == ("autocast",) and plain.fidelity.ok
    else:
        assert report.ok
    assert all(c.attempts == () for c in report.captures)


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.lin(x)
        return -self.lin(x)


EXPECTED_CODES = {
    "export": "data_dependent_control_flow",
    "dynamo": "unsupported_graph",
    "symbolic": "dynamic_python_control_flow",
}


@pytest.mark.parametrize("backend", ["export", "dynamo", "symbolic"])
def test_data_dependent_control_flow_fails_each_tracer_with_its_code(backend: str) -> None:
    model = DataDependent()
    x = torch.rand(2, 8)
    with ctxreplay.capture_with(model, backend=backend) as s:
        out = model(x)
    assert torch.equal(out, model(x))
    report = finalize_checked(s)
    assert report.captures == ()
    (f,) = report.failures
    assert (f.backend, f.reason) == (backend, EXPECTED_CODES[backend])
    assert f.exc_type != "-"


def test_auto_records_every_failed_attempt() -> None:
    model = DataDependent()
    with ctxreplay.capture_with(model, backend="auto") as s:
        model(torch.rand(2, 8))
    report = finalize_checked(s)
    (f,) = report.failures
    assert f.backend == "auto"
    assert [(b, code) for b, code, _ in f.attempts] == list(EXPECTED_CODES.items())
    assert f.reason == "data_dependent_control_flow"  # the most specific code wins


@torch.fx.wrap
def _gate(x: torch.Tensor) -> torch.Tensor:
    # data-dependent, so export and dynamo fail; symbolic tracing keeps it a leaf call
    return x if x.sum() > 0 else -x


class Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _gate(self.lin(x))


def test_auto_falls_back_and_keeps_the_replay_faithful() -> None:
    model = Gated()
    with ctxreplay.capture_with(model, backend="auto", verify="execute") as s, bf16():
        live = model(torch.rand(2, 8))
    report = finalize_checked(s)
    assert not report.failures, report.failures
    (c,) = report.captures
    assert c.backend == "symbolic"
    assert [(b, code) for b, code, _ in c.attempts] == [
        ("export", "data_dependent_control_flow"), ("dynamo", "unsupported_graph")]
    # symbolic records no context: the replay was applied around it, so its
    # outputs are right, and the report says the artifact does not carry it
    assert out_dtypes(c.graph_outputs) == [live.dtype] == [BF16]
    assert c.embedded == () and "autocast" in c.ambient_only
    assert [(m.level, m.field) for m in c.fidelity.mismatches] == [("execute", "dtype")]
    assert "autocast" in (c.fidelity.mismatches[0].hint or "")


class UserExport:
    """A user's backend: only ``capture`` (the engine fills in the rest)."""

    name = "user_export"

    def __init__(self) -> None:
        self.calls = 0

    def capture(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.calls += 1
        return torch.export.export(module, args, kwargs or None, strict=False)


def test_a_user_supplied_backend_object() -> None:
    model = MatmulBlock()
    user = UserExport()
    with ctxreplay.capture_with(model, backend=user, verify="execute") as s, bf16():
        model(torch.rand(4, 16))
    report = finalize_checked(s)
    assert not report.failures, report.failures
    (c,) = report.captures
    assert user.calls == 1
    assert c.backend == "user_export" and report.settings["backend"] == "user_export"
    assert isinstance(c.artifact, torch.export.ExportedProgram)
    assert out_dtypes(c.graph_outputs) == [BF16]
    assert c.fidelity.ok and "execute" in c.fidelity.checked


@pytest.mark.parametrize("bad", ["exprot", 42, object()])
def test_an_unknown_backend_is_refused(bad: Any) -> None:
    with pytest.raises((ValueError, TypeError), match="backend"):
        ctxreplay.capture_with(MatmulBlock(), backend=bad)


class _Res(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.lin(x).relu()


def test_repeated_finds_sequential_stacks_but_not_plain_layer_chains() -> None:
    from collections import OrderedDict

    model = nn.Sequential(OrderedDict([
        ("stem", nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))),  # plain layers: a block
        ("stage", nn.Sequential(OrderedDict([("first", _Res(8)), ("second", _Res(8))]))),
        ("head", nn.Linear(8, 2)),
    ]))
    names = [n for n, _ in resolve_targets(model, "repeated")]
    assert names == ["stage.first", "stage.second"]  # the children's real names
    with ctxreplay.capture_with(model, targets="repeated", backend="export") as session:
        model(torch.rand(3, 8))
    report = session.finalize()
    assert [(c.scope, c.members, c.calls) for c in report.captures] == [
        ("stage.first", ("stage.first", "stage.second"), 2)]
    with pytest.raises(ValueError, match="no stack of repeated blocks"):
        resolve_targets(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), "repeated")
