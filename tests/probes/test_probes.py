"""Every built-in probe: observe a non-default state, leave it, replay it.

Each case sets the state with torch's own API, observes it, returns to the
neutral state and then shows that inside ``replay()`` the probe observes the
state again, that this differs from the neutral observation, that torch
really behaves as in the original context, and that on exit -- also when the
body raises -- everything is back: the probe's own observation,
``GlobalStateGuard().check()`` and the guard's blind spots.
"""

from __future__ import annotations

import contextvars
import gc
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torchstate as ts
from probe_cases import BUILTIN_PROBES, CASELESS, CASES, Case, mm_dtype
from torch._C._dynamo.guards import GlobalStateGuard

import ctxreplay
from ctxreplay.probes.autocast import AutocastState
from ctxreplay.probes.forward_context import UNSET, LiveState
from ctxreplay.probes.grad_mode import GradModeState
from ctxreplay.testing import check_probe, global_state, leak_check, state_changes


class Boom(Exception):
    pass


def test_cases_cover_every_builtin_probe() -> None:
    builtin = {n for n, i in ctxreplay.probes.available_probes().items() if i.origin == "builtin"}
    assert builtin == BUILTIN_PROBES
    assert {c.probe for c in CASES} == BUILTIN_PROBES - set(CASELESS)


def _observe_in(case: Case) -> tuple[Any, object]:
    probe = ctxreplay.probes.get_probe(case.probe)
    with case.make():
        return probe.observe(), case.effect()


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_replay_reestablishes_the_observed_state(case: Case) -> None:
    probe = ctxreplay.probes.get_probe(case.probe)
    neutral, neutral_effect, neutral_global = probe.observe(), case.effect(), global_state()
    live, live_effect = _observe_in(case)

    assert live != neutral, "the case must change what the probe observes"
    assert live_effect != neutral_effect, "the case must change what torch does"
    assert probe.observe() == neutral
    assert case.effect() == neutral_effect  # not replayed: the neutral behaviour

    guard = GlobalStateGuard()
    with probe.replay(live):
        assert probe.observe() == live
        assert probe.observe() != neutral
        assert case.effect() == live_effect
    assert probe.observe() == neutral
    assert guard.check(), guard.reason()
    assert global_state() == neutral_global
    assert case.effect() == neutral_effect


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_replay_restores_when_the_body_raises(case: Case) -> None:
    probe = ctxreplay.probes.get_probe(case.probe)
    neutral, neutral_global = probe.observe(), global_state()
    live, live_effect = _observe_in(case)
    guard = GlobalStateGuard()
    with pytest.raises(Boom), probe.replay(live):
        assert probe.observe() == live
        assert case.effect() == live_effect
        raise Boom
    assert probe.observe() == neutral
    assert guard.check(), guard.reason()
    assert global_state() == neutral_global


@pytest.mark.parametrize("case", [c for c in CASES if c.probe != "rng"], ids=lambda c: c.id)
def test_the_leak_oracle_sees_every_replayed_state(case: Case) -> None:
    """Inside a replay, the oracle used to check restoration reports a change;
    so the restoration checks above can fail."""
    probe = ctxreplay.probes.get_probe(case.probe)
    live, _ = _observe_in(case)
    guard, before = GlobalStateGuard(), global_state()
    cm = probe.replay(live)
    try:
        with pytest.raises(AssertionError, match="leaked"), leak_check("oracle", probes=()):
            cm.__enter__()
            assert state_changes(guard, before)
    finally:
        cm.__exit__(None, None, None)
    assert not state_changes(guard, before)


@pytest.mark.parametrize("name", sorted(BUILTIN_PROBES - set(CASELESS)))
def test_check_probe_on_every_builtin(name: str) -> None:
    probe = ctxreplay.probes.get_probe(name)
    states = [_observe_in(c)[0] for c in CASES if c.probe == name]
    assert len(set(states)) == len(states) >= 1
    check_probe(probe, states, neutral=probe.observe())


def test_nested_autocast_dtype_switch() -> None:
    probe = ctxreplay.probes.get_probe("autocast")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = probe.observe()
    with torch.autocast("cpu", dtype=torch.float16):
        fp16 = probe.observe()
    assert bf16 == AutocastState((("cpu", torch.bfloat16),))
    assert fp16 == AutocastState((("cpu", torch.float16),))
    with probe.replay(bf16):
        with probe.replay(fp16):
            assert probe.observe() == fp16
            assert mm_dtype() == torch.float16
        assert probe.observe() == bf16
        assert mm_dtype() == torch.bfloat16
    assert mm_dtype() == torch.float32


