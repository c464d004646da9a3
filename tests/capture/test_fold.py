"""Size folding: calls that differ in tensor sizes only, captured as one graph
with dynamic sizes and claimed for the observed range.

Truth comes from the test's own hooks (tests/helpers/trust_oracle.py records every
block call before the session opens and replays it through the capture
that claims it) and from eager reruns of the same model; which block calls
``install`` dispatched is counted by hooks on each block's ``lin``: a
dispatched call runs the captured graph instead of the forward, so its
``lin`` is never called.

Where torch's exported programs do not check their size guards (torch 2.7,
``FOLDS`` false) ctxreplay does not fold: each case asserts there what a user
meets instead -- no capture folded, each observed size its own capture that
install dispatches, every other size run eagerly, all outputs eager's.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import fold_cases as fc
import pytest
import torch
from capability import FOLDS
from forward_count import forwards_run
from torch import nn
from trust_oracle import differs, false_oks, members_of, record, replay_failure, unreproduced

import ctxreplay
from ctxreplay.capture.checker import Checker
from ctxreplay.fidelity.verify import Fidelity
from ctxreplay.specs.dims import SymbolRange


def _live(model: nn.Module, make: fc.Make, lengths: tuple[int, ...], **options: Any
          ) -> tuple[ctxreplay.CaptureReport, list[Any]]:
    """One session over a forward per length, every block call recorded."""
    options.setdefault("targets", "repeated")
    with record(model, members_of(model, "blocks")) as calls, \
            ctxreplay.capture_with(model, **options) as session, torch.no_grad():
        for n in lengths:
            args, kwargs = make(n)
            model(*args, **kwargs)
    return session.finalize(), calls


@attrs.define
class _Count:
    blocks: int = 0
    eager: int = 0

    @property
    def dispatched(self) -> int:
        return self.blocks - self.eager


@contextmanager
def _counting(model: nn.Module) -> Iterator[_Count]:
    """Block calls (a block's own hook: it runs around a dispatched call too),
    and those whose own forward ran (its ``lin`` was called; counted without
    a hook on ``lin``, which would make install run the block eagerly)."""
    count = _Count()

    def block(*_: Any) -> None:
        count.blocks += 1

    handles = [b.register_forward_pre_hook(block) for b in model.blocks]  # type: ignore[union-attr]
    try:
        with forwards_run(b.lin for b in model.blocks) as ran:  # type: ignore[union-attr]
            yield count
            count.eager = ran[0]
    finally:
        for h in handles:
            h.remove()


def _installed(model: nn.Module, report: Any, make: fc.Make, n: int) -> tuple[bool, int]:
    """``(installed output equals eager, block calls dispatched)`` at length ``n``."""
    args, kwargs = make(n)
    with torch.no_grad():
        want = model(*args, **kwargs)
    with _counting(model) as count, ctxreplay.install(model, report), torch.no_grad():
        got = model(*args, **kwargs)
    assert count.blocks == len(model.blocks)  # type: ignore[arg-type]
    return torch.equal(got, want), count.dispatched


def _ranges(report: ctxreplay.CaptureReport) -> list[list[tuple[int, int]]]:
    """Each folded capture's claimed ranges, sorted."""
    return sorted([(r.low, r.high) for r in c.folding.ranges]
                  for c in report.captures if c.folding is not None)


def _trustworthy(report: ctxreplay.CaptureReport, calls: list[Any]) -> None:
    assert false_oks(report, calls) == []
    if report.ok:
        assert unreproduced(report, calls) == []


def _unfolded(model: nn.Module, make: fc.Make, seen: tuple[int, ...],
              unseen: tuple[int, ...], **options: Any) -> ctxreplay.CaptureReport:
    """Where ctxreplay does not fold: the session over ``seen`` is ok with no
    capture folded, each observed size dispatched by its own capture and
    each ``unseen`` one run eagerly, every output eager's."""
    report, calls = _live(model, make, seen, **options)
    assert report.ok, report.problems
    _trustworthy(report, calls)
    assert report.captures and all(c.folding is None and c.folded == ()
                                   for c in report.captures)
    for n in seen:
        assert _installed(model, report, make, n) == (True, len(model.blocks)), n  # type: ignore[arg-type]
    for n in unseen:
        assert _installed(model, report, make, n) == (True, 0), n
    return report


# -- a branch on a size ------------------------------------------------------------

BRANCH = (4, 6, 10, 12)


def test_a_size_branch_folds_each_side_and_unseen_sizes_dispatch_by_side() -> None:
    model = fc.stack(fc.Branch)
    if not FOLDS:
        _unfolded(model, fc.sequence, BRANCH, (5, 11, 3, 8, 9, 13))
        return
    report, calls = _live(model, fc.sequence, BRANCH)
    assert report.ok, report.problems
    _trustworthy(report, calls)
    # one graph per side of the branch, each claimed for the sizes it ran at
    assert _ranges(report) == [[(4, 6)], [(10, 12)]]
    assert len(report.captures) == 2
    for n in (4, 5, 6, 10, 11, 12):  # 5 and 11 were never observed
        assert _installed(model, report, fc.sequence, n) == (True, 2), n
    for n in (3, 8, 9, 13):  # outside every claimed range: eager
        assert _installed(model, report, fc.sequence, n) == (True, 0), n


def test_the_small_sides_graph_past_its_guard_miscomputes_and_the_oracle_says_so() -> None:
    """The control: what a fold claiming its graph's whole range would get
    wrong.  The small side's graph, with torch's own size guards removed,
    returns another value at a size of the other side; a claim widened
    over both sides is refuted by the oracle."""
    model = fc.stack(fc.Branch)
    if not FOLDS:  # no fold to claim a range: only the observed sizes dispatch
        _unfolded(model, fc.sequence, BRANCH, (5, 11))
        return
    report, calls = _live(model, fc.sequence, BRANCH)
    small = next(c for c in report.captures if c.folding and c.folding.ranges[0].high < 8)
    member = model.get_submodule(small.weights_from)
    (x,), _ = fc.sequence(10)
    gm = small.artifact.module(check_guards=False)
    gm._forward_pre_hooks.clear()  # the input-range check torch adds
    with torch.no_grad():
        assert differs((member(x),), (gm(x),)) is not None
        with pytest.raises(AssertionError):  # as torch makes it, it refuses
            small.artifact.module()(x)
    widened = small.evolve(folding=attrs.evolve(
        small.folding, ranges=(SymbolRange(small.folding.ranges[0].name, 4, 12),)))
    at_ten = next(c for c in calls if c.args[0].shape[1] == 10)
    assert replay_failure(small, at_ten) is not None  # not claimed: shapes refused
    assert replay_failure(widened, at_ten) is not None
    assert replay_failure(widened, calls[0]) is None  # the oracle itself runs it


def _ok_run_steps(self: Checker, modules: Any, steps: tuple[str, ...]) -> Fidelity:
    return Fidelity(steps[-1], True, (), steps, len(self.request.members), None, 0)


@pytest.mark.parametrize("skip_checks", [False, True])
def test_a_size_branch_the_graph_does_not_guard_is_caught_by_the_per_size_checks(
        monkeypatch: pytest.MonkeyPatch, skip_checks: bool) -> None:
    """Eagerly the forward branches on the size, exported it does not (no
    guard): only running the graph at each observed size tells.  Skipping
    those runs (the control) gives an ok fold the oracle refutes.  (At
    ``verify="signature"`` a capture of one size is not run at all, so the
    size-10 capture's own check needs ``"execute"`` to see it.)"""
    if skip_checks:
        monkeypatch.setattr(Checker, "run_steps", _ok_run_steps)
    model = fc.stack(fc.EagerOnlyBranch)
    # the fold is traced at 7, on the small side
    report, calls = _live(model, fc.sequence, (4, 6, 7, 10), verify="execute")
    bad = false_oks(report, calls)
    if not FOLDS:  # no fold claims 10 from a trace at 7: nothing for a check to catch
        assert bad == [] and all(c.folding is None for c in report.captures)
        return
    if skip_checks:
        assert bad and "reproduces" in bad[0], bad
        return
    assert bad == []
    assert not report.ok  # the size-10 graph (exported: the small side) is wrong
    assert all(c.folding is None or c.folding.ranges[0].high <= 8 for c in report.captures)
    for n in (4, 6, 7, 10, 11):
        assert _installed(model, report, fc.sequence, n)[0], n


# -- the budget ------------------------------------------------------------------

@pytest.mark.parametrize("fold", [True, False])
def test_ten_layers_of_their_own_index_in_one_forward_stay_within_the_budget(
        fold: bool) -> None:
    torch.manual_seed(0)
    model = fc.Stack([fc.Indexed(i) for i in range(10)]).eval()
    report, calls = _live(model, fc.sequence, (5, 9), fold=fold)
    codes = [p.reason for p in report.problems]
    if not fold or not FOLDS:  # the control: each layer's graph spends the budget
        assert "variant_limit" in codes
        [limit] = [p for p in report.problems if p.reason == "variant_limit"]
        off = "fold=False" if not fold else "size_guards=False"
        [why] = [n for n in limit.names if n.startswith("fold:")]
        assert why.startswith(f"fold:off:{off}"), limit.names
        return
    assert report.ok and codes == [], report.problems
    _trustworthy(report, calls)
    assert sum(c.calls for c in report.captures) == 20
    for n in (5, 7, 9):
        assert _installed(model, report, fc.sequence, n) == (True, 10), n


def test_more_families_than_max_variants_still_hit_the_limit_and_say_so() -> None:
    """Nine Python constants: nine graphs, which no folding merges."""
    model = fc.stack(fc.Scaled)
    scales = [0.5 + i for i in range(9)]
    with ctxreplay.capture_with(model, targets="repeated") as session, torch.no_grad():
        for s in scales:
            model(fc.inputs(5, 2, 5, fc.DIM), s)
    report = session.finalize()
    assert not report.ok
    limit = [p for p in report.problems if p.reason == "variant_limit"]
    assert len(limit) == 1, report.problems
    text = limit[0].message
    assert "blocks.0" in text and "max_variants=8" in text and "raise max_variants" in text
    assert "1 variant (2 calls)" in text, text
    assert len(report.captures) == 8


# -- adversarial forwards -----------------------------------------------------------

def _mask(n: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (fc.inputs(n, 2, n, fc.DIM), fc.inputs(n + 50, 2, n)), {}


def _shifted(n: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (fc.inputs(n, 2, n, fc.DIM), fc.inputs(n + 50, 2, n - 1, fc.DIM)), {}


def _keywords(n: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (), {"x": fc.inputs(n, 2, n, fc.DIM), "bias": fc.inputs(n + 50, n, 1)}


def _transposed(n: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (fc.inputs(n, 2, n, fc.DIM).transpose(1, 2),), {}


#: name -> (block, inputs, observed lengths, unseen lengths in the claimed
#: range that must dispatch, folded ranges expected)
FOLDING = {
    "related dims, arange and view": (fc.Masked, _mask, (4, 6, 9), (5, 8), [[(4, 9)]]),
    # the symbol is the shorter input's length, the longer one's is it + 1
    "an input one shorter": (fc.Shifted, _shifted, (4, 6, 9), (5, 8), [[(3, 8)]]),
    "keyword-only": (fc.KeywordOnly, _keywords, (4, 6, 9), (5, 8), [[(4, 9)]]),
    "sizes of 1 (decode-like)": (fc.Softmax, fc.sequence, (1, 5, 1, 7, 2), (3, 6),
                                 [[(2, 7)]]),
}


@pytest.mark.parametrize("case", list(FOLDING))
def test_a_folded_forward_dispatches_unseen_sizes_in_range_with_eager_outputs(
        case: str) -> None:
    cls, make, seen, unseen, ranges = FOLDING[case]
    model = fc.stack(cls)
    if not FOLDS:
        _unfolded(model, make, seen, (*unseen, 12))
        return
    report, calls = _live(model, make, seen)
    assert report.ok, report.problems
    _trustworthy(report, calls)
    assert _ranges(report) == ranges
    for n in (*seen, *unseen):
        assert _installed(model, report, make, n) == (True, 2), n
    assert _installed(model, report, make, 12) == (True, 0)


def test_a_size_one_call_is_its_own_capture_not_the_folds() -> None:
    model = fc.stack(fc.Softmax)
    report, _ = _live(model, fc.sequence, (1, 5, 7))
    one = [c for c in report.captures if c.signature.args[0].shape[1] == 1]  # type: ignore
    assert len(one) == 1 and one[0].folding is None and one[0].folded == ()


def _pair(n: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
    a, b = {1: (4, 2), 2: (6, 3), 3: (10, 8), 4: (5, 7), 5: (8, 4), 6: (9, 9)}[n]
    return (fc.inputs(n, 2, a, fc.DIM), fc.inputs(n + 50, 2, b, fc.DIM)), {}


#: name -> (block, inputs, observed, in range but refused, dispatched)
GUARDED = {
    # 7 lies inside the range but its graph's own guard refuses it
    "a size never observed takes another path": (fc.Special, fc.sequence, (4, 6, 9), (7,),
                                                 (5, 8)),
    # (5, 7): each size in its range, but the other side of x > y
    "two sizes compared": (fc.Pair, _pair, (1, 2, 3), (4, 6), (5,)),
}


@pytest.mark.parametrize("case", list(GUARDED))
def test_a_size_inside_the_range_its_graph_refuses_runs_eagerly(case: str) -> None:
    cls, make, seen, refused, dispatched = GUARDED[case]
    model = fc.stack(cls)
    if not FOLDS:
        _unfolded(model, make, seen, (*refused, *dispatched))
        return
    report, calls = _live(model, make, seen)
    assert report.ok, report.problems
    _trustworthy(report, calls)
    assert len(report.captures) == 1 and report.captures[0].folding is not None
    for n in refused:
        assert _installed(model, report, make, n) == (True, 0), n
    for n in (*seen, *dispatched):
        assert _installed(model, report, make, n) == (True, 2), n


def test_a_parity_guard_folds_each_parity_and_install_finds_the_one_that_takes_it() -> None:
    """``if x.shape[1] % 2`` is a guard of the graph, not a range: the
    sizes the first graph refuses are folded again from the other parity,
    and install, refused by one graph, runs the other."""
    model = fc.stack(fc.Parity)
    if not FOLDS:
        _unfolded(model, fc.sequence, (4, 5, 8, 9, 12, 13), (6, 7, 10, 11, 3, 14))
        return
    report, calls = _live(model, fc.sequence, (4, 5, 8, 9, 12, 13))
    assert report.ok, report.problems
    # the ranges overlap (the graphs' own guards tell them apart): every call
    # is reproduced by an ok capture that claims it, and every capture
    # reproduces the calls it stands for
    assert false_oks(report, calls) == []
    assert sorted(tuple(sorted((c.variant, *c.folded))) for c in report.captures) == [
        (0, 2, 4), (1, 3, 5)]
    assert _ranges(report) == [[(4, 12)], [(5, 13)]]
    # 7 and 11: inside both ranges; the even graph refuses them, the odd one runs
    for n in (4, 6, 7, 10, 11, 13):
        assert _installed(model, report, fc.sequence, n) == (True, 2), n
    for n in (3, 14):
        assert _installed(model, report, fc.sequence, n) == (True, 0), n


#: name -> (block, inputs, observed lengths, other lengths to run installed)
UNFOLDED = {
    "a dict keyed by the size": (fc.SizeTable, fc.sequence, (4, 6, 9), (5, 12)),
    "a transposed input": (fc.Transposed, _transposed, (4, 6, 9), (5, 12)),
}


@pytest.mark.parametrize("case", list(UNFOLDED))
def test_a_forward_folding_cannot_take_makes_no_false_ok_and_installs_as_eager(
        case: str) -> None:
    cls, make, seen, others = UNFOLDED[case]
    model = fc.stack(cls)
    report, calls = _live(model, make, seen)
    _trustworthy(report, calls)
    for n in (*seen, *others):
        assert _installed(model, report, make, n)[0], n


def test_a_transposed_input_is_never_folded_with_other_layouts() -> None:
    """The first block's input is a transposed view (its strides follow no
    rule of the sizes): one capture per size; the second block's is
    contiguous and folds."""
    model = fc.stack(fc.Transposed)
    if not FOLDS:  # neither block folds: the second's calls too are one per size
        report = _unfolded(model, _transposed, (4, 6, 9), (5,))
        assert sorted(len(c.members) for c in report.captures) == [1] * 6
        return
    report, _ = _live(model, _transposed, (4, 6, 9))
    first = [c for c in report.captures if "blocks.0" in c.members]
    second = [c for c in report.captures if "blocks.1" in c.members]
    assert len(first) == 3 and all(c.folding is None for c in first)
    assert len(second) == 1 and second[0].folding is not None
    assert _installed(model, report, _transposed, 5) == (True, 1)


def test_a_dict_the_forward_fills_per_size_is_not_ok_and_finalize_leaves_it() -> None:
    model = fc.stack(fc.SizeMemo)
    report, calls = _live(model, fc.sequence, (4, 6, 9))
    assert not report.ok
    assert "member_changed" in [p.reason for p in report.problems]
    _trustworthy(report, calls)
    for b in model.blocks:  # what the live calls put there, no more (no trace's)
        assert sorted(b.memo) == [4, 6, 9]
        assert all(torch.equal(v, torch.full((n,), float(n))) for n, v in b.memo.items())
    for n in (4, 5, 9, 12):
        assert _installed(model, report, fc.sequence, n)[0], n


# -- verification levels and backends -------------------------------------------

def test_values_verification_checks_every_call_of_a_fold_by_value() -> None:
    model = fc.stack(fc.Branch)
    if not FOLDS:
        report = _unfolded(model, fc.sequence, BRANCH, (5, 11), verify="values")
        assert all("values" in c.fidelity.checked for c in report.captures)
        return
    report, calls = _live(model, fc.sequence, BRANCH, verify="values")
    assert report.ok, report.problems
    _trustworthy(report, calls)
    assert _ranges(report) == [[(4, 6)], [(10, 12)]]
    assert [c.fidelity.by_value for c in report.captures] == [4, 4]
    assert all("values" in c.fidelity.checked for c in report.captures)


def test_the_dynamo_backend_captures_each_size_on_its_own() -> None:
    model = fc.stack(fc.Branch)
    # (at signature: a Dynamo graph holds its weights, so no check that runs
    # it can take the second member's -- see the next test)
    report, _ = _live(model, fc.sequence, BRANCH, backend="dynamo", verify="signature")
    assert report.ok, report.problems
    assert len(report.captures) == 4
    assert all(c.folding is None and c.folded == () for c in report.captures)
    assert sorted(c.signature.args[0].shape[1] for c in report.captures) \
        == list(BRANCH)  # type: ignore[attr-defined]
    # the oracle replays torch.export programs only, and install does not
    # dispatch this backend's graphs: the truth here is eager
    for n in (*BRANCH, 5, 11):
        assert _installed(model, report, fc.sequence, n) == (True, 0), n


def test_the_default_verify_says_a_dynamo_graph_cannot_run_another_members_weights() -> None:
    # the default compares values: a member whose weights the graph cannot
    # take is not proven, and the report says so instead of ok
    model = fc.stack(fc.Branch)
    report, _ = _live(model, fc.sequence, BRANCH, backend="dynamo")
    assert not report.ok
    for c in report.captures:
        (m,) = c.fidelity.mismatches
        assert (m.live, m.captured, m.members) == (
            "member weights", "not possible: backend 'dynamo'", ("blocks.1",))


def test_fold_false_captures_each_size_on_its_own() -> None:
    model = fc.stack(fc.Branch)
    report, calls = _live(model, fc.sequence, BRANCH, fold=False)
    assert report.ok
    _trustworthy(report, calls)
    assert len(report.captures) == 4 and all(c.folding is None for c in report.captures)


# -- saved, loaded in a fresh process -------------------------------------------------

_FRESH = """
import json, sys
import torch
sys.path.insert(0, sys.argv[2])
import fold_cases as fc
from forward_count import forwards_run
import ctxreplay
from ctxreplay.loading.guard import GuardError

model = fc.stack(fc.Branch)
src = ctxreplay.load(sys.argv[1])
out = {"runs": {}, "folds": any(c.folding for c in src.captures)}
for n in (4, 5, 6, 10, 11, 12, 3, 8, 13):
    (x,), _ = fc.sequence(n)
    with torch.no_grad():
        want = model(x)
    with forwards_run(b.lin for b in model.blocks) as ran, ctxreplay.install(model, src), \
            torch.no_grad():
        got = model(x)
    out["runs"][n] = [torch.equal(got, want), len(model.blocks) - ran[0]]
if not out["folds"]:
    print(json.dumps(out))
    sys.exit(0)
small = next(c for c in src.captures if c.folding and c.folding.ranges[0].high < 8)
block = model.get_submodule(small.weights_from)
guarded = small.guarded(weights=block)
(x,), _ = fc.sequence(5)
with torch.no_grad():
    out["guarded_in_range"] = torch.equal(guarded(x), block(x))
    try:
        guarded(fc.sequence(10)[0][0])
        out["guarded_out_of_range"] = "ran"
    except GuardError as exc:
        out["guarded_out_of_range"] = [d.field for d in exc.differences]
out["ranges"] = sorted([[r.low, r.high] for r in c.folding.ranges]
                       for c in src.captures if c.folding)
print(json.dumps(out))
"""


def test_a_saved_fold_loaded_in_a_fresh_process_dispatches_its_range(tmp_path: Path) -> None:
    model = fc.stack(fc.Branch)
    if not FOLDS:  # saved and loaded, the captures serve the observed sizes only
        report = _unfolded(model, fc.sequence, BRANCH, ())
    else:
        report, _ = _live(model, fc.sequence, BRANCH)
    assert report.ok
    report.save_all(tmp_path / "caps")
    proc = subprocess.run([sys.executable, "-c", _FRESH, str(tmp_path / "caps"),
                           str(Path(__file__).resolve().parents[1] / "helpers")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    runs = {int(n): tuple(v) for n, v in out["runs"].items()}
    assert out["folds"] is FOLDS
    if not FOLDS:
        assert runs == {4: (True, 2), 5: (True, 0), 6: (True, 2), 10: (True, 2),
                        11: (True, 0), 12: (True, 2), 3: (True, 0), 8: (True, 0),
                        13: (True, 0)}
        return
    assert out["ranges"] == [[[4, 6]], [[10, 12]]]
    assert runs == {4: (True, 2), 5: (True, 2), 6: (True, 2), 10: (True, 2), 11: (True, 2),
                    12: (True, 2), 3: (True, 0), 8: (True, 0), 13: (True, 0)}
    assert out["guarded_in_range"] is True
    assert out["guarded_out_of_range"] == ["sizes"]
