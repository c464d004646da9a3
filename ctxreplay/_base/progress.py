"""Progress of a long job over many items (``finalize()``'s variants,
``save_all``'s captures): a callback for tools, a tqdm bar on a terminal
when tqdm is installed, else one ``logging`` line per item."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["Progress"]

_log = logging.getLogger("ctxreplay")
_QUIET_BELOW = 4  # a job of a few items says nothing


class Progress:
    """``step(label)`` after each item; ``close()`` at the end.

    ``task`` names the job (``finalize``), ``verb`` what each step did
    (``captured``), ``unit`` an item (``variant``): a log line reads
    ``finalize: captured 3/8 (blocks.0#2)``, the bar ``ctxreplay finalize``."""

    def __init__(self, total: int, done: int,
                 callback: Callable[[int, int, str], None] | None, *,
                 task: str, verb: str, unit: str) -> None:
        self.total, self.done, self.callback = total, done, callback
        self.task, self.verb = task, verb
        self.bar: Any = None
        self.log = total - done >= _QUIET_BELOW
        if self.log and sys.stderr is not None and sys.stderr.isatty():
            try:
                from tqdm import tqdm
            except ImportError:
                pass
            else:
                self.bar = tqdm(total=total, initial=done, desc=f"ctxreplay {task}",
                                unit=unit, leave=False)
                self.log = False

    def step(self, label: str) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.set_postfix_str(label, refresh=False)
            self.bar.update(1)
        elif self.log:
            _log.info("%s: %s %d/%d (%s)", self.task, self.verb, self.done, self.total, label)
        if self.callback is not None:
            try:
                self.callback(self.done, self.total, label)
            except Exception:  # a tool's callback must not cost the job
                _log.debug("progress callback failed", exc_info=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
