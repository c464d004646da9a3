"""One session's finalize as it goes: what it works on, what it captured so far.

Kept across an interrupted (Ctrl-C) finalize, so that calling it again
captures only the rest; released once the report is built.
"""

from __future__ import annotations

import logging

import attrs

from ..capture.options import CaptureOptions
from ..capture.results import Capture, CaptureFailure
from ..core.observer import Observer
from ..observation.attach import Observation

__all__ = ["Finalizing"]

_log = logging.getLogger("ctxreplay")


@attrs.define(eq=False)
class Finalizing:
    """One session's finalize: what it works on, and what it captured so
    far -- kept across an interrupted (Ctrl-C) finalize, so that calling it
    again captures only the rest."""

    observation: Observation
    observer: Observer
    options: CaptureOptions
    done: dict[tuple[str, int], list[Capture | CaptureFailure]] = attrs.Factory(dict)
    interrupted: bool = False
    released: bool = False

    def release(self) -> None:
        """Let go of every module and live state: each probe's ``clear()``
        (what one raises is an observation error of the report), the
        observation's references, the observer's cached snapshot.  A Ctrl-C
        inside a ``clear()`` lets the others run first, then goes on."""
        if self.released:
            return
        self.released = True
        interrupt: BaseException | None = None
        for p in self.options.probes:
            try:
                p.clear()
            except Exception as exc:  # a user's probe may raise anything: an observation error
                _log.debug("probe %s: clear() failed", p.name, exc_info=True)
                self.observation.shared.error("clear", exc)
            except BaseException as exc:  # a Ctrl-C: the other probes first, then re-raised
                interrupt = interrupt or exc
        self.observation.release()
        self.observer.invalidate()
        if interrupt is not None:
            raise interrupt
