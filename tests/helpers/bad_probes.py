"""Probes that break the probe contract the way authors do by mistake.

Each keeps its state in ``SETTING`` (a framework's module-level switch): the
default is ``"a"``; a test observes ``"b"`` by setting it.  ``Good`` keeps
the contract; the others break one rule each:

* ``BareGenerator``: ``replay`` is a generator function without
  ``@contextlib.contextmanager``: it returns a generator;
* ``ReturnsNone``: ``replay`` sets the state and returns nothing;
* ``Unhashable``: ``observe`` returns a list;
* ``BadSplit``: ``split_replay`` returns a state, not a context.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

from ctxreplay.probes import ContextProbe

__all__ = ["SETTING", "BadSplit", "BareGenerator", "Good", "ReturnsNone", "Unhashable",
           "setting"]

SETTING = {"mode": "a"}


@contextmanager
def setting(mode: str) -> Iterator[None]:
    before = SETTING["mode"]
    SETTING["mode"] = mode
    try:
        yield
    finally:
        SETTING["mode"] = before


class Good(ContextProbe[str]):
    name = "good_setting"
    portable = False

    def observe(self) -> str:
        return SETTING["mode"]

    def replay(self, state: str) -> AbstractContextManager[None]:
        return setting(state)

    def describe(self, state: str) -> str:
        return f"mode={state}"


class BareGenerator(Good):
    name = "bare_generator"

    def replay(self, state: str) -> Any:  # the bug: no @contextmanager
        before = SETTING["mode"]
        SETTING["mode"] = state
        try:
            yield
        finally:
            SETTING["mode"] = before


class ReturnsNone(Good):
    name = "returns_none"

    def replay(self, state: str) -> Any:  # the bug: sets the state, returns nothing
        SETTING["mode"] = state


class Unhashable(Good):
    name = "unhashable"

    def observe(self) -> Any:  # the bug: a list
        return [SETTING["mode"]]

    def replay(self, state: Any) -> AbstractContextManager[None]:
        return setting(state[0])


class BadSplit(Good):
    name = "bad_split"

    def split_replay(self, state: str) -> Any:  # the bug: a state, not a context
        return state, None
