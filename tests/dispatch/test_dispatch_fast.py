"""The installed fast path keeps every property of the eager forward it replaces.

``install`` runs a capture's program as one flat generated function
(``dispatch/flat.py``) with the member's own tensors read on every call
(``dispatch/bound.py``).  Each test below states one property of the eager
forward and shows the installed model keeps it -- with the fast path taken
(``stats().unflattened`` empty, the member's own ``forward`` never run) --
and, where the property is one a shortcut would lose, what losing it looks
like (the program run without it gives another answer).

The oracle is eager: a twin of the model (same weights) or the same model
after ``remove()``; a block's own ``forward`` counts its calls, so a hit
is known to have run a graph.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ctxreplay
from ctxreplay.dispatch.bound import Bound
from ctxreplay.dispatch.flat import Flat, flatten

pytestmark = [pytest.mark.filterwarnings("ignore:.*LeafSpec:FutureWarning")]

DIM = 8


class Block(nn.Module):
    calls = 0  # the block's own forward: a dispatched call never runs it

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        Block.calls += 1
        # the input follows the weights' dtype: a float64 model takes float32 inputs
        out: torch.Tensor = torch.tanh(self.lin(x.to(self.lin.weight.dtype)))
        return out


class Stack(nn.Module):
    def __init__(self, block: Callable[[], nn.Module] = Block, depth: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(block() for _ in range(depth))

    def forward(self, x: torch.Tensor, *rest: Any) -> torch.Tensor:
        for b in self.blocks:
            x = b(x, *rest)
        return x


def _captured(model: nn.Module, *args: Any, grad: bool = False,
              **options: Any) -> ctxreplay.CaptureReport:
    options.setdefault("verify", "execute")
    with ctxreplay.capture_with(model, targets="repeated", **options) as session, \
            torch.set_grad_enabled(grad):
        model(*args)
    report = session.finalize()
    assert report.ok, (report.failures, [c.fidelity for c in report.captures])
    return report


@pytest.fixture
def stack() -> Stack:
    torch.manual_seed(0)
    return Stack().eval()


@pytest.fixture
def x() -> torch.Tensor:
    return torch.rand(2, DIM, generator=torch.Generator().manual_seed(1))


def _run(model: nn.Module, *args: Any) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = model(*args)
    return out


def _fast(handle: ctxreplay.InstallHandle) -> None:
    stats = handle.stats()
    assert stats.unflattened == {}, stats.unflattened
    assert stats.total_hits > 0, stats


def test_the_flat_program_runs_the_graphs_ops_and_none_of_the_forward(
        stack: Stack, x: torch.Tensor) -> None:
    report = _captured(stack, x)
    want = _run(stack, x)
    with ctxreplay.install(stack, report) as handle:
        Block.calls = 0
        got = _run(stack, x)
        assert Block.calls == 0
        _fast(handle)
    assert torch.equal(got, want)
    flat = flatten(report.captures[0].artifact, keep_guards=False)
    assert isinstance(flat, Flat)
    assert flat.state_names == ("lin.weight", "lin.bias")
    # the ops are bound in its namespace, not spelled in its source
    assert "torch.ops" not in flat.source and "aten" not in flat.source


def test_weights_changed_in_place_or_through_data_are_what_the_call_runs(
        stack: Stack, x: torch.Tensor) -> None:
    report = _captured(stack, x)
    with ctxreplay.install(stack, report) as handle:
        before = _run(stack, x)  # bound now
        with torch.no_grad():
            stack.blocks[0].lin.weight.mul_(-2.0)
        stack.blocks[1].lin.bias.data = torch.randn(DIM)
        got = _run(stack, x)
        _fast(handle)
        assert handle.stats().total_hits == 6
    assert torch.equal(got, _run(stack, x))
    assert not torch.equal(got, before)  # the change shows


@pytest.mark.parametrize("assign", [False, True])
def test_load_state_dict_copied_or_assigned_is_what_the_call_runs(
        stack: Stack, x: torch.Tensor, assign: bool) -> None:
    report = _captured(stack, x)
    torch.manual_seed(7)
    other = Stack().eval()
    with ctxreplay.install(stack, report) as handle:
        _run(stack, x)
        stack.load_state_dict(other.state_dict(), assign=assign)
        got = _run(stack, x)
        _fast(handle)
        assert handle.stats().total_hits == 6
    assert torch.equal(got, _run(other, x))


def test_a_tensor_replaced_in_its_module_without_an_assignment_is_read_on_the_call(
        stack: Stack, x: torch.Tensor) -> None:
    """Offloading hooks put freshly loaded parameters straight into
    ``module._parameters`` (no registration hook fires): the call must run
    with those, not with the tensors seen when it was first bound."""
    report = _captured(stack, x)
    with ctxreplay.install(stack, report) as handle:
        _run(stack, x)
        lin = stack.blocks[2].lin
        lin._parameters["weight"] = nn.Parameter(torch.randn(DIM, DIM))
        got = _run(stack, x)
        _fast(handle)
        assert handle.stats().total_hits == 6
    assert torch.equal(got, _run(stack, x))


def test_a_dtype_converted_in_place_runs_eagerly_then_dispatches_again(
        stack: Stack, x: torch.Tensor) -> None:
    """``model.double()`` keeps the parameter objects and changes what they
    hold; the program was traced for float32 weights (its ``.to`` casts the
    input to float32), so it cannot take them."""
    report = _captured(stack, x)
    with ctxreplay.install(stack, report) as handle:
        _run(stack, x)
        stack.double()
        Block.calls = 0
        got = _run(stack, x)  # float32 inputs: the forward casts them
        assert Block.calls == 3 and got.dtype == torch.float64
        # the first block's call has the captured signature (the next ones
        # get its float64 output, another signature)
        assert handle.stats().reasons == {"weights": 1, "signature": 2}
        want = _run(stack, x)
        stack.float()
        again = _run(stack, x)
        assert handle.stats().total_hits == 6 and again.dtype == torch.float32
    assert torch.equal(got, want)
    # the control: the program run with the float64 weights fails
    program = report.captures[0].artifact
    flat = flatten(program, keep_guards=False)
    assert isinstance(flat, Flat)
    stack.double()
    state = Bound(flat.state_names, None, stack.blocks[0], "").state()
    with pytest.raises(RuntimeError):
        flat.fn(*state, x)


class BN(nn.Module):
    calls = 0

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        BN.calls += 1
        out: torch.Tensor = self.bn(x)
        return out


def test_train_mode_batchnorm_writes_the_members_own_buffers(x: torch.Tensor) -> None:
    torch.manual_seed(0)
    model = Stack(BN, depth=2).train()
    xs = torch.rand(4, DIM)
    twin = copy.deepcopy(model)
    report = _captured(model, xs)
    twin.load_state_dict(model.state_dict())
    with ctxreplay.install(model, report) as handle:
        for _ in range(3):
            BN.calls = 0
            got = _run(model, xs)
            assert BN.calls == 0
            assert torch.equal(got, _run(twin, xs))
        _fast(handle)
    for a, b in zip(model.modules(), twin.modules()):
        if isinstance(a, nn.BatchNorm1d):
            assert isinstance(b, nn.BatchNorm1d)
            assert torch.equal(a.running_mean, b.running_mean)  # type: ignore[arg-type]
            assert torch.equal(a.num_batches_tracked,  # type: ignore[arg-type]
                               b.num_batches_tracked)  # type: ignore[arg-type]
    assert int(model.blocks[0].bn.num_batches_tracked) > 1  # type: ignore[union-attr, arg-type]


class Writes(nn.Module):
    """Writes its input cache in place, as a static KV cache's update does."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, cache: torch.Tensor,
                pos: torch.Tensor) -> torch.Tensor:
        cache.index_copy_(0, pos, self.lin(x))
        out: torch.Tensor = x + cache.sum(0)
        return out