def test_autocast_dtype_of_a_disabled_device_is_a_guard_blind_spot() -> None:
    """GlobalStateGuard compares the dtype only while autocast is enabled;
    global_state() sees it always."""
    guard, before = GlobalStateGuard(), global_state()
    with ts.setting(lambda: torch.get_autocast_dtype("cpu"),
                    lambda d: torch.set_autocast_dtype("cpu", d), torch.float16):
        assert guard.check()
        assert global_state() != before
        assert any(c.startswith("autocast:") for c in state_changes(guard, before))
    assert not state_changes(guard, before)


def test_no_grad_to_inference_mode_is_a_guard_blind_spot_the_probe_sees() -> None:
    probe = ctxreplay.probes.get_probe("grad_mode")
    with torch.no_grad():
        guard = GlobalStateGuard()
        with probe.replay(GradModeState(False, True)):
            assert guard.check()
            assert torch.is_inference_mode_enabled()
            assert probe.observe() == GradModeState(False, True)
        assert probe.observe() == GradModeState(False, False)


def test_grad_mode_split_replay_keeps_inference_mode_around() -> None:
    probe = ctxreplay.probes.get_probe("grad_mode")
    inside, around = probe.split_replay(GradModeState(False, True))
    assert inside is not None and around is not None
    with around:
        assert torch.is_inference_mode_enabled()
        with inside:
            assert probe.observe() == GradModeState(False, True)
    assert probe.observe() == GradModeState(True, False)


def test_check_probe_reports_a_probe_that_does_not_restore() -> None:
    class LeakyDtype(ctxreplay.probes.ContextProbe[torch.dtype]):
        name = "leaky_dtype"

        def observe(self) -> torch.dtype:
            return torch.get_default_dtype()

        @contextmanager
        def _replay(self, state: torch.dtype) -> Iterator[None]:
            torch.set_default_dtype(state)
            yield  # never puts the old dtype back

        def replay(self, state: torch.dtype) -> AbstractContextManager[None]:
            return self._replay(state)

    try:
        pattern = r"(?s)'leaky_dtype'.*default_dtype: torch.float32 -> torch.float64"
        with pytest.raises(AssertionError, match=pattern):
            check_probe(LeakyDtype(), [torch.float64])
    finally:
        torch.set_default_dtype(torch.float32)


def test_check_probe_reports_a_guarded_probe_that_watches_too_little() -> None:
    """The default device is invisible to GlobalStateGuard: a probe claiming
    ``guarded`` without watching it would let a cached snapshot go stale."""
    device_probe = ctxreplay.probes.get_probe("default_device")

    class BlindDevice(type(device_probe)):  # type: ignore[misc]
        name = "blind_device"
        guarded = True

        def watch(self, state: str) -> tuple[tuple[Callable[[], object], object], ...]:
            return ()

    with torch.device("meta"):
        meta = device_probe.observe()
    check_probe(device_probe, [meta])  # the real probe watches it
    with pytest.raises(AssertionError, match="neither GlobalStateGuard nor watch"):
        check_probe(BlindDevice(), [meta])


def test_check_probe_refuses_a_state_equal_to_the_current_one() -> None:
    probe = ctxreplay.probes.get_probe("default_dtype")
    with pytest.raises(AssertionError, match="proves nothing"):
        check_probe(probe, [torch.get_default_dtype()])


# -- forward context and context variables -----------------------------------

@dataclass(eq=False)  # identity semantics, like most framework context objects
class Ctx:
    backend: str
    scale: float = 1.0
    payload: list[float] = field(default_factory=lambda: [0.0] * 8)


_current: list[Ctx] = []


def get_ctx() -> Ctx:
    assert _current, "forward context is not set"  # like vLLM's getter
    return _current[-1]


@contextmanager
def set_ctx(ctx: Ctx) -> Iterator[None]:
    _current.append(ctx)
    try:
        yield
    finally:
        _current.pop()


def _observe_ctx(probe: ctxreplay.probes.ContextProbe[LiveState], ctx: Ctx) -> LiveState:
    with set_ctx(ctx):
        return probe.observe()


def test_forward_context_probe_contract() -> None:
    probe = ctxreplay.probes.ForwardContextProbe(get_ctx, set_ctx, name="test_fwd")
    assert probe.observe() == UNSET
    a, b = Ctx("flash", 0.5), Ctx("sdpa", 2.0)
    states = [_observe_ctx(probe, a), _observe_ctx(probe, b)]
    assert states[0] != states[1]
    check_probe(probe, states, neutral=UNSET, clear=False)

    with probe.replay(states[1]):
        assert get_ctx() is b  # the live object itself is re-established
    assert not _current
    with pytest.raises(ctxreplay.probes.NotPortableError):
        probe.encode(states[0])
    probe.clear()


