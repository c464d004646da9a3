"""Size folding: what finalize() pays to capture N size variants as one graph
with dynamic dims, and what a folded capture costs per call afterwards.

* finalize -- N = 6 sequence lengths of one module (a small transformer-ish
  ``DiTBlock`` and a plain stack of ``Linear`` layers), observed under
  inference mode and captured with ``fold=True`` (one graph), beside what a
  user would do by hand from the same caller: ONE ``torch.export.export`` of
  the same module at the middle length with ``Dim.AUTO`` on the length
  (the target, <= 1.5x), the same without dynamic dims, N separate exports,
  and ``finalize()`` with ``fold=False``.  Interleaved round by round.
* the guard -- a loaded folded capture's ``guarded()`` called at in-range
  sizes (observed and not), beside a bare call of the same program; its
  overhead is held to the observation overhead of an open session per
  block call (target <=), with a no-op forward hook pair as the unit.
* dispatch -- 16 ``Linear`` blocks under ``ctxreplay.install`` of a folded
  capture and of a fixed-size one, each beside the same blocks calling
  their bound program directly.

One thread.  Under ``--benchmark-disable`` only the folding itself runs and
is checked (one capture, the observed range, the graph against the
module's own eager outputs at every size); nothing is timed.

Where ctxreplay does not fold (torch 2.7: no size guards in its programs)
there is no fold to time: each benchmark asserts, once per process, the
outcome a user meets instead -- ``fold=True`` gives a capture per length,
each graph the module's eager outputs at its own length.
"""

from __future__ import annotations

import copy
import functools
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from benchutil import Stack, fast, interleaved_medians, one_thread, report
from capability import FOLDS
from torch import nn
from torch.export import Dim

import ctxreplay
from ctxreplay.demo import DiTBlock

#: the observed sequence lengths (sizes 0 and 1 would not fold)
LENGTHS = (8, 12, 16, 20, 24, 32)
DIM = 64
N_BLOCKS = 16


class _Workload:
    """One module, its inputs at a length, and the module captured by hand."""

    def __init__(self, name: str) -> None:
        torch.manual_seed(0)
        self.name = name
        self.module: nn.Module = (DiTBlock(DIM, 4) if name == "dit_block"
                                  else Stack(n=4, dim=DIM)).eval()

    def inputs(self, length: int) -> tuple[torch.Tensor, ...]:
        x = torch.rand(2, length, DIM)
        return (x, torch.rand(2, DIM)) if self.name == "dit_block" else (x,)

    def dynamic(self) -> tuple[Any, ...]:
        """``dynamic_shapes`` for one direct export: the length ``Dim.AUTO``."""
        return ({1: Dim.AUTO}, None) if self.name == "dit_block" else ({1: Dim.AUTO},)

    def live(self, fold: bool) -> ctxreplay.CaptureSession:
        session = ctxreplay.capture_with(self.module, backend="export", fold=fold)
        with session, torch.inference_mode():
            for n in LENGTHS:
                self.module(*self.inputs(n))
        return session

    def direct(self, lengths: tuple[int, ...], dynamic: bool) -> float:
        """Seconds for one ``torch.export.export`` per length, as a user would
        call it: the same module, inputs and ambient mode."""
        pairs = [self.inputs(n) for n in lengths]
        t0 = time.perf_counter()
        with torch.inference_mode():
            for args in pairs:
                torch.export.export(self.module, args,
                                    dynamic_shapes=self.dynamic() if dynamic else None)
        return time.perf_counter() - t0


def _check_folded(w: _Workload, rep: ctxreplay.CaptureReport) -> None:
    """One capture standing for every length, claiming exactly the observed
    range, whose graph gives the module's own eager outputs at each length."""
    assert rep.ok, rep.problems
    assert len(rep.captures) == 1
    cap = rep.captures[0]
    assert cap.folding is not None and cap.folding.sizes == len(LENGTHS)
    assert [(r.low, r.high) for r in cap.folding.ranges] == [(min(LENGTHS), max(LENGTHS))]
    graph = cap.artifact.module()
    with torch.inference_mode():
        for n in LENGTHS:
            args = w.inputs(n)
            torch.testing.assert_close(graph(*args), w.module(*args))