def test_an_input_the_graph_writes_in_place_is_written_in_the_callers_tensor() -> None:
    torch.manual_seed(0)
    model = Stack(Writes, depth=2).eval()
    twin = copy.deepcopy(model)
    x = torch.rand(2, DIM)
    report = _captured(model, x, torch.zeros(6, DIM), torch.tensor([0, 1]))
    with ctxreplay.install(model, report) as handle:
        for step in range(3):
            pos = torch.tensor([2 * step, 2 * step + 1])
            cache, twin_cache = torch.zeros(6, DIM), torch.zeros(6, DIM)
            got, want = _run(model, x, cache, pos), _run(twin, x, twin_cache, pos)
            assert torch.equal(got, want)
            assert torch.equal(cache, twin_cache) and cache.abs().sum() > 0
        _fast(handle)


class Dropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(self.lin(x), p=0.5, training=self.training)


def test_random_ops_draw_what_eager_draws_from_the_generator() -> None:
    torch.manual_seed(0)
    model = Stack(Dropout, depth=2).train()
    x = torch.rand(4, DIM)
    report = _captured(model, x, verify="signature")
    torch.manual_seed(5)
    want = _run(model, x)
    after = torch.get_rng_state()
    with ctxreplay.install(model, report) as handle:
        torch.manual_seed(5)
        got = _run(model, x)
        assert torch.equal(torch.get_rng_state(), after)
        _fast(handle)
    assert torch.equal(got, want) and bool((got == 0).any())


