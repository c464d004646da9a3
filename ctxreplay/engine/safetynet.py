"""The engine's safety net: after each capture, the ambient state is what it
was when ``finalize()`` began.

Every replay restores what it found -- when the probe is right.  A probe
whose replay forgets to restore, a backend that flips a global flag, or a
capture thread abandoned after ``capture_timeout`` (still inside its replay)
would otherwise leave the caller's process changed.  ``SafetyNet`` observes
the default probes before the captures and, after each one, puts back any
state that differs, through the probe's own ``replay``.
"""

from __future__ import annotations

import atexit
import threading
from contextlib import AbstractContextManager, suppress
from typing import Any

from .._base.torchcaps import GlobalStateGuard as _GlobalStateGuard
from ..core.probe import ContextProbe
from ..core.registry import resolve_probes
from ..core.snapshots import describe_state

__all__ = ["SafetyNet"]


# Replays entered to put a leaked state back.  They are not exited while the
# process runs: exiting one would restore the leaked state, and so would
# dropping it (a generator-based context runs its ``finally`` when
# garbage-collected).  One small object per leak -- and a leak is a bug.
_held: list[AbstractContextManager[Any]] = []
_held_lock = threading.Lock()


@atexit.register
def _release_held() -> None:
    # At exit, while torch can still run: otherwise the interpreter's final
    # collection would run these restores half torn down, and print errors.
    with _held_lock:
        held = _held[::-1]
        _held.clear()
    for cm in held:
        with suppress(Exception):
            cm.__exit__(None, None, None)


class SafetyNet:
    """The states of the default probes now; ``restore()`` re-establishes them.

    Only the default probes: they are cheap to observe, have no side effects
    and cover every global the engine's own replays touch.  A probe that
    cannot observe (it raises) is left out.  Thread-local parts (grad mode,
    autocast, the default device) are those of the calling thread.
    """

    __slots__ = ("_guard", "_items")

    def __init__(self) -> None:
        self._items: list[tuple[ContextProbe[Any], Any]] = []
        self._guard = _GlobalStateGuard() if _GlobalStateGuard is not None else None
        try:
            probes = resolve_probes(None)
        except Exception:  # a broken registry must not break finalize
            probes = ()
        for p in probes:
            try:
                self._items.append((p, p.observe()))
            except Exception:  # a user's probe may raise anything: not watched
                continue

    def restore(self) -> dict[str, str]:
        """Re-establish every state that changed; return ``{probe: "was -> left"}``
        (short descriptions, metadata only) for those that had, plus
        ``"torch_global_state"`` naming what else torch's guard saw change."""
        changed: dict[str, str] = {}
        for p, state in self._items:
            try:
                now = p.observe()
                if now == state:
                    continue
            except Exception:  # a user's probe may raise anything: not compared
                continue
            changed[p.name] = f"{describe_state(p, state)} -> {describe_state(p, now)}"
            try:
                cm = p.replay(state)
                cm.__enter__()
            except Exception:  # a user's probe may raise anything: left as it is
                continue
            with _held_lock:
                _held.append(cm)
        guard = self._guard
        if guard is not None and not guard.check():
            # Global state no default probe covers (the thread count, say):
            # named by torch's guard, reported once, not put back.
            changed["torch_global_state"] = str(guard.reason()).strip()[:120] or "changed"
            self._guard = _GlobalStateGuard()
        return changed
