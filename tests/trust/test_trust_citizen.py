"""Fooled, or in the way: an open session is invisible to the rest
of PyTorch.  Tracers (fx, jit.trace, jit.script, fake tensors, functorch)
see the model they would see without it and record no variant; copies and
pickles of an observed model are plain models; lazy and shared modules can
be targeted; the user's exceptions pass through untouched.

Every "no variant recorded" check is followed by a real call that does
record one, so a session that observes nothing cannot pass.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import pickle
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import pytest
import torch
from metadata_check import finalize_checked
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

import ctxreplay
from ctxreplay._base.torchcaps import CAPS
from ctxreplay.observation import wrapper

pytestmark = [pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore:`torch.jit.*deprecated:DeprecationWarning")]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x)) + x


class Net(nn.Module):
    """Typed throughout, so ``torch.jit.script`` takes it."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def _net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net().eval()


def _x() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.rand(3, 4)


def _calls(session: ctxreplay.CaptureSession) -> list[tuple[str, int, int]]:
    return [(scope.name, v.index, v.calls) for scope, v in session.variants]


def _records_real_calls(session: ctxreplay.CaptureSession, model: nn.Module) -> None:
    """The control after each "recorded nothing": the session is observing."""
    with torch.no_grad():
        model(_x())
    assert _calls(session) == [("blocks.0", 0, 2)]


# -- fx -------------------------------------------------------------------------------

def test_fx_symbolic_trace_sees_the_same_graph_and_records_nothing() -> None:
    model = _net()
    expected = torch.fx.symbolic_trace(model)
    with ctxreplay.capture_with(model, targets="repeated") as s:
        traced = torch.fx.symbolic_trace(model)
        assert _calls(s) == []
        assert traced.code == expected.code
        assert str(traced.graph) == str(expected.graph)
        assert torch.equal(traced(_x()), expected(_x()))
        assert _calls(s) == []  # the GraphModule's calls are not the model's
        _records_real_calls(s, model)
    s.finalize()


# -- jit ---------------------------------------------------------------------------

def _kinds(graph: torch._C.Graph) -> list[str]:
    return [n.kind() for n in graph.nodes()]


@pytest.mark.parametrize("check_trace", [False, True])
def test_jit_trace_sees_the_same_graph_and_records_nothing(check_trace: bool) -> None:
    model = _net()
    x = _x()
    expected = torch.jit.trace(model, (x,), check_trace=check_trace)
    with ctxreplay.capture_with(model, targets="repeated") as s:
        traced = torch.jit.trace(model, (x,), check_trace=check_trace)
        assert torch.equal(traced(x), expected(x))
        assert _kinds(traced.inlined_graph) == _kinds(expected.inlined_graph)
        assert _calls(s) == []
        _records_real_calls(s, model)
    s.finalize()


@pytest.mark.parametrize("guards_see_tracing", [True, False],
                         ids=["tensor-guards", "python-key"])