def test_backward_through_the_installed_graph_gives_eagers_gradients(
        stack: Stack, x: torch.Tensor) -> None:
    twin = copy.deepcopy(stack)
    report = _captured(stack, x, grad=True)
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    with ctxreplay.install(stack, report) as handle:
        stack(xs[0]).square().sum().backward()
        _fast(handle)
    twin(xs[1]).square().sum().backward()
    assert xs[0].grad is not None and torch.equal(xs[0].grad, xs[1].grad)
    for p, q in zip(stack.parameters(), twin.parameters()):
        assert p.grad is not None and torch.equal(p.grad, q.grad)  # type: ignore[arg-type]


class Gather(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.index_select(x, 0, idx))


@pytest.mark.parametrize("context", ["no_grad", "autocast"])
def test_a_graph_that_raises_leaves_grad_mode_and_autocast_as_they_were(context: str) -> None:
    """An op that raises inside a grad-mode or autocast region of the graph
    (an index out of range, as eager raises it): the error reaches the
    caller and the state the region entered is left again."""
    torch.manual_seed(0)
    model = Stack(Gather, depth=2).eval()
    x, idx = torch.rand(3, DIM), torch.tensor([0, 2, 1])

    def region() -> Any:  # replayed inside the graph (embedded): a region of it
        return torch.no_grad() if context == "no_grad" else \
            torch.autocast("cpu", dtype=torch.bfloat16)

    with ctxreplay.capture_with(model, targets="repeated", verify="execute") as session, \
            region():
        model(x, idx)
    report = session.finalize()
    assert report.ok
    flat = flatten(report.captures[0].artifact, keep_guards=False)
    assert isinstance(flat, Flat)
    with ctxreplay.install(model, report) as handle, region():
        model(x, idx)
        _fast(handle)
    bad = torch.tensor([0, 9, 1])
    with ctxreplay.install(model, report) as handle:
        with region():
            model(x, idx)
            grad, cast = torch.is_grad_enabled(), torch.is_autocast_enabled("cpu")
            with pytest.raises(IndexError):
                model(x, bad)
            assert (torch.is_grad_enabled(), torch.is_autocast_enabled("cpu")) == (grad, cast)
        assert torch.is_grad_enabled() and not torch.is_autocast_enabled("cpu")
        assert handle.stats().total_hits >= 2


@pytest.fixture
def grad_on() -> Iterator[None]:
    yield
    torch.set_grad_enabled(True)


