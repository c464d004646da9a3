"""Progress of a long job over many items (``finalize()``'s variants,
``save_all``'s captures): a callback for tools, a tqdm bar on a terminal
when tqdm is installed, else one ``logging`` line per item -- for a job of
a few items, only once it has run a couple of seconds."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import Any

import attrs

__all__ = ["SHOW_AFTER", "Progress", "Steps", "counted"]

_log = logging.getLogger("ctxreplay")
_QUIET_BELOW = 4  # a job of a few items says nothing ...
#: ... unless it runs longer than this many seconds
SHOW_AFTER = 2.0


def counted(n: int, word: str) -> str:
    """``"1 capture"``, ``"2 captures"``."""
    return f"{n} {word}{'' if n == 1 else 's'}"


@attrs.frozen
class Steps:
    """The bar's own count, where it counts finer steps than the items:
    ``total`` in all, ``done`` already."""

    total: int
    done: int


class Progress:
    """``step(label)`` after each item; ``close()`` at the end.

    ``task`` names the job (``finalize``), ``verb`` what each step did
    (``captured``), ``unit`` what the bar counts (``variant``): a log line
    reads ``finalize: captured 3/8 (blocks.0#2)``, the bar ``ctxreplay
    finalize``.  The bar may count finer steps than the items (``steps``:
    its own count; ``advance`` moves it between items).
    A job of fewer than four items shows itself only once it has run
    ``show_after`` seconds (default ``SHOW_AFTER``)."""

    def __init__(self, total: int, done: int,
                 callback: Callable[[int, int, str], None] | None, *,
                 task: str, verb: str, unit: str, steps: Steps | None = None,
                 show_after: float | None = None) -> None:
        self.total, self.done, self.callback = total, done, callback
        self.task, self.verb = task, verb
        self.start = time.monotonic()
        self.show_after = SHOW_AFTER if show_after is None else show_after
        self.many = total - done >= _QUIET_BELOW
        self.bar: Any = None
        if sys.stderr is not None and sys.stderr.isatty():
            try:
                from tqdm import tqdm
            except ImportError:
                pass
            else:
                # ``delay``: tqdm draws nothing before that many seconds
                self.bar = tqdm(total=total if steps is None else steps.total,
                                initial=done if steps is None else steps.done,
                                desc=f"ctxreplay {task}", unit=unit, leave=False,
                                delay=0 if self.many else self.show_after)

    @property
    def logging(self) -> bool:
        """Whether steps are logged now: no bar, and many items or a long job."""
        return self.bar is None and (
            self.many or time.monotonic() - self.start >= self.show_after)

    def line(self, label: str) -> str:
        """The log line of the step just made."""
        return f"{self.task}: {self.verb} {self.done}/{self.total} ({label})"

    def advance(self, steps: int, label: str | None = None) -> None:
        """Move the bar ``steps`` finer steps within an item."""
        if self.bar is not None and steps > 0:
            if label is not None:
                self.bar.set_postfix_str(label, refresh=False)
            self.bar.update(steps)

    def step(self, label: str, steps: int = 1) -> None:
        """One item done (the bar moves ``steps``)."""
        self.done += 1
        if self.bar is not None:
            self.advance(steps, label)
        elif self.logging:
            _log.info("%s", self.line(label))
        if self.callback is not None:
            try:
                self.callback(self.done, self.total, label)
            except Exception:  # a tool's callback must not cost the job
                _log.debug("progress callback failed", exc_info=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