def test_jit_trace_after_live_calls_records_nothing(
        guards_see_tracing: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """After live calls each block answers repeats from its memo, which asks
    nothing of torch.jit.trace itself: the memo's input check must fail
    inside a trace (tensors of the same metadata as the live ones, the same
    grad mode).  Where torch's TensorGuards do not see the tracer, the memo
    checks with the Python key, which asks.  (``check_trace=True`` then runs
    the model again untraced; those runs are counted once a variant exists
    -- not covered here.)"""
    if guards_see_tracing and not CAPS.tensor_guards_see_jit_tracing:
        pytest.skip("torch limit: this torch's TensorGuards do not see jit tracing")
    monkeypatch.setattr(wrapper, "CAPS", dataclasses.replace(
        CAPS, tensor_guards_see_jit_tracing=guards_see_tracing))
    check_trace = False
    model = _net()
    x = _x()
    with torch.no_grad():
        expected = torch.jit.trace(model, (x,), check_trace=check_trace)
    with ctxreplay.capture_with(model, targets="repeated") as s:
        _records_real_calls(s, model)
        with torch.no_grad():  # the live calls' state: only the input check can fail
            traced = torch.jit.trace(model, (x,), check_trace=check_trace)
        assert _calls(s) == [("blocks.0", 0, 2)]
        assert _kinds(traced.inlined_graph) == _kinds(expected.inlined_graph)
        assert torch.equal(traced(x), expected(x))
        with torch.no_grad():
            model(_x())  # the memo still answers a live call
        assert _calls(s) == [("blocks.0", 0, 4)]
    s.finalize()


def test_jit_trace_keeps_the_forward_signature() -> None:
    model = _net()
    x = _x()
    expected = torch.jit.trace(model, (x,), check_trace=False)
    with ctxreplay.capture_with(model, targets="repeated") as s:
        traced = torch.jit.trace(model, (x,), check_trace=False)
    s.close()
    assert traced.code == expected.code
    assert torch.equal(traced(x=x), expected(x=x))


def test_jit_script_sees_the_same_code_and_records_nothing() -> None:
    model = _net()
    expected = torch.jit.script(model)
    with ctxreplay.capture_with(model, targets="repeated") as s:
        scripted = torch.jit.script(model)
        assert scripted.code == expected.code
        assert torch.equal(scripted(_x()), expected(_x()))
        assert _calls(s) == []
        _records_real_calls(s, model)
    s.finalize()


# -- calls whose inputs are not real tensors -----------------------------------------------

def test_fake_tensor_calls_pass_through_unrecorded() -> None:
    model = _net()
    with ctxreplay.capture_with(model, targets="repeated") as s:
        with FakeTensorMode(allow_non_fake_inputs=True):
            out = model(torch.empty(3, 4))
        assert isinstance(out, FakeTensor)
        assert (tuple(out.shape), out.dtype) == ((3, 4), torch.float32)
        assert _calls(s) == []
        _records_real_calls(s, model)
    s.finalize()


def test_functorch_calls_pass_through_unrecorded() -> None:
    model = _net()
    x = _x()
    # without a session first: the session must not change what functorch computes
    expected = torch.func.vmap(model)(x)
    expected_grad = torch.func.grad(lambda t: model(t).sum())(x)
    with ctxreplay.capture_with(model, targets="repeated") as s:
        assert torch.equal(torch.func.vmap(model)(x), expected)
        assert torch.equal(torch.func.grad(lambda t: model(t).sum())(x), expected_grad)
        assert _calls(s) == []
        _records_real_calls(s, model)
    s.finalize()


# -- copies and pickles -------------------------------------------------------------------

def _same_weights(src: nn.Module) -> nn.Module:
    """A plain model (never observed) with ``src``'s weights."""
    plain = type(src)()
    plain.load_state_dict(src.state_dict())
    return plain.eval()


def _torch_save_load(m: nn.Module) -> Any:
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


COPIES: dict[str, Callable[[nn.Module], Any]] = {
    "deepcopy": copy.deepcopy,
    "pickle": lambda m: pickle.loads(pickle.dumps(m)),
    "torch.save": _torch_save_load,
}


@pytest.mark.parametrize("how", sorted(COPIES))
@pytest.mark.parametrize("what", ["model", "block"])
def test_a_copy_made_while_open_is_a_plain_model(how: str, what: str) -> None:
    model = _net()
    x = _x()
    with ctxreplay.capture_with(model, targets="repeated") as s, torch.no_grad():
        model(x)
        original = model if what == "model" else model.blocks[0]
        dup = COPIES[how](original)
        assert dup is not original
        for p in dup.parameters():
            p.mul_(-2.0)  # the copy's weights, not the original's
        before = _calls(s)
        got = dup(x)
        # computes with its own weights...
        assert torch.equal(got, _same_weights(dup)(x))
        assert not torch.equal(got, original(x))
        # ...is not observed, and the original still is
        assert _calls(s) == [("blocks.0", 0, before[0][2] + (2 if what == "model" else 1))]
        # it pickles, now and later
        pickle.dumps(dup)
    report = finalize_checked(s)
    assert report.ok and [c.calls for c in report.captures] == [_calls(s)[0][2]]
    again = pickle.loads(pickle.dumps(dup))
    with torch.no_grad():
        assert torch.equal(again(x), got)
        assert torch.equal(dup(x), got)


_ENTRIES = ("forward", "__deepcopy__", "__reduce_ex__", "__prepare_scriptable__")


@pytest.mark.parametrize("how", sorted(COPIES))
def test_a_copy_made_while_open_holds_nothing_of_the_session(how: str) -> None:
    model = _net()
    with ctxreplay.capture_with(model, targets="repeated") as s:
        assert "forward" in model.blocks[0].__dict__  # observed: the wrapper is there
        dup = COPIES[how](model)
        assert [k for m in dup.modules() for k in _ENTRIES if k in m.__dict__] == []
        _records_real_calls(s, model)
    s.close()
    assert [k for m in model.modules() for k in _ENTRIES if k in m.__dict__] == []


def test_an_observed_forward_keeps_its_signature() -> None:
    import inspect

    class Keywords(nn.Module):
        def forward(self, x: torch.Tensor, *, scale: float = 2.0) -> torch.Tensor:
            return x * scale

    model = nn.Sequential(Keywords(), Keywords())
    plain = [inspect.signature(m.forward) for m in (model, model[0])]
    with ctxreplay.capture_with(model, targets="repeated") as s:
        assert "forward" in model[0].__dict__
        assert [inspect.signature(m.forward) for m in (model, model[0])] == plain
        assert list(plain[1].parameters) == ["x", "scale"]
        assert torch.equal(model[0](torch.ones(2), scale=3.0), torch.full((2,), 3.0))
    assert [c.calls for c in finalize_checked(s).captures] == [1]


@pytest.mark.parametrize("what", ["model", "blocks", "block"])
def test_jit_script_of_any_part_leaves_the_live_model_alone(what: str) -> None:
    # torch.jit.script puts what __prepare_scriptable__ returns into the
    # parent's submodules in place: the live blocks must stay the live blocks
    model = _net()
    blocks = list(model.blocks)
    target = {"model": model, "blocks": model.blocks, "block": model.blocks[0]}[what]
    with ctxreplay.capture_with(model, targets="repeated") as s:
        scripted = torch.jit.script(target)
        assert list(model.blocks) == blocks
        assert all("forward" in b.__dict__ for b in model.blocks)  # still observed
        with torch.no_grad():  # it shares the live weights
            model.blocks[0].lin.weight.mul_(-1.0)
        x = _x()
        with torch.no_grad():
            live = target(x) if what != "blocks" else model(x)
        if what != "blocks":
            assert torch.equal(scripted(x), live)
        assert _calls(s) == [("blocks.0", 0, 2 if what != "block" else 1)]
    s.finalize()


@pytest.mark.parametrize("how", sorted(COPIES))
def test_a_copy_made_while_open_scripts_like_a_plain_model(how: str) -> None:
    model = _net()
    with ctxreplay.capture_with(model, targets="repeated") as s:
        dup = COPIES[how](model)
    s.close()
    expected = torch.jit.script(_same_weights(model))
    scripted = torch.jit.script(dup)
    assert scripted.code == expected.code
    assert torch.equal(scripted(_x()), expected(_x()))


def test_the_original_after_the_session_is_plain_and_picklable() -> None:
    model = _net()
    with ctxreplay.capture_with(model, targets="repeated") as s, torch.no_grad():
        model(_x())
    finalize_checked(s)
    assert all("forward" not in m.__dict__ for m in model.modules())
    with torch.no_grad():
        assert torch.equal(pickle.loads(pickle.dumps(model))(_x()), model(_x()))


# -- lazy modules -----------------------------------------------------------------------

class LazyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.LazyLinear(4), nn.ReLU())
                                     for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def _lazy_session() -> ctxreplay.CaptureSession:
    model = LazyNet()
    s = ctxreplay.capture_with(model, targets=["blocks.0", "blocks.1"], verify="execute")
    with s, torch.no_grad():
        model(torch.rand(2, 3))  # the first forward initialises both
        model(torch.rand(2, 3))
    return s


