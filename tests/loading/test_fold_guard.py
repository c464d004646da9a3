"""A loaded folded capture's guard (``LoadedCapture.guarded()``): a size in
the claimed range that the graph's own guard refuses is a ``sizes``
difference handled as ``on_mismatch`` says (not torch's ``AssertionError``
escaping), and keyword arguments passed in another order than the captured
call's are read by name.  Each test failed before ``GuardedCapture`` did
both.

Where ctxreplay does not fold (torch 2.7: no size guards in its programs),
the captures are one per size and each test asserts its subject on those:
7 is no capture's size and falls back, and keywords in another order are
read by name at a captured size.
"""

from __future__ import annotations

from pathlib import Path

import fold_cases as fc
import pytest
import torch
from capability import FOLDS

import ctxreplay
from ctxreplay.loading.guard import GuardError


def _loaded(tmp_path: Path, cls: type, make: fc.Make, lengths: tuple[int, ...]) -> tuple[
        fc.Stack, list[ctxreplay.LoadedCapture]]:
    """The model and its saved captures, loaded: one fold, or where ctxreplay
    does not fold one fixed-size capture per length."""
    model = fc.stack(cls)
    with ctxreplay.capture_with(model, targets="repeated") as session, torch.no_grad():
        for n in lengths:
            args, kwargs = make(n)
            model(*args, **kwargs)
    report = session.finalize()
    assert report.ok and len(report.captures) == (1 if FOLDS else len(lengths))
    report.save_all(tmp_path / "caps")
    captures = list(ctxreplay.load(tmp_path / "caps").captures)  # type: ignore[union-attr]
    assert [c.folding is not None for c in captures] == [FOLDS] * len(report.captures)
    return model, captures


def test_a_size_in_range_its_graph_refuses_falls_back_through_the_guard(
        tmp_path: Path) -> None:
    """Observed 4, 6, 9; 7 lies inside the folded range [4, 9] but takes
    another path, so torch's own guard in the graph refuses it (where torch
    folds), or no capture holds that size at all (where each size is its
    own capture).  Either way ``guarded()`` runs the fallback in
    ``"fallback"`` mode and raises a ``GuardError`` naming the sizes in
    ``"raise"`` mode, where the bare program raises torch's own error."""
    model, captures = _loaded(tmp_path, fc.Special, fc.sequence, (4, 6, 9))
    block = model.blocks[0]
    (x,), _ = fc.sequence(7)
    for capture in captures:
        with torch.no_grad(), pytest.raises(Exception) as bare:
            capture.module(block)(x)  # the control: torch refuses size 7
        assert not isinstance(bare.value, GuardError)
        calls: list[int] = []

        def fallback(t: torch.Tensor, calls: list[int] = calls) -> torch.Tensor:
            calls.append(t.shape[1])
            return block(t)

        guarded = capture.guarded(weights=block, on_mismatch="fallback", fallback=fallback)
        with torch.no_grad():
            assert torch.equal(guarded(x), block(x))
        assert calls == [7] and guarded.mismatches == 1
        with torch.no_grad(), pytest.raises(GuardError) as refused:
            capture.guarded(weights=block)(x)
        assert [d.kind for d in refused.value.differences] == ["sizes"]
        assert "7" in refused.value.differences[0].found


def test_a_fixed_size_capture_serves_its_own_shape_through_the_guard(tmp_path: Path) -> None:
    """The size check does not refuse the calls the capture was made of:
    each capture, guarded, reproduces the block at the size it was captured
    at (every observed size, for a folded one), with no mismatch."""
    model, captures = _loaded(tmp_path, fc.Special, fc.sequence, (4, 6, 9))
    block = model.blocks[0]
    served = []
    for capture in captures:
        guarded = capture.guarded(weights=block)
        own = capture.sidecar.inputs[0][1].shape[1]
        for n in (4, 6, 9) if capture.folding is not None else (own,):
            (x,), _ = fc.sequence(n)
            with torch.no_grad():
                assert torch.equal(guarded(x), block(x))
            served.append(n)
        assert guarded.mismatches == 0
    assert sorted(served) == [4, 6, 9]


def test_keyword_arguments_in_another_order_are_read_by_name(tmp_path: Path) -> None:
    """Captured as ``block(x=..., bias=...)``; the same call written
    ``block(bias=..., x=...)`` is refused with a false reading: the guard
    takes the live call's tensors in the live keyword order and checks them
    against the captured order's dimensions ("now kwargs['x'][1] = 1,
    kwargs['bias'][0] = 2" for an x of length 5).  Reading by path would
    run it; the same mistake can also accept a call whose real sizes lie
    outside the verified range when the swapped readings fall inside."""

    def make(n: int) -> tuple[tuple[object, ...], dict[str, torch.Tensor]]:
        return (), {"x": fc.inputs(n, 2, n, fc.DIM), "bias": fc.inputs(n + 50, n, 1)}

    model, captures = _loaded(tmp_path, fc.KeywordOnly, make, (4, 6, 9))
    block = model.blocks[0]
    # a size in the fold's range it never saw, or the first capture's own (4)
    _, kw = make(5 if FOLDS else 4)
    guarded = captures[0].guarded(weights=block)
    with torch.no_grad():
        assert torch.equal(guarded(x=kw["x"], bias=kw["bias"]), block(**kw))  # passes
        try:
            got = guarded(bias=kw["bias"], x=kw["x"])
        except GuardError as exc:  # fails here on the code as it is
            raise AssertionError(f"refused: {exc}") from None
        assert torch.equal(got, block(**kw))
