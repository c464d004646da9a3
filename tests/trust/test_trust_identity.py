"""Identity: a capture stands only for the calls it
really reproduces.

Blocks of one class that differ in a plain attribute (``is_causal``,
``layer_idx``, ``dilation``) or in ``training`` run different graphs; a
cache object passed as an argument holds tensors whose shapes change from
call to call.  Each test records what really ran with its own forward hooks
(tests/helpers/trust_oracle.py), replays every recorded call through the capture
that claims it, with that member's own weights, and compares by value --
and shows the same oracle failing when the captures are forced to share
(``ignore_attributes``) or a call is run through another member's capture.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from engine_models import CountingExport
from torch import nn
from trust_oracle import members_of, record, replay_failure, unreproduced

import ctxreplay

# torch's own export internals warn about a deprecated pytree spelling
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

DIM = 32


def _session(model: nn.Module, **options: Any) -> ctxreplay.CaptureSession:
    options.setdefault("backend", "export")
    return ctxreplay.capture_with(model, targets="repeated", **options)


def _claims(report: ctxreplay.CaptureReport) -> dict[str, list[int]]:
    """member -> the variants of the captures that list it."""
    out: dict[str, list[int]] = {}
    for c in report.captures:
        for m in c.members:
            out.setdefault(m, []).append(c.variant)
    return out


# -- causal and non-causal attention in one ModuleList --------------------------------

class Attention(nn.Module):
    def __init__(self, causal: bool, heads: int = 4) -> None:
        super().__init__()
        self.is_causal = causal
        self.heads = heads
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.is_causal)
        return x + self.proj(y.transpose(1, 2).reshape(b, t, d))


class Mixed(nn.Module):
    """Causal and bidirectional layers alternate (an encoder-decoder's halves)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Attention(i % 2 == 0) for i in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _mixed_live(**options: Any) -> tuple[ctxreplay.CaptureReport, list[Any], Mixed]:
    torch.manual_seed(0)
    model = Mixed().eval()
    with record(model, members_of(model, "layers")) as calls, \
            _session(model, **options) as session, torch.no_grad():
        model(torch.rand(2, 6, DIM))
        model(torch.rand(2, 6, DIM))
    return session.finalize(), calls, model


def test_causal_and_bidirectional_layers_get_their_own_captures() -> None:
    report, calls, _ = _mixed_live(verify="execute")
    assert report.ok and not report.failures
    assert len(calls) == 8
    # every call is reproduced by value by the one capture that lists its member
    assert unreproduced(report, calls) == []
    assert sorted(c.members for c in report.captures) == [
        ("layers.0", "layers.2"), ("layers.1", "layers.3")]
    for c in report.captures:
        assert c.fidelity.ok and c.fidelity.members == 2
        assert dict(c.member_calls) == {m: 2 for m in c.members}


def test_forced_sharing_of_causal_and_bidirectional_is_caught() -> None:
    # The case without the fix: one graph for all four layers.  The oracle
    # sees the bidirectional layers' calls come out wrong; execute
    # verification reports exactly those members, signature verification
    # (shapes and dtypes agree) does not.
    report, calls, _ = _mixed_live(verify="execute", ignore_attributes=("is_causal",))
    (c,) = report.captures
    assert c.members == ("layers.0", "layers.1", "layers.2", "layers.3")
    bad = unreproduced(report, calls)
    assert len(bad) == 4 and all("layers.1" in b or "layers.3" in b for b in bad), bad
    assert not report.ok and not c.fidelity.ok
    flagged = {m for mm in c.fidelity.mismatches for m in mm.members}
    assert flagged == {"layers.1", "layers.3"}
    assert {mm.level for mm in c.fidelity.mismatches} == {"execute"}

    report, _, _ = _mixed_live(verify="signature", ignore_attributes=("is_causal",))
    assert report.ok  # what "signature" cannot see: the reason execute exists


# -- a layer_idx-indexed cache --------------------------------------------------------

class Slotted(nn.Module):
    """Reads its own slot of a per-layer table (a KV cache's layer index)."""

    def __init__(self, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, slots: list[torch.Tensor]) -> torch.Tensor:
        return self.lin(x) + slots[self.layer_idx]


class SlottedStack(nn.Module):
    def __init__(self, depth: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Slotted(i) for i in range(depth)])

    def forward(self, x: torch.Tensor, slots: list[torch.Tensor]) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, slots)
        return x


