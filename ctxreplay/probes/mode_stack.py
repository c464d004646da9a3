"""The user's torch-function and torch-dispatch modes.  In the default set,
observing types only.

Frameworks route ops through a ``TorchFunctionMode`` or ``TorchDispatchMode``
entered around the forward (a mode that re-routes attention, a cast or
quantisation mode).  Both stacks are thread-local.  Torch's own
infrastructure modes are never user state and are not observed: the
default-device ``DeviceContext`` (the ``default_device`` probe owns it), and
what torch pushes while it traces -- measured on torch 2.13, during a
non-strict ``torch.export`` the function stack holds
``_NonStrictTorchFunctionHandler``, ``PreDispatchTorchFunctionMode`` and
``TorchFunctionMetadataMode``, the dispatch stack ``FakeTensorMode``.

What tracers record (measured, torch 2.13, CPU):

* a ``TorchFunctionMode`` -- entered around or inside the traced callable --
  is traced through by non-strict ``torch.export`` and by Dynamo: the graph
  holds the ops the mode called.  Replayed inside the callable, the artifact
  carries it.
* a ``TorchDispatchMode`` is ignored by non-strict ``torch.export``, around
  and inside (the graph holds the original ops), and Dynamo refuses to enter
  one inside its trace.  It is therefore never replayed: a state that holds
  one is reported, by type, as not replayable.

The registered probe (in the default set) observes the modes' types and
replays nothing: a variant observed under a user mode cannot be captured (its
replay raises ``ModeNotReplayableError``, which ``finalize()`` records as a
``replay_failed`` capture failure naming the types and saying how to opt in)
-- never silently captured without the mode.  With no mode active it costs
two C calls per block call (the lengths of both stacks) while the snapshot
is cached.  ``ModeStackProbe(replay_instances=True)``, passed in ``probes=``
(it takes the place of the registered one), keeps the function-mode
instances (live only, at most ``max_held``, dropped by ``clear()``) and
re-enters them inside the traced callable; such a state is not portable (a
document marks it, ``describe()`` names the types).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from typing import Any

import attrs
import torch
from torch.overrides import _get_current_function_mode_stack
from torch.overrides import _pop_mode as _pop_function_mode
from torch.overrides import _push_mode as _push_function_mode
from torch.utils._python_dispatch import (
    _get_current_dispatch_mode_stack as _untyped_dispatch_mode_stack,
)
from torch.utils._python_dispatch import _pop_mode as _pop_dispatch_mode
from torch.utils._python_dispatch import _push_mode as _push_dispatch_mode

from .._base.jsonread import read_list, read_mapping, read_str
from ..core.probe import ContextProbe, NotPortableError
from ..core.registry import register_probe
from ..errors import Error

__all__ = ["ModeNotReplayableError", "ModeStackProbe", "ModeStackState"]

# untyped in the stubs of torch before 2.11
_get_current_dispatch_mode_stack: Callable[[], list[Any]] = _untyped_dispatch_mode_stack

_fn_len = torch._C._len_torch_function_stack
_dispatch_len = torch._C._len_torch_dispatch_stack


class ModeNotReplayableError(Error, LookupError):
    """A mode observed during the live forward cannot be re-established."""


_OWN = __name__.partition(".")[0]


def _is_infrastructure(mode: object) -> bool:
    """Torch's own modes: a class defined in a private torch module (any
    dotted part starting with "_": ``torch._export``, ``torch._subclasses``,
    ``torch.utils._device``), under ``torch.fx`` or ``torch.export``, or a
    private class of torch (``torch.utils.checkpoint``'s caching modes).
    And ctxreplay's own: its execution checks run the artifact under a mode
    that remembers the generators it reaches, which a replay of "no user
    mode" must leave in place."""
    cls = type(mode)
    module = cls.__module__ or ""
    if module == _OWN or module.startswith(_OWN + "."):
        return True
    if module != "torch" and not module.startswith("torch."):
        return False
    parts = module.split(".")
    return (any(p.startswith("_") for p in parts) or parts[1:2] in (["fx"], ["export"])
            or cls.__name__.startswith("_"))


def _type_name(mode: object) -> str:
    cls = type(mode)
    return f"{cls.__module__}.{cls.__qualname__}"


@attrs.frozen(cache_hash=True)
class ModeStackState:
    """Qualified type names of the user's modes, outermost first.  ``key``
    identifies the instances when the probe replays them (their identities),
    ``()`` otherwise; ``slot`` is where the probe holds them (``-1``: not held)."""

    function_modes: tuple[str, ...] = ()
    dispatch_modes: tuple[str, ...] = ()
    key: tuple[int, ...] = ()
    slot: int = attrs.field(default=-1, eq=False, repr=False)

    @property
    def empty(self) -> bool:
        return not self.function_modes and not self.dispatch_modes


EMPTY = ModeStackState()


def _user_modes() -> tuple[list[Any], list[Any]]:
    fn = [m for m in _get_current_function_mode_stack()  # type: ignore[no-untyped-call]
          if not _is_infrastructure(m)] if _fn_len() else []
    dispatch = [m for m in _get_current_dispatch_mode_stack()
                if not _is_infrastructure(m)] if _dispatch_len() else []
    return fn, dispatch


def _stack_identity() -> tuple[int, ...]:
    """Identities of every mode on both stacks (infrastructure included): a
    watched getter for a state with modes active, ~1 us."""
    out = [id(m) for m in _get_current_function_mode_stack()]  # type: ignore[no-untyped-call]
    out.append(-1)
    out.extend(id(m) for m in _get_current_dispatch_mode_stack())
    return tuple(out)


@register_probe
class ModeStackProbe(ContextProbe[ModeStackState]):
    name = "mode_stack"
    description = ("types of the user's torch-function and dispatch modes (replayed only "
                   "by ModeStackProbe(replay_instances=True))")
    default = True

    def __init__(self, *, replay_instances: bool = False, max_held: int = 64,
                 ignore: tuple[type, ...] = ()) -> None:
        self.replay_instances = replay_instances
        self.ignore = tuple(ignore)
        self._max_held = max_held
        self._lock = threading.Lock()
        self._held: dict[int, tuple[Any, ...]] = {}
        self._by_key: dict[ModeStackState, ModeStackState] = {}
        self._next = 0
        self.dropped = 0

    @property
    def traceable(self) -> bool:  # type: ignore[override]
        # a function mode entered inside the traced callable is traced through
        return self.replay_instances

    @property
    def portable(self) -> bool:  # type: ignore[override]
        # Types only: a document carries the type names.  With instances the
        # state is keyed by live objects that never leave the process: it is
        # marked not portable, like a forward context (describe() still
        # names the types).
        return not self.replay_instances

    def _read(self) -> tuple[list[Any], list[Any]]:
        fn, dispatch = _user_modes()
        if self.ignore:
            fn = [m for m in fn if not isinstance(m, self.ignore)]
            dispatch = [m for m in dispatch if not isinstance(m, self.ignore)]
        return fn, dispatch

    def _is_user(self, mode: object) -> bool:
        return not _is_infrastructure(mode) and not (self.ignore and
                                                     isinstance(mode, self.ignore))

    def observe(self) -> ModeStackState:
        if not _fn_len() and not _dispatch_len():
            return EMPTY
        fn, dispatch = self._read()
        if not fn and not dispatch:
            return EMPTY
        names = (tuple(map(_type_name, fn)), tuple(map(_type_name, dispatch)))
        if not self.replay_instances or dispatch:
            return ModeStackState(*names)
        probe_key = ModeStackState(*names, tuple(id(m) for m in fn))
        state = self._by_key.get(probe_key)
        if state is not None:
            return state
        with self._lock:
            state = self._by_key.get(probe_key)
            if state is None:
                if len(self._held) >= self._max_held:
                    self.dropped += 1
                    return ModeStackState(*names)  # not held: not replayable
                slot, self._next = self._next, self._next + 1
                self._held[slot] = tuple(fn)
                state = attrs.evolve(probe_key, slot=slot)
                self._by_key[probe_key] = state
            return state

    def watch(self, state: ModeStackState) -> tuple[tuple[Callable[[], object], object], ...]:
        # Thread-local and graph-affecting: checked on every call.  The common
        # case -- no mode at all -- costs two C calls.
        if _fn_len() == 0 and _dispatch_len() == 0:
            return ((_fn_len, 0), (_dispatch_len, 0))
        return ((_stack_identity, _stack_identity()),)

    def replay(self, state: ModeStackState) -> AbstractContextManager[None]:
        fn, dispatch = self._read()
        now = (tuple(map(_type_name, fn)), tuple(map(_type_name, dispatch)))
        if now == (state.function_modes, state.dispatch_modes) and (
                not state.key or state.key == tuple(id(m) for m in fn)):
            return nullcontext()  # already current
        if state.dispatch_modes:
            raise ModeNotReplayableError(
                f"probe 'mode_stack': dispatch mode(s) {', '.join(state.dispatch_modes)} are "
                "not replayable (torch.export does not trace through a TorchDispatchMode)")
        modes: tuple[Any, ...] = ()
        if state.function_modes:
            if state.slot < 0:
                # the hint first: a failure keeps 200 characters of this message
                why = ("replays a mode only when opted in: pass probes=[*default_probes(), "
                       "ModeStackProbe(replay_instances=True)]"
                       if not self.replay_instances else
                       f"kept no instances (max_held={self._max_held})")
                raise ModeNotReplayableError(
                    f"probe 'mode_stack' {why}; function mode(s) not replayable: "
                    f"{', '.join(state.function_modes)}")
            try:
                modes = self._held[state.slot]
            except KeyError:
                raise ModeNotReplayableError("probe 'mode_stack': the modes were cleared; "
                                             "replay must happen before clear()") from None
        return _establish(modes, fn, dispatch, self._is_user)

    def neutral_state(self) -> ModeStackState:
        return EMPTY

    def neutral(self, state: ModeStackState) -> bool:
        return state.empty

    def clear(self) -> None:
        with self._lock:
            self._held.clear()
            self._by_key.clear()

    def encode(self, state: ModeStackState) -> dict[str, Any]:
        if self.replay_instances:
            raise NotPortableError(f"probe {self.name!r} holds live mode instances")
        # type names only: a decoded state with modes is never replayable
        return {"function_modes": list(state.function_modes),
                "dispatch_modes": list(state.dispatch_modes)}

    def decode(self, data: Any, path: str) -> ModeStackState:
        doc = read_mapping(data, path, keys={"function_modes", "dispatch_modes"},
                           required={"function_modes", "dispatch_modes"})
        lists = []
        for field in ("function_modes", "dispatch_modes"):
            where = f"{path}.{field}"
            names = tuple(read_str(v, f"{where}[{i}]", max_len=200)
                          for i, v in enumerate(read_list(doc[field], where, max_len=64)))
            for i, n in enumerate(names):
                if not all(p.isidentifier() for p in n.split(".")) or "." not in n:
                    raise ValueError(f"{where}[{i}]: not a qualified type name")
            lists.append(names)
        return ModeStackState(lists[0], lists[1])

    def describe(self, state: ModeStackState) -> str:
        if state.empty:
            return "none"
        short = [n.rpartition(".")[2] for n in (*state.function_modes, *state.dispatch_modes)]
        tail = "" if state.slot >= 0 else " (not replayable)"
        return ", ".join(short) + tail


def _suffix_on_top(stack: list[Any], remove: list[Any]) -> bool:
    """Whether ``remove`` is exactly the top of ``stack`` (by identity): only
    then can it be set aside without touching a mode torch pushed above it."""
    if not remove:
        return True
    top = stack[len(stack) - len(remove):]
    return len(top) == len(remove) and all(a is b for a, b in zip(top, remove))


@contextmanager
def _establish(target: tuple[Any, ...], fn: list[Any], dispatch: list[Any],
               is_user: Callable[[object], bool]) -> Iterator[None]:
    """Make the user's function-mode stack ``target`` and its dispatch-mode
    stack empty; restore exactly on exit.  Modes the two share at the bottom
    stay; the rest of the current user modes are set aside the way torch's
    own ``_pop_mode_temporarily`` does (no ``__exit__``), the rest of the
    target entered with its own ``__enter__``."""
    common = 0
    while common < min(len(fn), len(target)) and fn[common] is target[common]:
        common += 1
    fn_stack = _get_current_function_mode_stack()  # type: ignore[no-untyped-call]
    dispatch_stack = _get_current_dispatch_mode_stack()
    if not _suffix_on_top(fn_stack, fn[common:]) or not _suffix_on_top(dispatch_stack,
                                                                        dispatch):
        raise ModeNotReplayableError(
            "probe 'mode_stack': the active user modes sit below modes torch pushed "
            "itself; they cannot be set aside to replay another stack")
    popped_fn = [_pop_function_mode() for _ in fn[common:]]  # type: ignore[no-untyped-call]
    popped_dispatch = [_pop_dispatch_mode() for _ in dispatch]
    try:
        with ExitStack() as stack:
            for mode in target[common:]:  # outermost first, as they were pushed
                stack.enter_context(mode)
            yield
    finally:
        for mode in reversed(popped_dispatch):
            _push_dispatch_mode(mode)
        for mode in reversed(popped_fn):
            _push_function_mode(mode)  # type: ignore[no-untyped-call]
