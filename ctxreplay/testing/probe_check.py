"""Test helpers for probe authors and for "replay leaked nothing" oracles.

``check_probe(probe, states)`` runs the probe contract against states the
test produced (observe inside a context it set up, then pass the observed
states in).  ``leak_check()`` is a context manager that fails when the global
torch state on exit differs from the state on entry; ``global_state()`` is the
comparable tuple it uses for the parts torch's own ``GlobalStateGuard`` does
not see (the default device, inference mode, cuDNN flags, ...).

A test suite can make the leak oracle automatic with a fixture::

    @pytest.fixture(autouse=True)
    def _no_leaks(request):
        with ctxreplay.testing.leak_check(request.node.nodeid):
            yield
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Any, NoReturn, TypeVar

from .._base.torchcaps import GlobalStateGuard
from ..core import registry
from ..core.probe import ContextProbe, NotPortableError, ProbeContractError, unhashable
from .leaks import GlobalState, global_state, leak_check, state_changes

__all__ = ["GlobalState", "check_probe", "global_state", "leak_check", "state_changes"]

S = TypeVar("S")


class _BodyError(Exception):
    """Raised inside a replay to check that the state is restored on error."""


class _BrokenContract(AssertionError):
    """A probe broke the contract (``replay`` returned no context manager):
    what it changed before that is a consequence, not the diagnosis."""


def _describe(probe: ContextProbe[Any], state: Any) -> str:
    try:
        return probe.describe(state)
    except Exception as exc:  # a probe under test may raise anything: reported
        return f"<describe failed: {type(exc).__name__}>"


class _Checker:
    def __init__(self, probe: ContextProbe[Any], outside: Any) -> None:
        self.probe = probe
        self.outside = outside
        # The default probes plus this one (replacing a same-named default).
        names = [n for n in registry.default_probes() if n != probe.name]
        self.oracle_probes: list[str | ContextProbe[Any]] = [*names, probe]

    def fail(self, label: str, check: str, detail: str, *,
             kind: type[AssertionError] = AssertionError) -> NoReturn:
        raise kind(
            f"check_probe: probe {self.probe.name!r}, {label}: {check} failed: {detail}"
        )

    def expect(self, label: str, check: str, want: Any) -> None:
        got = self.probe.observe()
        if got != want:
            self.fail(label, check, f"observe() gave {_describe(self.probe, got)!s} "
                      f"({got!r}), expected {_describe(self.probe, want)!s} ({want!r})")

    def expect_outside(self, label: str, check: str) -> None:
        self.expect(label, f"{check}: restored after exit", self.outside)

    @contextmanager
    def no_leak(self, label: str, check: str) -> Iterator[None]:
        broken: list[_BrokenContract] = []
        try:
            with leak_check(f"check_probe: probe {self.probe.name!r}, {label}: {check}",
                            probes=self.oracle_probes):
                try:
                    yield
                except _BrokenContract as exc:
                    broken.append(exc)
                    raise
                finally:
                    self.expect_outside(label, check)
        except AssertionError:
            if broken:  # the state it left behind follows from the broken rule
                raise broken[0] from None
            raise

    def watched(self, label: str, current: Any) -> tuple[tuple[Any, Any], ...]:
        """``watch(current)`` and ``watch_forward(current)``; every getter must
        return its expected value while ``current`` holds."""
        checks: list[tuple[Any, Any]] = []
        for method in ("watch", "watch_forward"):
            try:
                pairs = tuple(getattr(self.probe, method)(current))
            except Exception as exc:  # a probe under test may raise anything: reported
                self.fail(label, f"{method}()", f"raised {type(exc).__name__}: {exc}")
            for getter, expected in pairs:
                try:
                    got = getter()
                except Exception as exc:  # a probe under test may raise anything: reported
                    self.fail(label, f"{method}() getters never raise",
                              f"{getter!r}() raised {type(exc).__name__}: {exc}")
                if got != expected:
                    self.fail(label, f"{method}() while its state is current",
                              f"{getter!r}() returned {got!r}, {method}() expected "
                              f"{expected!r}")
            checks.extend(pairs)
        return tuple(checks)

    def expect_switch_seen(self, label: str, current: Any, new: Any) -> None:
        """While ``current`` holds, ``watch(current)`` and
        ``watch_forward(current)`` must hold; and replaying ``new`` must trip
        GlobalStateGuard or one of those getters, else a snapshot cached for
        ``current`` would be reused under ``new``."""
        checks = self.watched(label, current)
        guard = GlobalStateGuard()
        with self.replay(label, new):
            if guard.check() and all(g() == e for g, e in checks):
                self.fail(label, "the switch is visible to a cached snapshot",
                          f"from {_describe(self.probe, current)} to "
                          f"{_describe(self.probe, new)} neither GlobalStateGuard nor "
                          "watch() nor watch_forward() sees a change, so a snapshot "
                          "cached before the switch would be reused; watch() (or, for "
                          "process-global numerics-only state, watch_forward()) must "
                          "list the getters the guard is blind to")

    @contextmanager
    def propagates(self, label: str, check: str) -> Iterator[None]:
        """The body raises ``_BodyError``; it must come out of what the body
        ran in, not be swallowed."""
        try:
            yield
        except _BodyError:
            return
        self.fail(label, check, "the exception was swallowed")

    def replay(self, label: str, state: Any) -> AbstractContextManager[None]:
        try:
            return self.probe.replay(state)
        except ProbeContractError as exc:  # it says which rule
            self.fail(label, "replay() returns a context manager", str(exc),
                      kind=_BrokenContract)
        except Exception as exc:  # a probe under test may raise anything: reported
            self.fail(label, "replay()", f"raised {type(exc).__name__}: {exc}")


def check_probe(
    probe: ContextProbe[S],
    states: Iterable[S],
    *,
    neutral: S | None = None,
    clear: bool = True,
) -> None:
    """Check the probe contract for each of ``states``; raise ``AssertionError``
    naming the probe, the state and the failed check.

    Each state must differ from what the probe observes now (otherwise a
    replay would prove nothing): produce it by observing inside a context the
    test set up.  ``neutral``, when given, is what the probe must observe
    now, outside any replay -- in a test process that has changed nothing,
    the fresh state that ``neutral_state()`` must declare.  Checked, for
    every state:

    1. it is hashable, and inside ``probe.replay(state)``,
       ``probe.observe() == state`` (observe after replay is the identity);
    2. after exit, the probe observes exactly what it did before, and
       ``leak_check`` (``GlobalStateGuard`` + ``global_state()`` + the
       default probes) finds nothing changed;
    3. the same when the body raises -- and the exception propagates;
    4. ``split_replay``: entering its ``around`` then its ``inside`` part
       establishes the state and restores it;
    5. if ``probe.portable``: ``decode(encode(state))`` through
       ``json.dumps``/``json.loads`` equals the state; otherwise ``encode``
       raises ``NotPortableError``;

    6. ``watch(state)``'s and ``watch_forward(state)``'s getters return
       their expected values (and never raise) while the state is current,
       and switching from the state before to this one -- and between any
       two different given states -- trips ``GlobalStateGuard`` or one of
       those getters (so a cached snapshot is never reused for a different
       state);
    7. ``neutral_state()``, unless ``None``: hashable, ``neutral()`` of it is
       True, it survives the encoding, it equals ``neutral`` when that is
       given (what a fresh process observes), and replaying it inside each
       state establishes it;

    then nested replays of every ordered pair of states (also with the inner
    body raising) and sequential replays of all of them restore correctly;
    and finally (with ``clear=True``) ``probe.clear()`` runs and leaks
    nothing -- after which live states may no longer be replayable.
    """
    states = tuple(states)
    if not states:
        raise ValueError("check_probe needs at least one state")
    outside = probe.observe()
    c = _Checker(probe, outside)
    if neutral is not None and outside != neutral:
        c.fail("before any replay", "neutral",
               f"the probe observes {_describe(probe, outside)} ({outside!r}), "
               f"expected the neutral state {_describe(probe, neutral)} ({neutral!r})")
    declared = _check_neutral_state(c, neutral)
    labels = [f"state #{i} ({_describe(probe, s)})" for i, s in enumerate(states)]
    for label, state in zip(labels, states, strict=True):
        _check_value(c, label, state)
        _check_replay(c, label, state)
        _check_split_replay(c, label, state)
        _check_encoding(c, label, state)
    for label, state in zip(labels, states, strict=True):
        c.expect_switch_seen(f"{label} replayed from the state before", outside, state)
    _check_nested(c, labels, states)
    if declared is not None:
        _check_neutral_nested(c, labels, states, declared)
    _check_sequential(c, labels, states)
    if clear:
        _check_clear(c)


def _check_value(c: _Checker, label: str, state: Any) -> None:
    """The state is hashable, differs from what the probe observes outside
    any replay, and ``describe()`` names it with a string."""
    error = unhashable(c.probe, state)
    if error is not None:
        c.fail(label, "hashable", str(error))
    if state == c.outside:
        c.fail(label, "differs from the current state",
               "the state equals what the probe observes now, so replaying it "
               "proves nothing; pass a state observed under a different context")
    if not isinstance(_describe(c.probe, state), str):
        c.fail(label, "describe()", "did not return a string")


def _check_replay(c: _Checker, label: str, state: Any) -> None:
    """``replay(state)`` establishes the state and restores the outside one
    without a leak, also when the body raises -- and the exception
    propagates."""
    with c.no_leak(label, "replay"), c.replay(label, state):
        c.expect(label, "observe inside replay", state)
    with c.propagates(label, "replay with a raising body"), \
            c.no_leak(label, "replay with a raising body"), c.replay(label, state):
        c.expect(label, "observe inside replay (raising body)", state)
        raise _BodyError


def _check_split_replay(c: _Checker, label: str, state: Any) -> None:
    """Entering ``split_replay``'s ``around`` then its ``inside`` part
    establishes the state and restores it."""
    try:
        inside, around = c.probe.split_replay(state)
    except ProbeContractError as exc:  # it says which rule
        c.fail(label, "split_replay() returns contexts", str(exc), kind=_BrokenContract)
    except Exception as exc:  # a probe under test may raise anything: reported
        c.fail(label, "split_replay()", f"raised {type(exc).__name__}: {exc}")
    with c.no_leak(label, "split_replay"), ExitStack() as stack:
        for part in (around, inside):
            if part is not None:
                stack.enter_context(part)
        c.expect(label, "observe inside split_replay (around, then inside)", state)


def _check_nested(c: _Checker, labels: Sequence[str], states: Sequence[Any]) -> None:
    """Every ordered pair of states replayed one inside the other: the switch
    is seen, each replay establishes its state, and the outer state is back
    after the inner replay exits -- also when the inner body raises."""
    for i, a in enumerate(states):
        for j, b in enumerate(states):
            pair = f"{labels[j]} nested in {labels[i]}"
            with c.no_leak(pair, "nested replay"), c.replay(pair, a):
                c.expect(pair, "outer replay", a)
                if a != b:
                    c.expect_switch_seen(pair, a, b)
                with c.replay(pair, b):
                    c.expect(pair, "inner replay", b)
                c.expect(pair, "outer state after the inner replay exits", a)
                with c.propagates(pair, "nested replay with a raising body"), \
                        c.replay(pair, b):
                    raise _BodyError
                c.expect(pair, "outer state after the inner replay raised", a)


def _check_neutral_nested(c: _Checker, labels: Sequence[str], states: Sequence[Any],
                          declared: Any) -> None:
    """Replaying ``neutral_state()`` inside each state establishes it, and
    the state is back after it exits."""
    for label, state in zip(labels, states, strict=True):
        pair = f"neutral_state() nested in {label}"
        with c.no_leak(pair, "nested replay"), c.replay(pair, state):
            with c.replay(pair, declared):
                c.expect(pair, "replay of neutral_state()", declared)
            c.expect(pair, "outer state after neutral_state() exits", state)


def _check_sequential(c: _Checker, labels: Sequence[str], states: Sequence[Any]) -> None:
    """The states replayed one after another each restore the outside state,
    and together leak nothing."""
    with c.no_leak("all states", "sequential replays"):
        for label, state in zip(labels, states, strict=True):
            with c.replay(label, state):
                c.expect(label, "sequential replay", state)
            c.expect_outside(label, "sequential replay")


def _check_clear(c: _Checker) -> None:
    """``probe.clear()`` runs and leaks nothing."""
    try:
        with c.no_leak("after all checks", "clear()"):
            c.probe.clear()
    except AssertionError:
        raise
    except Exception as exc:  # a probe under test may raise anything: reported
        c.fail("after all checks", "clear()", f"raised {type(exc).__name__}: {exc}")


def _check_neutral_state(c: _Checker, neutral: Any) -> Any:
    """``neutral_state()``, when the probe declares one: hashable, called
    neutral by ``neutral()``, round-tripped by the encoding, and -- when the
    test passed ``neutral``, what this (fresh) process observes -- equal to
    it.  Returns it (or ``None``)."""
    probe, label = c.probe, "neutral_state()"
    try:
        declared = probe.neutral_state()
    except Exception as exc:  # a probe under test may raise anything: reported
        c.fail(label, "neutral_state()", f"raised {type(exc).__name__}: {exc}")
    if declared is None:
        return None
    error = unhashable(probe, declared)
    if error is not None:
        c.fail(label, "hashable", str(error).replace("observe()", "neutral_state()"))
    if neutral is not None and declared != neutral:
        c.fail(label, "neutral_state() is what a fresh state observes",
               f"neutral_state() is {_describe(probe, declared)} ({declared!r}), but a "
               f"fresh state observes {_describe(probe, neutral)} ({neutral!r})")
    try:
        ok = probe.neutral(declared)
    except Exception as exc:  # a probe under test may raise anything: reported
        c.fail(label, "neutral(neutral_state())", f"raised {type(exc).__name__}: {exc}")
    if ok is not True:
        c.fail(label, "neutral(neutral_state()) is True", f"it returned {ok!r}")
    _check_encoding(c, label, declared)
    return declared


def _check_encoding(c: _Checker, label: str, state: Any) -> None:
    probe = c.probe
    if not probe.portable:
        try:
            data = probe.encode(state)
        except NotPortableError:
            return
        except Exception as exc:  # a probe under test may raise anything: reported
            c.fail(label, "encode() of a non-portable probe",
                   f"raised {type(exc).__name__}, expected ctxreplay.NotPortableError")
        c.fail(label, "encode() of a non-portable probe",
               f"returned {data!r}, expected it to raise ctxreplay.NotPortableError")
    try:
        data = probe.encode(state)
        text = json.dumps(data, allow_nan=False)
    except Exception as exc:  # a probe under test may raise anything: reported
        c.fail(label, "encode() gives JSON", f"{type(exc).__name__}: {exc}")
    try:
        back = probe.decode(json.loads(text), "$.state")
    except Exception as exc:  # a probe under test may raise anything: reported
        c.fail(label, "decode(encode(state))", f"{type(exc).__name__}: {exc} (data: {text})")
    if back != state:
        c.fail(label, "decode(encode(state)) == state", f"got {back!r} from {text}")
