"""Whether this thread is inside ctxreplay's own capture or check of a
module (a ``finalize()``): calls made there are not live calls, and an open
session must not count them.

``entered()`` marks the thread for as long as a capture or check runs
(nested: a depth), ``isolating_as`` carries that depth into a worker thread
that traces for it, and an open observation that keeps state counting calls
without asking (a member's memo of its last variant) registers with
``watch`` to be told (``quiet()``) when one starts.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["entered", "isolating", "isolating_as", "isolation_depth", "unwatch", "watch"]


class _Depth(threading.local):
    depth = 0


_local = _Depth()
#: open observations, told (``quiet()``) when a capture or check starts
_watchers: weakref.WeakSet[Any] = weakref.WeakSet()


def isolating() -> bool:
    """Whether this thread is inside ctxreplay's own capture or check of a
    module (a ``finalize()``): calls made there are not live calls, and an
    open session must not count them."""
    return _local.depth > 0


def watch(observation: Any) -> None:
    """Have ``observation.quiet()`` called whenever a capture or check
    starts: it drops whatever would count calls without asking
    ``isolating()`` (a member's memo of its last variant)."""
    _watchers.add(observation)


def unwatch(observation: Any) -> None:
    _watchers.discard(observation)


@contextmanager
def isolating_as(caller: int) -> Iterator[None]:
    """Inside, this thread is ``isolating()`` as deep as a thread whose
    ``isolation_depth()`` was ``caller``: a worker thread that traces for
    a capture entered there (calls it makes are not live calls either)."""
    before = _local.depth
    _local.depth = before + caller
    try:
        yield
    finally:
        _local.depth = before


def isolation_depth() -> int:
    """How many captures or checks this thread is inside (see
    ``isolating_as``)."""
    return int(_local.depth)


@contextmanager
def entered() -> Iterator[None]:
    """Inside, this thread is ``isolating()``; every watching observation is
    told first (``quiet()``)."""
    _local.depth += 1
    try:
        for w in list(_watchers):
            w.quiet()
        yield
    finally:
        _local.depth -= 1