def test_forward_context_probe_restores_when_the_body_raises() -> None:
    probe = ctxreplay.probes.ForwardContextProbe(get_ctx, set_ctx, name="test_fwd")
    state = _observe_ctx(probe, Ctx("flash"))
    with pytest.raises(Boom), probe.replay(state):
        assert probe.observe() == state
        raise Boom
    assert probe.observe() == UNSET
    assert not _current


def test_forward_context_clear_drops_the_live_object() -> None:
    probe = ctxreplay.probes.ForwardContextProbe(get_ctx, set_ctx, name="test_fwd")
    ctx = Ctx("flash")
    ref = weakref.ref(ctx)
    state = _observe_ctx(probe, ctx)
    snap = ctxreplay.snapshot([probe])
    with set_ctx(ctx):
        snap_live = ctxreplay.snapshot([probe])
    del ctx
    gc.collect()
    assert ref() is not None, "the probe must hold the value until clear()"
    with snap_live.replay():
        assert get_ctx() is ref()

    probe.clear()
    gc.collect()
    assert ref() is None, "clear() must drop the live object"
    with pytest.raises(LookupError, match="cleared"):
        probe.replay(state)
    with pytest.raises(LookupError), snap_live.replay():
        pass
    with snap.replay():  # the unset state needs no live object
        assert not _current


def test_forward_context_key_groups_equal_contexts() -> None:
    probe = ctxreplay.probes.ForwardContextProbe(get_ctx, set_ctx, name="test_fwd",
                                          key=lambda c: (c.backend, c.scale))
    first, second, other = Ctx("flash", 0.5), Ctx("flash", 0.5), Ctx("flash", 1.0)
    s1, s2, s3 = (_observe_ctx(probe, c) for c in (first, second, other))
    assert s1 == s2 and hash(s1) == hash(s2) and s1 is s2
    assert s1 != s3
    with probe.replay(s2):
        assert get_ctx() is first  # the first value seen for a key is replayed

    by_identity = ctxreplay.probes.ForwardContextProbe(get_ctx, set_ctx, name="test_fwd_id")
    assert _observe_ctx(by_identity, first) != _observe_ctx(by_identity, second)
    probe.clear()
    by_identity.clear()


def test_forward_context_max_held() -> None:
    probe = ctxreplay.probes.ForwardContextProbe(get_ctx, set_ctx, name="test_fwd", max_held=1)
    kept = _observe_ctx(probe, Ctx("a"))
    dropped = _observe_ctx(probe, Ctx("b"))
    assert probe.dropped == 1
    with probe.replay(kept):
        assert get_ctx().backend == "a"
    with pytest.raises(LookupError, match="not retained"):
        probe.replay(dropped)
    probe.clear()


def test_forward_context_getter_raising_means_unset() -> None:
    def getter() -> Ctx:
        raise RuntimeError("no context")

    probe = ctxreplay.probes.ForwardContextProbe(getter, set_ctx, name="test_fwd")
    assert probe.observe() == UNSET


def test_forward_context_traceable_flag() -> None:
    assert not ctxreplay.probes.ForwardContextProbe(get_ctx, set_ctx).traceable
    assert ctxreplay.probes.ForwardContextProbe(get_ctx, set_ctx, traceable=True).traceable
    assert not ctxreplay.probes.ForwardContextProbe(get_ctx, set_ctx).portable


_var: contextvars.ContextVar[Any] = contextvars.ContextVar("ctxreplay_test_var")


def _observe_var(probe: ctxreplay.probes.ContextVarProbe, value: Any) -> LiveState:
    token = _var.set(value)
    try:
        return probe.observe()
    finally:
        _var.reset(token)


def test_context_var_probe_contract() -> None:
    probe = ctxreplay.probes.ContextVarProbe(_var)
    assert probe.name == "contextvar_ctxreplay_test_var"
    assert probe.observe() == UNSET
    a, b = {"mode": "prefill"}, {"mode": "decode"}
    states = [_observe_var(probe, a), _observe_var(probe, b)]
    check_probe(probe, states, neutral=UNSET, clear=False)
    with probe.replay(states[0]):
        assert _var.get() is a
    assert _var.get(None) is None
    with pytest.raises(Boom), probe.replay(states[1]):
        assert _var.get() is b
        raise Boom
    assert _var.get(None) is None
    probe.clear()
    with pytest.raises(LookupError):
        probe.replay(states[0])


def test_context_var_none_is_unset() -> None:
    probe = ctxreplay.probes.ContextVarProbe(_var, name="test_var")
    assert probe.name == "test_var"
    assert _observe_var(probe, None) == UNSET