def test_an_op_raising_inside_a_region_of_the_flat_program_restores_grad_mode(
        grad_on: None) -> None:
    """The flat program alone: the error is raised inside the graph's
    ``no_grad`` region (an index out of range) and grad mode is on again
    after.  (torch's own region, ``wrap_with_set_grad_enabled``, sets it back
    without a ``finally`` on some releases: 2.13 leaves it off.)"""
    torch.manual_seed(0)
    model = Stack(Gather, depth=1).eval()
    x, idx = torch.rand(3, DIM), torch.tensor([0, 2, 1])
    report = _captured(model, x, idx)
    program = report.captures[0].artifact
    assert "wrap_with_set_grad_enabled" in str(program.graph)
    flat = flatten(program, keep_guards=False)
    assert isinstance(flat, Flat)
    state = Bound.of(flat, model.blocks[0], "").state()
    assert torch.equal(flat.rebuild(flat.fn(*state, x, idx)), _run(model, x, idx))
    with pytest.raises(IndexError):
        flat.fn(*state, x, torch.tensor([0, 9, 1]))
    assert torch.is_grad_enabled()


def _adds(module: nn.Module, out: torch.Tensor) -> torch.Tensor:
    return out * -0.5 + 0.25


@pytest.mark.parametrize("where", ["submodule", "global"])
def test_a_hook_inside_a_member_registered_after_install_runs_eagerly_until_removed(
        stack: Stack, x: torch.Tensor, where: str) -> None:
    """The graph runs in place of the member's forward: a forward hook on one
    of its submodules (or a global one, which fires on them) registered after
    install would be skipped by it."""
    report = _captured(stack, x)
    with ctxreplay.install(stack, report) as handle:
        _run(stack, x)
        if where == "submodule":
            hook = stack.blocks[1].lin.register_forward_hook(lambda m, a, out: _adds(m, out))
        else:
            hook = torch.nn.modules.module.register_module_forward_hook(
                lambda m, a, out: _adds(m, out) if isinstance(m, nn.Linear) else None)
        try:
            got = _run(stack, x)
            stats = handle.stats()
        finally:
            hook.remove()
        misses = {"submodule": 1, "global": 3}[where]
        assert stats.reasons == {"hooks": misses} and stats.total_hits == 6 - misses
        _run(stack, x)  # removed: dispatched again
        assert handle.stats().total_hits == 9 - misses
    with torch.no_grad():
        if where == "submodule":
            hook = stack.blocks[1].lin.register_forward_hook(lambda m, a, out: _adds(m, out))
        else:
            hook = torch.nn.modules.module.register_module_forward_hook(
                lambda m, a, out: _adds(m, out) if isinstance(m, nn.Linear) else None)
        try:
            want = stack(x)
        finally:
            hook.remove()
    assert torch.equal(got, want)
    assert not torch.equal(want, _run(stack, x))  # the hook changes the output