def _behaviour(w: _Workload) -> None:
    """Folded: one checked capture; not folded: one capture per length."""
    _check_folded(w, _finalize(w, True)[1])
    unfolded = _finalize(w, False)[1]
    assert unfolded.ok and len(unfolded.captures) == len(LENGTHS)
    assert all(c.folding is None for c in unfolded.captures)


@functools.cache
def _not_folded_here() -> bool:
    """Asserts (once) what ``fold=True`` gives where ctxreplay does not fold:
    one capture per length, none folded, each graph the module's own eager
    outputs at its length.  True when so (the caller has nothing to time)."""
    w = _Workload("linear_stack")
    rep = _finalize(w, True)[1]
    assert rep.ok, rep.problems
    assert [c.folding for c in rep.captures] == [None] * len(LENGTHS)
    with torch.inference_mode():
        for cap, n in zip(rep.captures, LENGTHS, strict=True):
            args = w.inputs(n)
            torch.testing.assert_close(cap.artifact.module()(*args), w.module(*args))
    return True


def _finalize(w: _Workload, fold: bool) -> tuple[float, ctxreplay.CaptureReport]:
    session = w.live(fold)
    t0 = time.perf_counter()
    rep = session.finalize()
    return time.perf_counter() - t0, rep


def _rounds(w: _Workload, rounds: int) -> dict[str, float]:
    """Median seconds of each side, interleaved round by round."""
    mid = (LENGTHS[len(LENGTHS) // 2],)
    sides: dict[str, Callable[[], float]] = {
        "fold": lambda: _finalize(w, True)[0],
        "auto": lambda: w.direct(mid, True),
        "static": lambda: w.direct(mid, False),
        "separate": lambda: w.direct(LENGTHS, False),
        "no_fold": lambda: _finalize(w, False)[0],
    }
    for side in sides.values():  # warm: torch's first export in a process is slow
        side()
    samples: dict[str, list[float]] = {k: [] for k in sides}
    for _ in range(rounds):
        for k, side in sides.items():
            samples[k].append(side())
    return {k: statistics.median(v) for k, v in samples.items()}


@pytest.mark.parametrize("workload", ["dit_block", "linear_stack"])
def test_finalize_folded_vs_direct_export(benchmark: Any, request: pytest.FixtureRequest,
                                          workload: str) -> None:
    warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
    if not FOLDS:
        assert _not_folded_here()
        return
    w = _Workload(workload)
    with one_thread():
        if fast(request.config):  # the behaviour only, untimed
            benchmark.pedantic(_behaviour, args=(w,), rounds=1, iterations=1)
            return
        _behaviour(w)
        # a Linear stack exports in tens of ms: more rounds for as stable a median
        rounds = 3 if workload == "dit_block" else 7
        med = benchmark.pedantic(_rounds, args=(w, rounds), rounds=1, iterations=1)
    n = len(LENGTHS)
    ratios = {k: med["fold"] / med[k] for k in ("auto", "static", "separate", "no_fold")}
    benchmark.extra_info.update({f"fold_to_{k}": v for k, v in ratios.items()})
    ms = {k: f"{v * 1e3:.0f} ms" for k, v in med.items()}
    report(f"finalize(fold=True) / one direct export with Dim.AUTO [{workload}, {n} lengths]",
           ratios["auto"], "<= 1.5", f"finalize {ms['fold']}, export {ms['auto']}")
    report(f"the same / one direct export of fixed sizes [{workload}]", ratios["static"],
           "none, a reference", f"export {ms['static']}")
    report(f"the same / {n} direct exports of fixed sizes [{workload}]", ratios["separate"],
           "none, a reference", f"exports {ms['separate']}")
    report(f"the same / finalize(fold=False) [{workload}]", ratios["no_fold"],
           "none, a reference", f"finalize(fold=False) {ms['no_fold']}, {n} captures")


# -- per call: the guard and dispatch of a folded capture -------------------------------

#: the batch sizes a per-call capture is folded over, and those it is called
#: at afterwards: in range, observed (4) and not (3, 7)
OBSERVED = (2, 4, 6, 8)
CALLED = (3, 4, 7)
WIDTH = 32


def _capture(model: nn.Module, sizes: tuple[int, ...], **kw: Any) -> ctxreplay.CaptureReport:
    with ctxreplay.capture_with(model, backend="export", **kw) as session, torch.no_grad():
        for n in sizes:
            model(torch.rand(n, WIDTH))
    result = session.finalize()
    assert result.ok and len(result.captures) == 1, result.problems
    assert (result.captures[0].folding is not None) == (len(sizes) > 1)
    return result


def _cycling(fn: Callable[[torch.Tensor], Any], xs: list[torch.Tensor]) -> Callable[[], Any]:
    """``fn`` on the next of ``xs`` each call, round and round."""
    box = [0]

    def call() -> Any:
        box[0] = (box[0] + 1) % len(xs)
        return fn(xs[box[0]])
    return call


def _observation(base: nn.Module) -> tuple[dict[str, Callable[[], Any]], Callable[[], None]]:
    """The observation unit of ``test_bench_overhead``: the same 16 blocks
    bare, with a no-op forward pre + post hook pair each, and observed by an
    open session; and the function that closes them."""
    models = {k: copy.deepcopy(base) for k in ("eager", "hooks", "observed")}
    handles = []
    for b in models["hooks"].blocks:
        handles.append(b.register_forward_pre_hook(lambda m, a, k: None, with_kwargs=True))
        handles.append(b.register_forward_hook(lambda m, a, k, o: None, with_kwargs=True))
    session = ctxreplay.capture_with(models["observed"], targets="repeated", backend="export")
    x = torch.rand(4, WIDTH)

    def close() -> None:
        for h in handles:
            h.remove()
        session.finalize()
    return {k: (lambda m=m: m(x)) for k, m in models.items()}, close


class _Noop(nn.Module):
    def forward(self, x: torch.Tensor) -> None:
        return None


def _alone(folded: Any, xs: list[torch.Tensor]
           ) -> tuple[dict[str, Callable[[], Any]], Callable[[], None]]:
    """The guard's own work and observation's, each around a call that does
    nothing: the folded guard with a no-op program, and one module observed
    as the whole model (its per-model-call checks included: a guard has no
    model call to spread the numerics-only flags over, so it reads them on
    every call, as observing a one-module model does)."""
    from ctxreplay.loading.guard import GuardedCapture

    alone = GuardedCapture(folded.needs, lambda *a, **k: None, folding=folded.folding)
    bare, observed = _Noop(), _Noop()
    session = ctxreplay.capture_with(observed, backend="export")
    x = xs[0]
    observed(x)
    return {"guard_alone": _cycling(alone, xs), "noop": lambda: bare(x),
            "noop_observed": lambda: observed(x)}, session.close


@pytest.fixture
def threads() -> Iterator[None]:
    warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
    with one_thread(), torch.no_grad():
        yield


def _loaded(model: nn.Module, sizes: tuple[int, ...], where: Path) -> Any:
    _capture(model, sizes).save_all(where)
    loaded = ctxreplay.load(where)
    assert isinstance(loaded, ctxreplay.LoadedManifest)
    return loaded.captures[0]


def test_guard_of_a_folded_capture(benchmark: Any, tmp_path: Path, threads: None,
                                   request: pytest.FixtureRequest) -> None:
    if not FOLDS:
        assert _not_folded_here()
        return
    torch.manual_seed(0)
    model = Stack(n=2, dim=WIDTH).eval()
    folded = _loaded(model, OBSERVED, tmp_path / "folded")
    fixed = _loaded(model, (4,), tmp_path / "fixed")
    xs = [torch.rand(n, WIDTH) for n in CALLED]
    guard, guard_fixed = folded.guarded(), fixed.guarded()
    for x in xs:  # in range: the program, never a mismatch; the eager model's outputs
        torch.testing.assert_close(guard(x), model(x))
    assert guard.mismatches == 0
    with pytest.raises(ctxreplay.GuardError, match="sizes"):
        guard(torch.rand(max(OBSERVED) + 1, WIDTH))  # out of the verified range
    guard.mismatches = 0
    bare_fixed = fixed.module()
    fns = {"bare": _cycling(folded.module(), xs), "guarded": _cycling(guard, xs),
           "bare_fixed": lambda: bare_fixed(xs[1]), "guarded_fixed": lambda: guard_fixed(xs[1])}
    observe, close = _observation(Stack(n=N_BLOCKS, dim=WIDTH).eval())
    alone, close_alone = _alone(folded, xs)
    try:
        number, rounds = (20, 3) if fast(request.config) else (100, 41)
        med = benchmark.pedantic(interleaved_medians, args=({**fns, **observe, **alone},),
                                 kwargs={"number": number, "rounds": rounds},
                                 rounds=1, iterations=1)
    finally:
        close()
        close_alone()
    assert guard.mismatches == 0 and guard_fixed.mismatches == 0  # the fast path throughout
    us = {k: v * 1e6 for k, v in med.items()}
    adds, adds_fixed = us["guarded"] - us["bare"], us["guarded_fixed"] - us["bare_fixed"]
    observes = (us["observed"] - us["eager"]) / N_BLOCKS
    hooks = (us["hooks"] - us["eager"]) / N_BLOCKS
    benchmark.extra_info.update(guard_us=adds, guard_fixed_us=adds_fixed, observe_us=observes,
                                hooks_us=hooks)
    guard_alone = us["guard_alone"] - us["noop"]
    observes_alone = us["noop_observed"] - us["noop"]
    benchmark.extra_info.update(guard_alone_us=guard_alone, observe_alone_us=observes_alone)
    report("folded guard / observation of a one-module call, each around a no-op",
           guard_alone / observes_alone if observes_alone > 0 else float("nan"), "<= 1.0",
           f"the guard {guard_alone:.2f} us (state, sizes, ranges), observation "
           f"{observes_alone:.2f} us (state, key, per-model-call flags)")
    report("folded guard's per-call overhead / observation's per block call",
           adds / observes if observes > 0 else float("nan"),
           "none: a block call in a stack reads the numerics-only flags once per model call",
           f"guard adds {adds:.2f} us to {us['bare']:.2f} us (sizes {CALLED}); observation "
           f"adds {observes:.2f} us, a hook pair {hooks:.2f} us")
    report("folded guard / fixed-size guard, per-call overhead",
           adds / adds_fixed if adds_fixed > 0 else float("nan"), "none, a reference",
           f"fixed-size guard adds {adds_fixed:.2f} us; folded guard / hook pair "
           f"{adds / hooks if hooks > 0 else float('nan'):.2f}")


def test_dispatch_of_a_folded_capture(benchmark: Any, threads: None,
                                      request: pytest.FixtureRequest) -> None:
    """A dispatched block call of a folded capture beside one of a fixed-size
    capture, each beside the bare eager model's block call."""
    if not FOLDS:
        assert _not_folded_here()
        return
    torch.manual_seed(0)
    base = Stack(n=N_BLOCKS, dim=WIDTH).eval()
    models = {k: copy.deepcopy(base) for k in ("bare", "installed", "installed_fixed")}
    folded = _capture(models["installed"], OBSERVED, targets="repeated")
    fixed = _capture(models["installed_fixed"], (4,), targets="repeated")
    handles = [ctxreplay.install(models["installed"], folded),
               ctxreplay.install(models["installed_fixed"], fixed)]
    xs = [torch.rand(n, WIDTH) for n in CALLED]
    try:
        for x in xs:
            torch.testing.assert_close(models["installed"](x), base(x))
        fns = {k: (lambda m=m: m(xs[1])) for k, m in models.items()}
        fns.update(cycling=_cycling(models["installed"], xs),
                   bare_cycling=_cycling(models["bare"], xs))
        number, rounds = (5, 3) if fast(request.config) else (10, 41)
        med = benchmark.pedantic(interleaved_medians, args=(fns,),
                                 kwargs={"number": number, "rounds": rounds},
                                 rounds=1, iterations=1)
        for h in handles:  # every block call ran a program
            assert h.stats().total_misses == 0 and h.stats().total_hits >= N_BLOCKS
            assert h.stats().unflattened == {}
    finally:
        for h in handles:
            h.remove()
    us = {k: v / N_BLOCKS * 1e6 for k, v in med.items()}
    benchmark.extra_info.update({f"{k}_us": v for k, v in us.items()})
    report("dispatched call of a folded capture / of a fixed-size one, per block call",
           us["installed"] / us["installed_fixed"], "none, a reference",
           f"folded {us['installed']:.2f} us, fixed-size {us['installed_fixed']:.2f} us, "
           f"the bare eager block {us['bare']:.2f} us; sizes changing every call {CALLED}: "
           f"folded {us['cycling']:.2f} us, eager {us['bare_cycling']:.2f} us")