def test_lazy_modules_can_be_targeted_before_their_first_forward() -> None:
    report = finalize_checked(_lazy_session())
    assert report.failures == ()
    assert sorted(c.member_calls for c in report.captures) == [
        (("blocks.0", 2),), (("blocks.1", 2),)]
    assert all(c.fidelity.ok and "execute" in c.fidelity.checked for c in report.captures)


def test_a_lazy_model_captured_after_its_first_forward_is_ok() -> None:
    report = finalize_checked(_lazy_session(), strict=True)
    assert report.ok and report.problems == ()


# -- a module under two names ---------------------------------------------------------------

class Shared(nn.Module):
    """One linear reachable as ``a`` and ``b``, called twice per forward."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = self.a

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.b(self.a(x))
        return out


@pytest.mark.parametrize(("targets", "member"), [
    (["a"], "a"), (["b"], "b"), (["a", "b"], "a"), (["b", "a"], "b"), (["a", "a"], "a"),
    (lambda name, m: isinstance(m, nn.Linear), "a"),
], ids=["a", "b", "a+b", "b+a", "a-twice", "predicate"])
def test_a_shared_module_is_targetable_by_any_name_and_counted_once_per_call(
        targets: Any, member: str) -> None:
    model = Shared()
    with ctxreplay.capture_with(model, targets=targets) as s, torch.no_grad():
        for _ in range(3):
            model(torch.rand(2, 4))
    report = finalize_checked(s, strict=True)
    (c,) = report.captures
    assert c.member_calls == ((member, 6),)  # two calls per forward, three forwards


def test_a_module_list_holding_one_block_twice_counts_each_call_once() -> None:
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            block = Block()
            self.blocks = nn.ModuleList([block, block])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for b in self.blocks:
                x = b(x)
            return x

    model = Twice()
    with ctxreplay.capture_with(model, targets="repeated") as s, torch.no_grad():
        model(torch.rand(2, 4))
    (c,) = finalize_checked(s, strict=True).captures
    assert c.member_calls == (("blocks.0", 2),)


# -- the user's exceptions ----------------------------------------------------------------

class ObserveFails(ctxreplay.probes.ContextProbe[str]):
    name = "test_observe_fails"

    def observe(self) -> str:
        raise KeyError("the probe's own failure")

    def replay(self, state: str) -> AbstractContextManager[None]:
        return nullcontext()


class UserError(Exception):
    pass


class Raises(nn.Module):
    """Raises ``UserError``; with ``chained`` it raises it while handling
    its own ``LookupError``, so its ``__context__`` is the user's."""

    def __init__(self, chained: bool) -> None:
        super().__init__()
        self.chained = chained
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.chained:
            try:
                {}["missing"]
            except LookupError:
                raise UserError("the user's own")  # noqa: B904 (implicit context on purpose)
        raise UserError("the user's own")


