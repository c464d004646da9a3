"""Progress of a long finalize: a callback for tools, a tqdm bar on a
terminal when tqdm is installed, else one ``logging`` line per variant."""

from __future__ import annotations

from collections.abc import Callable

from .._base import progress

__all__ = ["Progress"]


class Progress(progress.Progress):
    """``step(label)`` after each variant captured; ``close()`` at the end."""

    def __init__(self, total: int, done: int,
                 callback: Callable[[int, int, str], None] | None) -> None:
        super().__init__(total, done, callback, task="finalize", verb="captured",
                         unit="variant")