def test_a_member_holding_a_submodule_hook_at_install_runs_eagerly_until_removed(
        stack: Stack, x: torch.Tensor) -> None:
    """Hooks on the members' submodules when install runs (the capture was
    made without them): every call of those members runs eagerly, counted
    as ``hooks``, the hooks run as in eager and the outputs are eager's; a
    member whose hook is removed is dispatched again."""
    report = _captured(stack, x)
    calls: list[int] = []

    def hook(m: nn.Module, a: Any, out: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return _adds(m, out)

    hooks = [b.lin.register_forward_hook(hook) for b in stack.blocks]
    want = _run(stack, x)
    with ctxreplay.install(stack, report) as handle:
        got = _run(stack, x)
        assert handle.stats().reasons == {"hooks": 3} and handle.stats().total_hits == 0
        assert len(calls) == 6  # 3 in the eager run, 3 in the installed one
        hooks[0].remove()
        _run(stack, x)
        assert handle.stats().reasons == {"hooks": 5} and handle.stats().total_hits == 1
    for h in hooks[1:]:
        h.remove()
    assert torch.equal(got, want) and not torch.equal(got, _run(stack, x))


def test_a_hook_that_only_records_while_collecting_blocks_dispatch_only_then(
        stack: Stack, x: torch.Tensor, monkeypatch: pytest.MonkeyPatch) -> None:
    """A hook known to change nothing a forward computes (transformers'
    output-capturing hook, here a stand-in of the same name over a stand-in
    collector) lets the member be dispatched while it records nothing --
    no collector, or one collecting other outputs -- and runs it eagerly
    while its model collects the outputs it captures."""
    import contextvars
    import sys
    import types

    collector: contextvars.ContextVar[Any] = contextvars.ContextVar("collector", default=None)
    module = types.ModuleType("transformers.utils.output_capturing")
    module._active_collector = collector  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "transformers.utils.output_capturing", module)

    def install_output_capuring_hook(key: str) -> Callable[..., None]:
        def output_capturing_hook(m: nn.Module, a: Any, out: torch.Tensor) -> None:
            collected = collector.get()
            if collected is not None and key in collected:
                collected[key].append(out)

        output_capturing_hook.__module__ = module.__name__
        output_capturing_hook.__qualname__ = \
            "install_output_capuring_hook.<locals>.output_capturing_hook"
        return output_capturing_hook

    def collecting(*keys: str) -> dict[str, list[torch.Tensor]]:
        collected: dict[str, list[torch.Tensor]] = {k: [] for k in keys}
        token = collector.set(collected)
        try:
            _run(stack, x)
        finally:
            collector.reset(token)
        return collected

    report = _captured(stack, x)
    hooks = [b.lin.register_forward_hook(install_output_capuring_hook("attentions"))
             for b in stack.blocks]
    try:
        with ctxreplay.install(stack, report) as handle:
            _run(stack, x)
            assert collecting("hidden_states") == {"hidden_states": []}
            assert handle.stats().total_hits == 6
            assert len(collecting("attentions")["attentions"]) == 3
            assert handle.stats().reasons == {"hooks": 3}
    finally:
        for h in hooks:
            h.remove()


def test_a_members_own_hook_added_after_install_runs_once_around_the_graph(
        stack: Stack, x: torch.Tensor) -> None:
    report = _captured(stack, x)
    seen: list[int] = []
    with ctxreplay.install(stack, report) as handle:
        _run(stack, x)
        hook = stack.blocks[2].register_forward_hook(
            lambda m, a, out: seen.append(1) or out * 2)
        got = _run(stack, x)
        assert handle.stats().total_hits == 6 and seen == [1]
    want = _run(stack, x)
    hook.remove()
    assert torch.equal(got, want)


class ScaledBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, *, scale: float) -> torch.Tensor:
        out: torch.Tensor = torch.tanh(self.lin(x)) * scale
        return out


class ScaledStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ScaledBlock() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x, scale=0.5)
        return x


def test_a_hook_assigning_an_attribute_every_call_runs_eagerly_without_rebuilding_the_rematch(
        x: torch.Tensor, monkeypatch: pytest.MonkeyPatch) -> None:
    """A profiler's hook that stores a time on the block (``module._t = ...``)
    changes the block's identity on every call: each call runs eagerly and is
    checked again, but the check of the call's arguments, generated from
    the arguments alone, is made once per block, not once per call."""
    torch.manual_seed(0)
    model = ScaledStack().eval()
    twin = copy.deepcopy(model)
    report = _captured(model, x)
    made: list[int] = []
    real = ctxreplay.dispatch.install.rematcher

    def counted(args: Any, kwargs: Any) -> Any:
        made.append(1)
        return real(args, kwargs)

    monkeypatch.setattr(ctxreplay.dispatch.install, "rematcher", counted)
    calls = 5
    with ctxreplay.install(model, report) as handle:
        for b in model.blocks:
            b.register_forward_pre_hook(lambda mod, args: setattr(mod, "_t", len(made)))
        for _ in range(calls):
            assert torch.equal(_run(model, x), _run(twin, x))
        stats = handle.stats()
    assert stats.total_hits == 0 and stats.reasons == {"identity": 3 * calls}, stats
    assert len(made) == 3, f"{len(made)} rematches made for 3 blocks over {calls} calls"