def _raise_under(session_kw: dict[str, Any], call: Callable[[nn.Module], Any],
                 chained: bool) -> UserError:
    model = Raises(chained)
    with ctxreplay.capture_with(model, **session_kw) as s, pytest.raises(UserError) as info:
        call(model)
    s.close()
    return info.value


@contextmanager
def _fake() -> Iterator[None]:
    with FakeTensorMode(allow_non_fake_inputs=True):
        yield


CALLS: dict[str, tuple[dict[str, Any], Callable[[nn.Module], Any]]] = {
    # observation fails (a probe raises) inside the forward that then raises
    "observation-error": ({"probes": ["autocast", ObserveFails()]},
                          lambda m: m(torch.rand(2, 4))),
    # observation steps aside (the inputs are not real tensors)
    "fake-inputs": ({}, lambda m: _call_fake(m)),
    # the ordinary path: observed, recorded, the forward raises
    "observed": ({}, lambda m: m(torch.rand(2, 4))),
}


def _call_fake(m: nn.Module) -> Any:
    with _fake():
        return m(torch.empty(2, 4))


@pytest.mark.parametrize("case", sorted(CALLS))
def test_the_users_exception_carries_no_context_of_ours(case: str) -> None:
    kw, call = CALLS[case]
    exc = _raise_under(kw, call, chained=False)
    assert str(exc) == "the user's own"
    assert exc.__context__ is None and exc.__cause__ is None


@pytest.mark.parametrize("case", sorted(CALLS))
def test_the_users_own_exception_context_is_untouched(case: str) -> None:
    kw, call = CALLS[case]
    exc = _raise_under(kw, call, chained=True)
    assert isinstance(exc.__context__, KeyError)
    assert exc.__context__.args == ("missing",)


def test_the_context_check_can_fail() -> None:
    """What these tests catch: a wrapper that runs the forward inside its
    ``except`` hands the user's exception its own error as ``__context__``."""

    def naive(forward: Callable[[], Any]) -> Any:
        try:
            raise KeyError("observation failed")
        except KeyError:
            return forward()

    with pytest.raises(UserError) as info:
        naive(lambda: Raises(False)(torch.rand(2, 4)))
    assert isinstance(info.value.__context__, KeyError)
