"""Progress of a long finalize: a callback for tools per variant, a tqdm bar
on a terminal when tqdm is installed that moves with every trace and every
member's check, else one ``logging`` line per variant counting the graphs
made -- for a finalize of a few variants, once it has run a couple of
seconds -- and a closing line saying how many captures the variants made."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping

from .._base import progress

__all__ = ["FinalizeProgress"]

_log = logging.getLogger("ctxreplay")

Where = tuple[str, int]


class FinalizeProgress(progress.Progress):
    """``checked(where)`` after each member's check of a variant,
    ``finished(where, label, graph=...)`` once the variant is captured
    (``graph``: a graph of its own, traced or from the cache; else served
    by another variant's graph, or failed), ``close()`` at the end.

    ``steps``: each variant's share of the bar -- its trace or record and
    one step per member check -- by ``(scope, variant)``; ``done`` those a
    finalize interrupted before already captured."""

    def __init__(self, steps: Mapping[Where, int], done: set[Where],
                 callback: Callable[[int, int, str], None] | None) -> None:
        self.steps = dict(steps)
        super().__init__(len(steps), len(done & steps.keys()), callback, task="finalize",
                         verb="captured", unit="step",
                         steps=progress.Steps(sum(self.steps.values()),
                                              sum(self.steps[w] for w in done if w in self.steps)))
        self.ticks: dict[Where, int] = {}
        self.graphs = self.served = 0
        self.drawn = self.bar is not None
        self.last_line = time.monotonic()

    def line(self, label: str) -> str:
        return (f"finalize: {self.done}/{self.total} variants, "
                f"{progress.counted(self.graphs, 'graph')} made ({label})")

    def checked(self, where: Where, label: str) -> None:
        """One member's check of the variant ``where`` ran (its last step
        stays for ``finished``)."""
        n = self.ticks.get(where, 0)
        if n + 1 >= self.steps.get(where, 1):
            return
        self.ticks[where] = n + 1
        self.advance(1, label)
        now = time.monotonic()
        if self.logging and now - self.last_line >= self.show_after:
            # a long check between two variants' lines says where it is
            self.last_line = now
            _log.info("finalize: %d/%d variants, checking %s (%d of %d members)",
                      self.done, self.total, label, n + 1, self.steps.get(where, 1) - 1)

    def finished(self, where: Where, label: str, *, graph: bool, served: bool) -> None:
        """The variant ``where`` is done: what is left of its share of the
        bar, its log line and the callback."""
        self.graphs += graph
        self.served += served
        rest = self.steps.get(where, 1) - self.ticks.pop(where, 0)
        self.last_line = time.monotonic()
        self.step(label, steps=max(rest, 0))

    def summary(self, captures: int, failures: int, seconds: float) -> None:
        """The closing line, where steps were shown: what the variants made."""
        if not self.drawn and self.total and (self.many or seconds >= self.show_after):
            _log.info("finalize: %s -> %s (%s made, %d served by another variant's graph, "
                      "%d failed) in %.1f s", progress.counted(self.total, "variant"),
                      progress.counted(captures, "capture"),
                      progress.counted(self.graphs, "graph"), self.served, failures, seconds)
