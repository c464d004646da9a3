"""Where a trace runs: a worker thread with a shallow Python stack.

While ``torch.export`` traces, torch records each graph node's Python stack
(``node.stack_trace``): it walks the whole stack of the tracing thread and
reads every frame's source line, then keeps the frames from the first
``forward`` on.  Its cost grows with the depth of the stack at every node, so
a trace started from deep inside ``finalize()`` -- and from deep inside the
caller's own code (a test runner, a training framework's callback) -- paid
for each of those frames at every node, though none of them ends up in the
graph.  A thread started for the trace has a stack of a few frames; what the
graph records is the same (it starts at the first ``forward``).

The worker carries over what a thread does not inherit and a trace can
read: the caller's ``contextvars`` (run in a copy of its context), that the
caller is inside ctxreplay's own capture (``isolate.isolating()``: an open
session must not count the calls the trace makes), and, where CUDA is
initialised, the caller's current CUDA device (per thread in CUDA), and
the intra-op thread count (OpenMP's is per thread) a backend that runs the
module while it captures computes with.  torch's
other thread-local state (grad mode, autocast, inference mode, the mode
stacks) is what the capture's replay establishes inside the job, in the
worker, from the neutral state a fresh thread has.
"""

from __future__ import annotations

import contextvars
import ctypes
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from ..errors import Error
from .isolate import isolating_as, isolation_depth

__all__ = ["WorkerTimeout", "run_in_worker"]

T = TypeVar("T")

#: the worker thread's name (a timed-out one is abandoned as a daemon)
THREAD_NAME = "ctxreplay-capture"


class WorkerTimeout(Error):
    """The job did not finish within the timeout; its thread is abandoned."""


def run_in_worker(job: Callable[[], T], timeout: float | None) -> T:
    """``job()`` in a worker thread carrying the caller's thread state; what
    it raises (``KeyboardInterrupt`` included) is raised here.

    With ``timeout``, a job still running after that many seconds raises
    ``WorkerTimeout`` here; it cannot be killed and runs on as a daemon.
    Without one, an interrupt (Ctrl-C) that reaches this thread while the
    job runs is raised in the worker too, as it was raised inside a trace
    made in this thread, and waits for the job to unwind -- its replay puts
    the ambient state back on the way out, so nothing of it stays in force
    after ``finalize()`` returns -- then goes on; a second interrupt
    abandons it."""
    box: dict[str, Any] = {}
    run = _carried(job)
    # waited on, not ``Thread.join``: a join that an interrupt breaks marks
    # the thread stopped while it still runs (CPython 3.11's
    # ``_wait_for_tstate_lock``), so a second join would not wait
    done = threading.Event()

    def target() -> None:
        try:
            box["value"] = run()
        except BaseException as exc:
            box["error"] = exc
        finally:
            done.set()

    worker = threading.Thread(target=target, name=THREAD_NAME, daemon=True)
    worker.start()
    if timeout is None:
        try:
            done.wait()
        except BaseException as exc:
            if not done.is_set():
                _raise_in(worker, type(exc))
                done.wait()
            raise
    elif not done.wait(timeout):
        raise WorkerTimeout()
    if "error" in box:
        raise box["error"]
    value: T = box["value"]
    return value


def _carried(job: Callable[[], T]) -> Callable[[], T]:
    """``job`` wrapped to run with this thread's state, read now."""
    context = contextvars.copy_context()
    depth = isolation_depth()
    cuda = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    device = torch.cuda.current_device() if cuda else None
    threads = torch.get_num_threads()

    def run() -> T:
        if device is not None:
            torch.cuda.set_device(device)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        with isolating_as(depth):
            return context.run(job)

    return run


def _raise_in(worker: threading.Thread, kind: type[BaseException]) -> None:
    """Have ``worker`` raise ``kind`` at its next bytecode (CPython's
    ``PyThreadState_SetAsyncExc``); nothing where that API is missing."""
    ident = worker.ident
    api = getattr(ctypes, "pythonapi", None)
    if ident is None or api is None:
        return
    api.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(kind))
