"""A probe that breaks its contract fails naming itself, the state and the rule.

The probes of ``bad_probes`` (a ``replay`` without ``@contextmanager``, one
that returns nothing, an unhashable state, a ``split_replay`` of no
contexts) used where ctxreplay uses probes: a snapshot's replay and its
split for a capture raise ``ProbeContractError`` naming them, a snapshot of
an unhashable state raises ``ProbeObservationError`` naming the probe and
the rule, and inside a session the report's failure (``replay_failed``) and
problem (``observation_error``) say the same -- never only ``'NoneType'
object does not support the context manager protocol`` or
``observe:TypeError``.  Observing a good state costs what it did: the hash
is checked where a new state is recorded, not on every call.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import bad_probes as bad
import pytest
import torch
from torch import nn

import ctxreplay
from ctxreplay.core.observer import Observer, ProbeObservationError
from ctxreplay.core.probe import ProbeContractError
from ctxreplay.probes import ContextProbe

RULE = "must return a context manager (decorate a generator with @contextlib.contextmanager)"


@pytest.fixture(autouse=True)
def _setting_back() -> Iterator[None]:
    yield
    bad.SETTING["mode"] = "a"


def _snapshot(probe: ContextProbe[Any]) -> ctxreplay.ContextSnapshot:
    with bad.setting("b"):
        return ctxreplay.snapshot([probe])


@pytest.mark.parametrize("probe, returned", [(bad.BareGenerator(), "returned a generator"),
                                             (bad.ReturnsNone(), "returned None")],
                         ids=["bare-generator", "returns-none"])
def test_a_snapshot_replay_names_the_probe_the_state_and_the_rule(
        probe: ContextProbe[Any], returned: str) -> None:
    snap = _snapshot(probe)
    for enter in (snap.replay, lambda: snap.replay_parts(embedded=False)[1],
                  lambda: snap.replay_parts()[1]):
        with pytest.raises(ProbeContractError) as info, enter():
            pass
        text = str(info.value)
        assert f"probe {probe.name!r}" in text and "replay(mode=b)" in text
        assert returned in text and RULE in text
        assert info.value.code == "replay_not_a_context"


def test_a_split_replay_of_no_contexts_names_the_rule() -> None:
    with pytest.raises(ProbeContractError, match="probe 'bad_split': split_replay"):
        _snapshot(bad.BadSplit()).replay_parts()


def test_an_unhashable_state_is_named_where_it_is_observed() -> None:
    with pytest.raises(ProbeObservationError) as info:
        _snapshot(bad.Unhashable())
    assert info.value.probe == "unhashable"
    assert info.value.exc_type == "unhashable_state(list)"
    assert "observe() returned an unhashable state of type list" in str(info.value)
    assert "states must be hashable" in str(info.value)


def test_a_good_state_is_hashed_once_per_new_state_not_per_call() -> None:
    hashed = []

    class Counted(tuple[str]):
        def __hash__(self) -> int:
            hashed.append(1)
            return super().__hash__()

    class CountedProbe(bad.Good):
        name = "counted"
        guarded = True  # reused while the guard holds

        def observe(self) -> Any:
            return Counted((bad.SETTING["mode"],))

        def watch(self, state: Any) -> Any:
            return ((lambda: bad.SETTING["mode"], state[0]),)

    observer = Observer((CountedProbe(),))
    first = observer()
    for _ in range(50):
        assert observer() is first
    assert len(hashed) == 1


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh())


@pytest.mark.parametrize("probe", [bad.BareGenerator(), bad.ReturnsNone()],
                         ids=["bare-generator", "returns-none"])
def test_a_capture_that_cannot_replay_says_which_probe_and_rule(
        probe: ContextProbe[Any]) -> None:
    model = _model()
    with ctxreplay.capture_with(model, probes=[probe], verify="execute") as session, \
            bad.setting("b"), torch.no_grad():
        model(torch.rand(2, 4))
    report = session.finalize()
    assert not report.ok
    (failure,) = report.failures
    assert failure.reason == "replay_failed"
    assert f"probe {probe.name!r}" in failure.message and "mode=b" in failure.message
    assert "must return a context manager" in failure.message
    if isinstance(probe, bad.BareGenerator):  # it never ran (the other sets, never restores)
        assert bad.SETTING["mode"] == "a"


def test_an_unhashable_state_in_a_session_names_the_probe_and_the_rule() -> None:
    model = _model()
    with ctxreplay.capture_with(model, probes=[bad.Unhashable()]) as session, \
            bad.setting("b"), torch.no_grad():
        model(torch.rand(2, 4))
        model(torch.rand(2, 4))
    report = session.finalize()
    assert not report.ok
    (problem,) = [p for p in report.problems if p.reason == "observation_error"]
    assert problem.calls == 2
    assert "probe unhashable" in problem.names
    assert "observe:unhashable_state(list)" in problem.names
    assert "observe() must return a hashable state" in problem.message