def _slotted_live(**options: Any) -> tuple[ctxreplay.CaptureReport, list[Any]]:
    torch.manual_seed(0)
    model = SlottedStack().eval()
    slots = [torch.randn(2, DIM) * 10 for _ in range(3)]
    with record(model, members_of(model, "layers")) as calls, \
            _session(model, **options) as session, torch.no_grad():
        model(torch.rand(2, DIM), slots)
    return session.finalize(), calls


def test_layer_indexed_slots_each_member_reproduced() -> None:
    report, calls = _slotted_live(verify="execute")
    assert report.ok
    assert unreproduced(report, calls) == []
    assert sorted(c.members for c in report.captures) == [
        ("layers.0",), ("layers.1",), ("layers.2",)]
    assert {c.weights_from: c.members[0] for c in report.captures} == {
        m: m for m in ("layers.0", "layers.1", "layers.2")}


def test_forced_sharing_of_layer_indexed_slots_is_caught() -> None:
    report, calls = _slotted_live(verify="execute", ignore_attributes=("layer_idx",))
    (c,) = report.captures
    assert c.weights_from == "layers.0"
    bad = unreproduced(report, calls)
    # layer 1 and 2 read layer 0's slot through the shared graph
    assert [b.split(" via")[0] for b in bad] == ["call 1 of layers.1", "call 2 of layers.2"]
    assert not report.ok
    assert {m for mm in c.fidelity.mismatches for m in mm.members} == {"layers.1", "layers.2"}


# -- dilated convolutions -------------------------------------------------------------

class ConvBlock(nn.Module):
    def __init__(self, dilation: int) -> None:
        super().__init__()
        self.conv = nn.Conv1d(DIM, DIM, 3, padding=dilation, dilation=dilation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.conv(x))


