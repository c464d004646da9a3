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
caller is inside ctxreplay's own capture (``isolating.isolating()``: an open
session must not count the calls the trace makes), and, where CUDA is
initialised, the caller's current CUDA device (per thread in CUDA), and
the intra-op thread count (OpenMP's is per thread) a backend that runs the
module while it captures computes with.  torch's
other thread-local state (grad mode, autocast, inference mode, the mode
stacks) is what the capture's replay establishes inside the job, in the
worker, from the neutral state a fresh thread has.

The job starts on a fresh, roomy piece of the interpreter's frame stack
(``_roomy``).  CPython (3.11 and later) keeps each thread's Python frames in
chunks of 16 KiB, mapped with ``mmap`` when a call does not fit in the
current one and unmapped again as soon as that call returns.  A trace
oscillates between frame depths thousands of times (one ``__torch_function__``
/ ``__torch_dispatch__`` descent per op); where a chunk boundary falls
inside that range, each crossing is an ``mmap`` + ``munmap`` pair and the
page faults of fresh memory.  Where the boundary falls depends on the byte
size of every frame below the trace, so it moved with a frame more or less
in the worker: measured here (a TinyDiT block, torch 2.13, Python 3.11),
one export from a fresh thread made ~200 such pairs, the same export two to
twenty frames deeper 500 to 1,500, and cost 4-19% more.  Starting the job
inside a frame a little over half a chunk of 1 MiB makes the interpreter
map that chunk once, with ~512 KiB left after the frame for the trace: no
pairs at all for any trace under ~1,500 frames, whatever the caller's or
the worker's depth.  The chunk's pages are touched only where frames are
written (anonymous memory is committed on first write), and it is
unmapped when the job returns.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from ..errors import Error
from .isolating import isolating_as, isolation_depth

__all__ = ["WorkerTimeout", "run_in_worker"]

T = TypeVar("T")

#: the worker thread's name (a timed-out one is abandoned as a daemon)
THREAD_NAME = "ctxreplay-capture"

#: value-stack slots of ``_roomy``'s frame: 8 bytes each, a little over
#: 512 KiB, so CPython maps a chunk of 1 MiB for it (chunk sizes are 16 KiB
#: doubled until the frame fits) and leaves the rest to the job
_ROOMY_SLOTS = 64 * 1024 + 64


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
    _keep_device_guard()
    box: dict[str, Any] = {}
    run = _carried(job)
    # waited on, not ``Thread.join``: a join that an interrupt breaks marks
    # the thread stopped while it still runs (CPython 3.11's
    # ``_wait_for_tstate_lock``), so a second join would not wait
    done = threading.Event()

    def target() -> None:
        try:
            box["value"] = run()
        except BaseException as exc:  # handed to the waiting thread, which re-raises it
            box["error"] = exc
        finally:
            done.set()

    worker = threading.Thread(target=target, name=THREAD_NAME, daemon=True)
    worker.start()
    if timeout is None:
        try:
            done.wait()
        except BaseException as exc:  # a Ctrl-C: passed to the worker, then re-raised
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


_guard_keeper: threading.Thread | None = None
_guard_lock = threading.Lock()


def _keep_device_guard() -> None:
    """Have a thread that never exits make the process's first call of
    ``torch._C._ensureCUDADeviceGuardSet()``.

    Fake tensors (every export) call it where CUDA is not available, and on
    torch 2.11.0 (a CUDA build on a machine without a GPU) what the first
    call sets up is owned by the thread that made it: once that thread has
    exited, the next call, in any thread, ends the process with a
    segmentation fault (measured: plain ``torch.export.export`` calls, each
    in a new thread; 2.7.0, 2.9.1 and 2.14.1 are unaffected).  Each capture
    runs in a new worker thread, so a second ``finalize()`` would crash.  A
    call made first from a thread that lives as long as the process keeps
    it valid; a later call anywhere is harmless."""
    global _guard_keeper
    ensure = getattr(torch._C, "_ensureCUDADeviceGuardSet", None)
    if ensure is None or _guard_keeper is not None or torch.version.cuda is None \
            or torch.cuda.is_available():
        return
    with _guard_lock:
        if _guard_keeper is not None:
            return
        ready = threading.Event()

        def keep() -> None:
            with contextlib.suppress(Exception):  # a build without the CUDA hooks
                ensure()
            ready.set()
            threading.Event().wait()  # for as long as the process runs

        keeper = threading.Thread(target=keep, name="ctxreplay-device-guard", daemon=True)
        keeper.start()
        ready.wait()
        _guard_keeper = keeper


def _roomy(fn: Callable[[], T]) -> T:
    """``fn()``, called from a frame of ~512 KiB (see the module's
    docstring): its code object's ``co_stacksize`` is raised below."""
    return fn()


if sys.version_info >= (3, 11) and sys.implementation.name == "cpython":
    # Frame size is fixed by the code object (locals + co_stacksize slots of
    # 8 bytes); the value stack is never initialised, only reserved, so the
    # unused slots cost address space, not memory.  3.10 and earlier give
    # every frame its own heap object and have no chunks.  A speed-up only:
    # an interpreter that refuses the code object keeps the plain one.
    with contextlib.suppress(TypeError, ValueError):
        _roomy.__code__ = _roomy.__code__.replace(co_stacksize=_ROOMY_SLOTS)


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
            return _roomy(functools.partial(context.run, job))

    return run


def _raise_in(worker: threading.Thread, kind: type[BaseException]) -> None:
    """Have ``worker`` raise ``kind`` at its next bytecode (CPython's
    ``PyThreadState_SetAsyncExc``); nothing where that API is missing."""
    ident = worker.ident
    api = getattr(ctypes, "pythonapi", None)
    if ident is None or api is None:
        return
    api.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(kind))
