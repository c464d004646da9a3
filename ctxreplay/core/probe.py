"""The probe contract: one kind of ambient state, observed, replayed, cleared."""

from __future__ import annotations

import abc
import functools
import inspect
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Any, ClassVar, Generic, TypeVar

from .._base.torchcaps import CAPS, dynamo_compiling
from ..errors import Error

__all__ = ["CONTRACT_RULES", "ContextProbe", "FrameworkStateError", "NotPortableError", "Part",
           "ProbeContractError", "applying", "composed", "restoring", "unhashable"]

S = TypeVar("S")
T = TypeVar("T")


class NotPortableError(Error, TypeError):
    """Raised by ``encode`` when a state holds live objects that JSON cannot carry."""


#: each rule of the probe contract a ``ProbeContractError`` names, by code
CONTRACT_RULES = {
    "replay_not_a_context": "replay(state) must return a context manager (decorate a "
                            "generator with @contextlib.contextmanager)",
    "split_not_contexts": "split_replay(state) must return (inside, around), each a "
                          "context manager or None",
    "unhashable_state": "observe() must return a hashable state (attrs frozen classes or "
                        "tuples)",
}


class ProbeContractError(Error, TypeError):
    """A probe broke its contract: ``replay`` (or ``split_replay``) returned
    no context manager, or ``observe`` an unhashable state.  The message
    names the probe, the state and the rule; ``probe`` is the probe's name,
    ``code`` the rule's (a key of ``CONTRACT_RULES``), ``state_type`` the
    type name of the state concerned."""

    def __init__(self, probe: str, code: str, state_type: str, detail: str) -> None:
        super().__init__(f"probe {probe!r}: {detail}")
        self.probe = probe
        """The name of the probe that broke the contract."""
        self.code = code
        """The rule it broke (a key of ``CONTRACT_RULES``)."""
        self.state_type = state_type
        """The type name of the state concerned (metadata, never its value)."""


class FrameworkStateError(Error, RuntimeError):
    """A probe of a framework's state cannot read it in the installed release
    (a private name it reads moved).  ``framework`` and ``version`` name the
    release; a report's ``observation_error`` lists both."""

    def __init__(self, framework: str, version: str, detail: str) -> None:
        super().__init__(f"{framework} {version}: {detail}")
        self.framework = framework
        """The framework's distribution name (``diffusers``)."""
        self.version = version
        """Its installed version."""