class WaveNetish(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([ConvBlock(d) for d in (1, 2, 4, 1)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def _conv_live(**options: Any) -> tuple[ctxreplay.CaptureReport, list[Any]]:
    torch.manual_seed(0)
    model = WaveNetish().eval()
    with record(model, members_of(model, "blocks")) as calls, \
            _session(model, **options) as session, torch.no_grad():
        model(torch.rand(1, DIM, 16))
    return session.finalize(), calls


def test_dilated_convs_each_member_reproduced() -> None:
    report, calls = _conv_live(verify="execute")
    assert report.ok
    assert unreproduced(report, calls) == []
    assert sorted(c.members for c in report.captures) == [
        ("blocks.0", "blocks.3"), ("blocks.1",), ("blocks.2",)]


def test_forced_sharing_of_dilated_convs_is_caught() -> None:
    report, calls = _conv_live(verify="execute", ignore_attributes=("dilation", "padding",
                                                     "_reversed_padding_repeated_twice"))
    (c,) = report.captures
    bad = unreproduced(report, calls)
    assert sorted(b.split(" via")[0] for b in bad) == ["call 1 of blocks.1",
                                                       "call 2 of blocks.2"]
    assert not report.ok
    assert {m for mm in c.fidelity.mismatches for m in mm.members} == {"blocks.1", "blocks.2"}


# -- a homogeneous stack still costs one backend call per variant -------------------

class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


class Dit(nn.Module):
    def __init__(self, depth: int = 12) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Mlp() for _ in range(depth)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def test_homogeneous_twelve_block_stack_costs_one_backend_call_per_variant() -> None:
    torch.manual_seed(0)
    model = Dit().eval()
    backend = CountingExport()
    members = members_of(model, "blocks")
    with record(model, members) as calls, \
            _session(model, backend=backend) as session, torch.no_grad():
        model(torch.rand(2, DIM))
        model(torch.rand(2, DIM))
        model(torch.rand(3, DIM))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(torch.rand(2, DIM))
    report = session.finalize()
    assert report.ok
    # (2, 32) and (3, 32) without autocast, (2, 32) under it (the residual
    # keeps every block's input float32): three variants, three backend calls
    assert len(report.captures) == 3
    assert len(backend.calls) == 3
    assert all(c.members == tuple(members) for c in report.captures)
    assert sorted(c.calls for c in report.captures) == [12, 12, 24]
    # one graph, twelve weight sets: every call of every member by value
    assert len(calls) == 48
    assert unreproduced(report, calls) == []


def test_a_call_through_another_members_capture_is_not_reproduced() -> None:
    # The oracle itself can fail: layer 1's real call, run through layer 0's
    # capture with layer 1's weights, reads layer 0's slot.
    report, calls = _slotted_live(verify="off")
    by_member = {c.members[0]: c for c in report.captures}
    call = next(c for c in calls if c.member == "layers.1")
    assert replay_failure(by_member["layers.1"], call) is None
    assert replay_failure(by_member["layers.0"], call) is not None


# -- captures whose graphs are identical are merged ---------------------------------

class Named(nn.Module):
    """A plain attribute that the graph does not depend on."""

    def __init__(self, i: int) -> None:
        super().__init__()
        self.layer_idx = i
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x))


class NamedStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Named(i) for i in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_identical_graphs_of_different_identities_are_merged_into_one_record() -> None:
    torch.manual_seed(0)
    model = NamedStack().eval()
    members = members_of(model, "layers")
    with record(model, members) as calls, _session(model, verify="execute") as session, \
            torch.no_grad():
        model(torch.rand(2, DIM))
    report = session.finalize()
    assert report.ok
    assert unreproduced(report, calls) == []
    (c,) = report.captures
    assert c.members == tuple(members)
    assert dict(c.member_calls) == {m: 1 for m in members}


# -- tensors inside an object passed as an argument ---------------------------------

class KV:
    """A plain cache object (a DynamicCache's shape): tensors that grow."""

    def __init__(self, prompt: torch.Tensor) -> None:
        self.entries = [prompt]


class Appending(nn.Module):
    """Appends its key to the cache and attends over everything in it: each
    layer receives the cache grown by the layers before it."""

    def __init__(self) -> None:
        super().__init__()
        self.k = nn.Linear(DIM, DIM)
        self.o = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, cache: KV) -> torch.Tensor:
        cache.entries.append(self.k(x))
        ctx = torch.cat(cache.entries, dim=1)
        return x + self.o(ctx.softmax(1).mean(1, keepdim=True))


class AppendingStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Appending() for _ in range(3)])

    def forward(self, x: torch.Tensor, cache: KV) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, cache)
        return x


def _cache_live() -> tuple[ctxreplay.CaptureReport, list[Any]]:
    torch.manual_seed(0)
    model = AppendingStack().eval()
    with record(model, members_of(model, "layers")) as calls, \
            _session(model, verify="execute") as session, torch.no_grad():
        model(torch.rand(1, 4, DIM), KV(torch.rand(1, 4, DIM)))   # "prefill"
        model(torch.rand(1, 1, DIM), KV(torch.rand(1, 5, DIM)))   # "decode"
    return session.finalize(), calls


