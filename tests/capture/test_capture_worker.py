"""The trace runs in a worker thread with a shallow stack (torch walks the
whole Python stack at every traced node), carrying what a new thread would
not inherit: the caller's contextvars, that the caller is inside
ctxreplay's own capture, and the graph's stack traces start at the
module's own ``forward`` (no ctxreplay frame), as a direct export's do.

Oracles: the test's own records made inside the forward while it is traced
(FakeTensor arguments), eager reruns of the model, and torch's own export of
the same module called directly."""

from __future__ import annotations

import contextvars
import queue
import subprocess
import sys
import textwrap
import threading
import traceback
from typing import Any

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

import ctxreplay
from ctxreplay.capture.isolating import isolating, isolating_as
from ctxreplay.capture.worker import run_in_worker

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

SCALE: contextvars.ContextVar[float] = contextvars.ContextVar("SCALE", default=1.0)
#: what each traced call saw: a queue, which finalize leaves alone (it puts
#: back the model's lists and the lists its forward reaches as globals, but
#: follows no object of the standard library's types)
TRACED: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()


def _traced() -> list[dict[str, Any]]:
    """What the traces recorded since the last call, in order."""
    out = []
    while not TRACED.empty():
        out.append(TRACED.get())
    return out


class _Scaled(nn.Module):
    """Reads a contextvar no probe knows; records where it was traced."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, FakeTensor):
            TRACED.put({"thread": threading.current_thread().name,
                        "isolating": isolating(), "scale": SCALE.get(),
                        "depth": len(traceback.extract_stack())})
        return self.lin(x) * SCALE.get()


def _finalize(model: _Scaled, x: torch.Tensor, **kw: Any) -> ctxreplay.CaptureReport:
    _traced()
    with ctxreplay.capture_with(model, backend="export", verify="execute", **kw) as s, \
            torch.no_grad():
        model(x)
    return s.finalize()


def _deep(n: int, fn: Any) -> Any:
    return fn() if n == 0 else _deep(n - 1, fn)


def test_the_trace_sees_the_callers_contextvars_and_isolation() -> None:
    model = _Scaled().eval()
    x = torch.rand(2, 4)
    token = SCALE.set(3.0)
    try:
        with torch.no_grad():
            truth = model(x)  # the eager oracle, with the caller's value
        report = _finalize(model, x)
    finally:
        SCALE.reset(token)
    (cap,) = report.captures
    (trace,) = _traced()
    assert trace["thread"] == "ctxreplay-capture"
    assert trace["scale"] == 3.0 and trace["isolating"]
    with torch.no_grad():
        torch.testing.assert_close(cap.artifact.module()(x), truth)
        # the control: the same model with the variable's default computes
        # another result, so a trace that lost the caller's context is seen
        assert not torch.allclose(model(x), truth)
    assert report.ok


def test_the_trace_stack_is_shallow_whatever_the_callers_depth() -> None:
    model = _Scaled().eval()
    x = torch.rand(2, 4)
    shallow = _finalize(model, x)
    depths = [t["depth"] for t in _traced()]
    deep = _deep(60, lambda: _finalize(model, x))
    depths += [t["depth"] for t in _traced()]
    assert shallow.ok and deep.ok
    here = len(traceback.extract_stack())
    # the caller's frames (60 more in the second) are not on the traced stack
    assert len(depths) == 2 and abs(depths[0] - depths[1]) < 5 and max(depths) < here + 60


def test_the_graph_stack_traces_start_at_the_modules_forward() -> None:
    model = _Scaled().eval()
    x = torch.rand(2, 4)
    (cap,) = _finalize(model, x).captures
    direct = torch.export.export(model, (x,), strict=False)  # (the default before 2.8: strict)
    firsts = []
    for ep in (cap.artifact, direct):
        traces = [n.meta.get("stack_trace") for n in ep.graph.nodes
                  if n.op == "call_function" and n.meta.get("stack_trace")]
        assert traces
        firsts.append(sorted({t.splitlines()[0] for t in traces}))
    # the same frames as torch's own export: the module's forward first
    assert firsts[0] == firsts[1] and all(__file__ in f and "in forward" in f
                                          for f in firsts[0])
    assert not any("ctxreplay" in (n.meta.get("stack_trace") or "")
                   for n in cap.artifact.graph.nodes)


def test_a_worker_raises_what_the_job_raised_and_carries_isolation() -> None:
    with pytest.raises(KeyboardInterrupt):
        run_in_worker(lambda: (_ for _ in ()).throw(KeyboardInterrupt()), None)
    assert run_in_worker(isolating, None) is False
    with isolating_as(1):
        assert run_in_worker(isolating, None) is True
    assert not isolating()


def test_an_interrupt_reaches_the_trace_which_unwinds_before_it_goes_on() -> None:
    """Ctrl-C while a trace runs: raised in the worker too (as it was raised
    inside a trace made in the caller's thread), and the caller goes on
    only once the job unwound (its replay put the state back)."""
    import signal
    import time

    started = threading.Event()
    log: list[str] = []

    def job() -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})  # the caller gets it
        started.set()
        try:
            for _ in range(1000):  # bounded: an interrupt never raised here ends it
                time.sleep(0.01)
            log.append("finished")
        except KeyboardInterrupt:
            log.append("interrupted")
            raise

    def interrupt(*_: Any) -> None:
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(KeyboardInterrupt):
            run_in_worker(job, None)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    # the job saw the interrupt, and had unwound before the caller raised it
    assert started.is_set() and log == ["interrupted"]


def _faults_while_oscillating() -> int:
    """Minor page faults of this thread while a call chain goes 150 frames
    deep and back 2,000 times: each time the chain crosses into a frame
    chunk CPython maps anew, the first write to it faults."""
    import resource

    def down(n: int) -> int:
        return 0 if n == 0 else down(n - 1) + 1

    down(150)
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    for _ in range(2000):
        down(150)
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before


@pytest.mark.skipif(sys.version_info < (3, 11) or sys.implementation.name != "cpython"
                    or not sys.platform.startswith("linux"),
                    reason="CPython's frame chunks (3.11+), per-thread rusage (Linux)")
def test_a_trace_deep_in_the_worker_maps_no_frame_chunk_per_call() -> None:
    # 150 frames of ``down`` are well over one 16 KiB chunk, so the chain
    # crosses a chunk boundary in any thread started the ordinary way
    box: list[int] = []
    plain = threading.Thread(target=lambda: box.append(_faults_while_oscillating()))
    plain.start()
    plain.join()
    # the control: a thread of its own maps and unmaps a chunk per descent
    assert box[0] >= 1000
    in_worker = run_in_worker(_faults_while_oscillating, None)
    # the worker's job starts on a roomy chunk: the descents fit in it
    assert in_worker < 100


def test_many_finalizes_and_a_later_export_in_a_new_thread_run_in_one_process() -> None:
    """Each capture runs in a new worker thread.  On torch 2.11.0 built for
    CUDA, on a machine without a GPU, the second export made in a new thread
    after the first one's thread exited ended the process (a segmentation
    fault in torch, reproduced without ctxreplay): a process that finalizes
    twice, then exports in yet another thread, must live.  (On a CPU build
    or with a GPU there is nothing to keep, and this runs as a control.)"""
    code = textwrap.dedent("""
        import threading, torch, ctxreplay
        from ctxreplay.capture import worker
        for _ in range(3):
            model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
            with ctxreplay.capture_with(model) as session, torch.no_grad():
                model(torch.rand(2, 4))
            assert session.finalize().ok
        def export():
            torch.export.export(torch.nn.Linear(4, 4), (torch.rand(2, 4),), strict=False)
        t = threading.Thread(target=export)
        t.start()
        t.join()
        export()
        kept = worker._guard_keeper is not None
        needed = (hasattr(torch._C, "_ensureCUDADeviceGuardSet")
                  and torch.version.cuda is not None and not torch.cuda.is_available())
        assert kept == needed, (kept, needed)
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", (done.returncode,
                                                                 done.stderr[-2000:])