class ContextProbe(abc.ABC, Generic[S]):
    """One kind of ambient execution state.

    A probe observes the state cheaply (``observe`` runs on every hooked call),
    re-establishes an observed state exactly (``replay``), and drops any live
    references it keeps (``clear``).  States are immutable and hashable: they
    become part of a capture's variant key.

    Class attributes describe the probe to the registry and to the engine:

    * ``name`` -- registry key; an instance may override it.
    * ``description`` -- one line for ``ctxreplay probes``.
    * ``default`` -- part of the default set used when ``probes=None``.
    * ``traceable`` -- ``replay()`` may be entered *inside* a traced callable
      and the tracer records it (e.g. ``torch.autocast``), so an exported
      artifact carries the state.  See ``split_replay`` for partial cases.
    * ``portable`` -- ``encode``/``decode`` carry the state through JSON.
    * ``pinnable`` -- the state only sets defaults of factory ops, which the
      engine's pinning pass writes into the graph, so an artifact carries it.
    * ``guarded`` -- every part of the state that ``watch`` does not list is
      covered by torch's global-state guard, so a snapshot may be reused
      while that guard holds and the watched getters return the same values.
    * ``baked`` -- the state only steers the Python of the forward (which
      function it calls), so a graph traced under the replay holds the
      choice: replayed around the capture, yet carried by the artifact.
    * ``requires`` -- modules that must already be imported for a ``default``
      probe to join the default set (a framework's state exists only once
      the framework is loaded; ctxreplay never imports it itself).
    """

    name: str = ""
    """The registry key (an instance may override it)."""
    description: str = ""
    """One line for ``ctxreplay probes``."""
    default: ClassVar[bool] = False
    """Part of the default set used when ``probes=None``."""
    traceable: ClassVar[bool] = False
    """``replay()`` may be entered inside a traced callable and the tracer records it (as
    ``torch.export`` records ``torch.autocast``), so the artifact carries the state;
    ``split_replay`` handles partial cases."""
    portable: ClassVar[bool] = True
    """``encode`` / ``decode`` carry the state through JSON."""
    guarded: ClassVar[bool] = False
    """Every part of the state ``watch`` does not list is covered by torch's global-state guard, so
    a snapshot may be reused while that guard holds."""
    pinnable: ClassVar[bool] = False
    """The state only sets defaults of factory ops, which the engine's pinning pass writes into the
    graph, so an artifact carries it."""
    baked: ClassVar[bool] = False
    """The state only steers the Python of the forward (which function it calls): a graph traced
    under the replay holds the choice, so the artifact carries it although it is replayed around
    the capture."""
    requires: ClassVar[tuple[str, ...]] = ()
    """Top-level modules that must already be in ``sys.modules`` for the probe to be active: a
    ``default`` probe joins the default set only then, judged each time the default set is
    resolved (``capture_with``, ``snapshot``), whatever the import order."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # Every caller of ``replay`` and ``split_replay`` enters what they
        # return (a snapshot's ExitStack, the checks' neutral state, a loaded
        # capture's guard): a probe's own definition of either is checked
        # where it returns, so a broken one fails naming itself and the rule,
        # not later as a bare ``with`` error (``'NoneType' object does not
        # support the context manager protocol``).
        super().__init_subclass__(**kwargs)
        for name, check in (("replay", _checked_replay), ("split_replay", _checked_split)):
            method = cls.__dict__.get(name)
            if callable(method) and not getattr(method, "__ctxreplay_checked__", False):
                setattr(cls, name, check(method))

    def inactive_reason(self) -> str | None:
        """Why the probe is not active now (``None``: it is).  Default: the
        first module of ``requires`` that is not imported yet."""
        for module in self.requires:
            if module not in sys.modules:
                return f"{module} is not imported"
        return None

    @abc.abstractmethod
    def observe(self) -> S:
        """The current state: immutable, hashable, cheap to compute."""

    @abc.abstractmethod
    def replay(self, state: S) -> AbstractContextManager[None]:
        """A context that establishes ``state`` and, on exit, restores exactly
        what it found -- also when the body raises."""

    def clear(self) -> None:
        """Drop live objects this probe holds (called after capture)."""

    def bind(self, module: Any) -> ContextProbe[S]:
        """The probe to use for ``module``: the model ``capture_with``
        observes or ``install`` dispatches, before its first call.  A probe of
        state the model itself holds (a framework's per-model setting)
        returns a new instance that reads it there, so two models never mix;
        the default is the probe itself."""
        return self

    def watch(self, state: S) -> tuple[tuple[Callable[[], object], object], ...]:
        """``(getter, expected)`` pairs: ``state`` is still current while torch's
        global-state guard holds and every ``getter()`` returns ``expected``.

        Called once per newly observed state, never per call; the getters run
        on every call, so make them zero-argument C-level functions where
        possible.  A ``guarded`` probe lists only what torch's
        ``GlobalStateGuard`` is blind to (the default device, cuDNN flags,
        ``high`` vs ``medium`` matmul precision, ...); the default for an
        unguarded probe is its whole observation.
        """
        return () if self.guarded else ((self.observe, state),)

    def watch_forward(self, state: S) -> tuple[tuple[Callable[[], object], object], ...]:
        """``(getter, expected)`` pairs for *process-global* state that torch's
        guard cannot see and that changes only the numerics of kernels, never
        the traced graph (cuDNN flags, TF32 and per-backend float32
        precision): checked once per call of the observed model (the module
        given to ``capture_with``) instead of on every block call, because
        reading a dozen such flags per block would cost more than a hook pair.
        ``capture_with(..., watch="call")`` checks them on every call.
        Default: none.  Anything that can change a traced graph belongs in
        ``watch``."""
        return ()

    def neutral_state(self) -> S | None:
        """The state a fresh process observes (``None``: unknown).  Execution
        checks run artifacts from this state -- plus only what a capture needs
        re-established -- never from whatever the caller of ``finalize()``
        has active."""
        return None

    def split_replay(
        self, state: S
    ) -> tuple[AbstractContextManager[None] | None, AbstractContextManager[None] | None]:
        """``(inside, around)``: the part of the replay a tracer records when it is
        entered inside the captured callable, and the part that must surround the
        capture call.  Either may be ``None``."""
        if self.traceable:
            return self.replay(state), None
        return None, self.replay(state)

    def neutral(self, state: S) -> bool:
        """Whether ``state`` is what a fresh process has (it then needs no
        re-establishing when an artifact is run elsewhere)."""
        return False

    def encode(self, state: S) -> Any:
        """A JSON-safe form of ``state``; raise ``NotPortableError`` if it has none."""
        raise NotPortableError(f"probe {self.name!r} has no portable encoding")

    def decode(self, data: Any, path: str) -> S:
        """Inverse of ``encode``; raise ``ValueError`` naming ``path`` on bad input."""
        raise ValueError(f"{path}: probe {self.name!r} has no portable encoding")

    def describe(self, state: S) -> str:
        """A short human-readable form of ``state`` (metadata only)."""
        return repr(state)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


def _short(probe: ContextProbe[Any], state: Any) -> str:
    """``probe.describe(state)`` cut to one short line; never raises."""
    try:
        text = str(probe.describe(state))
    except Exception:  # a user's probe may raise anything: a generic text
        text = f"<a {type(state).__name__}>"
    text = "".join(c if c.isprintable() else " " for c in text)
    return text if len(text) <= 40 else text[:37] + "..."


def _is_context(value: Any) -> bool:
    # ``with`` looks both methods up on the type
    return hasattr(type(value), "__enter__") and hasattr(type(value), "__exit__")


def _returned(value: Any) -> str:
    if value is None:
        return "returned None"
    if inspect.isgenerator(value):
        return "returned a generator"
    return f"returned a {type(value).__name__}"


_CONTEXT_RULE = ("must return a context manager (decorate a generator with "
                 "@contextlib.contextmanager)")


def _checked_replay(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def replay(self: ContextProbe[Any], state: Any) -> Any:
        cm = method(self, state)
        if not dynamo_compiling() and not _is_context(cm):
            if inspect.isgenerator(cm):
                cm.close()  # never started: nothing to undo
            raise ProbeContractError(self.name, "replay_not_a_context", type(state).__name__,
                                     f"replay({_short(self, state)}) {_returned(cm)}; "
                                     f"replay {_CONTEXT_RULE}")
        return cm

    replay.__ctxreplay_checked__ = True  # type: ignore[attr-defined]
    return replay


def _checked_split(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def split_replay(self: ContextProbe[Any], state: Any) -> Any:
        parts = method(self, state)
        if dynamo_compiling() or (isinstance(parts, tuple) and len(parts) == 2 and all(
                p is None or _is_context(p) for p in parts)):
            return parts
        got = f"a {type(parts).__name__}" if not isinstance(parts, tuple) or len(parts) != 2 \
            else ", ".join(_returned(p).replace("returned ", "") for p in parts)
        raise ProbeContractError(self.name, "split_not_contexts", type(state).__name__,
                                 f"split_replay({_short(self, state)}) returned ({got}); "
                                 "split_replay must return (inside, around), each a "
                                 "context manager or None")

    split_replay.__ctxreplay_checked__ = True  # type: ignore[attr-defined]
    return split_replay


def unhashable(probe: ContextProbe[Any], state: Any) -> ProbeContractError | None:
    """The error for an observed ``state`` that cannot be part of a variant
    key (``None``: it hashes)."""
    try:
        hash(state)
    except TypeError:
        kind = type(state).__name__
        return ProbeContractError(probe.name, "unhashable_state", kind,
                                  f"observe() returned an unhashable state of type {kind}; "
                                  "states must be hashable (attrs frozen classes or tuples)")
    return None


@contextmanager
def applying(observe: Callable[[], T], apply: Callable[[T], object], state: T
             ) -> Iterator[None]:
    """Establish ``state`` with ``apply`` and put back what ``observe`` saw --
    on exit, on error, and when ``apply`` fails halfway."""
    before = observe()
    if before == state:
        yield
        return
    try:
        apply(state)
    except BaseException:  # put back, then re-raised
        apply(before)
        raise
    try:
        yield
    finally:
        apply(before)


@contextmanager
def restoring(get: Callable[[], T], set_: Callable[[T], object], value: T) -> Iterator[None]:
    """Set a value through a setter and put back what was there, whatever happens."""
    before = get()
    if before == value:
        yield
        return
    set_(value)
    try:
        yield
    finally:
        set_(before)


#: a part of a composed replay: makes its context just before it is entered
#: (``None``: nothing to enter)
Part = Callable[[], "AbstractContextManager[Any] | None"]


def composed(parts: Iterable[Part]) -> AbstractContextManager[None]:
    """One context that enters the context each part makes, in order, and exits
    them in reverse -- on success, on error, and when one fails to enter (the
    ones already entered are exited then).  Each part is called just before
    its context is entered, so a context that acts when it is made
    (``torch.set_grad_enabled``) acts in order too.

    An ``ExitStack`` where the tracer can trace one; while Dynamo traces on a
    torch whose Dynamo cannot (before 2.11, ``CAPS.dynamo_traces_exitstack``),
    plain nested ``with`` statements, which mean the same."""
    made = tuple(parts)
    if not CAPS.dynamo_traces_exitstack and dynamo_compiling():
        return _nested(made, 0)
    return _stacked(made)


@contextmanager
def _stacked(parts: Sequence[Part]) -> Iterator[None]:
    with ExitStack() as stack:
        for make in parts:
            cm = make()
            if cm is not None:
                stack.enter_context(cm)
        yield


@contextmanager
def _nested(parts: Sequence[Part], i: int) -> Iterator[None]:
    if i == len(parts):
        yield
        return
    cm = parts[i]()
    if cm is None:
        with _nested(parts, i + 1):
            yield
        return
    with cm, _nested(parts, i + 1):
        yield