def test_tensors_inside_an_argument_object_are_part_of_the_variant() -> None:
    report, calls = _cache_live()
    # every call appends to the cache's list, which no graph repeats: not ok
    # for that alone, while the outputs are reproduced
    assert not report.ok
    assert {(m.field, m.live) for c in report.captures for m in c.fidelity.mismatches} == \
        {("argument", "KV.entries: appended (1 -> 2 items)"),
         ("argument", "KV.entries: appended (2 -> 3 items)"),
         ("argument", "KV.entries: appended (3 -> 4 items)")}
    # one identity, but every (layer, step) receives a cache of other shapes
    assert len(report.captures) == 6
    assert all(len(c.members) == 1 for c in report.captures)
    assert unreproduced(report, calls) == []
    entries = sorted((c.members[0], len(list(c.signature.leaves()))) for c in report.captures)
    assert entries == [("layers.0", 2), ("layers.0", 2), ("layers.1", 3), ("layers.1", 3),
                       ("layers.2", 4), ("layers.2", 4)]


def test_a_grown_cache_through_the_first_calls_capture_is_not_reproduced() -> None:
    # The case without the fix: layer 0's decode call (its cache entry holds
    # 5 positions) keyed like its prefill call (4 positions) would be run
    # through the prefill capture -- which rejects or misreads it.
    report, calls = _cache_live()
    layer0 = sorted((c for c in report.captures if c.members == ("layers.0",)),
                    key=lambda c: c.variant)
    _prefill, decode = [c for c in calls if c.member == "layers.0"]
    assert replay_failure(layer0[1], decode) is None
    assert replay_failure(layer0[0], decode, check_shapes=False) is not None


# -- train vs eval ----------------------------------------------------------------

class Dropping(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.lin(x))


class DroppingStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Dropping() for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _has_dropout(c: ctxreplay.Capture) -> bool:
    """Whether the graph drops anything (export records ``aten.dropout`` in
    eval mode too, with ``train=False``: a no-op)."""
    for mod in c.artifact.graph_module.modules():
        if not isinstance(mod, torch.fx.GraphModule):
            continue
        for n in mod.graph.nodes:
            if n.op != "call_function":
                continue
            if n.target is torch.ops.aten.native_dropout.default:
                return True
            if n.target is torch.ops.aten.dropout.default and (
                    n.args[2] if len(n.args) > 2 else n.kwargs.get("train", True)):
                return True
    return False


def _eval_capture(call: Any, found: list[ctxreplay.Capture]) -> list[ctxreplay.Capture]:
    return [c for c in found if _has_dropout(c) == call.training]


def test_an_eval_call_and_a_train_call_are_two_variants() -> None:
    torch.manual_seed(0)
    model = DroppingStack()
    members = members_of(model, "layers")
    with record(model, members) as calls, _session(model, verify="signature") as session, \
            torch.no_grad():
        model.eval()
        model(torch.rand(2, DIM))
        model.train()
        model(torch.rand(2, DIM))
    report = session.finalize()
    assert report.ok
    assert len(report.captures) == 2
    assert all(c.members == tuple(members) for c in report.captures)
    assert sorted(_has_dropout(c) for c in report.captures) == [False, True]
    evaluated = [c for c in calls if not c.training]
    assert len(evaluated) == 2
    # the eval calls, by value, through the capture without dropout ...
    assert unreproduced(report, evaluated, pick=_eval_capture) == []
    # ... which the train capture does not reproduce: the oracle can tell
    (train,) = [c for c in report.captures if _has_dropout(c)]
    assert replay_failure(train, evaluated[0]) is not None


def test_an_eval_call_captured_after_model_train_has_no_dropout() -> None:
    torch.manual_seed(0)
    model = DroppingStack().eval()
    with record(model, members_of(model, "layers")) as calls, \
            _session(model, verify="execute") as session, torch.no_grad():
        model(torch.rand(2, DIM))
    model.train()  # between the live forward and finalize (a training loop resumes)
    report = session.finalize()
    assert model.training and all(m.training for m in model.modules())
    (c,) = report.captures
    assert not _has_dropout(c)
    assert report.ok
    assert unreproduced(report, calls) == []
