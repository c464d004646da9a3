"""Concurrency: many threads observing at once, sessions that cross threads,
and overlapping sessions on one model.

Autocast and grad mode are thread-local; the variant table, the observer's
cache and the wrapper's memo are shared by every thread calling the module.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from typing import Any

import pytest
import torch
from metadata_check import assert_metadata_only
from torch import nn

import ctxreplay
from ctxreplay._base.torchcaps import CAPS

THREADS = 4
CALLS = 500  # per thread

# torch's own race, reproduced without ctxreplay by
# test_torch_alone_races_in_its_autocast_weight_cache below: autocast caches
# the low-precision casts of fp32 weights in ONE process-wide map keyed by the
# weight alone (aten/src/ATen/autocast_mode.cpp, cached_cast / get_cached_casts),
# while the autocast dtype is per thread.  Two threads calling one nn.Linear,
# one under CPU bfloat16 and one under float16 autocast, then pick up each
# other's casts: "mat1 and mat2 must have the same dtype, but got BFloat16 and
# Half".  With grad enabled in both threads it happens on every release
# measured (2.7.0, 2.9.1, 2.11.0, 2.13.0, 2.14.1).  When the float16 thread is
# in inference_mode -- this file's thread 3 -- it happens only before 2.11:
# from then on cached_cast skips the cache in inference mode
# (``!c10::InferenceMode::is_enabled()``, the fix of pytorch issue 158232);
# measured: races on 2.7.0 and 2.9.1, never on 2.11.0, 2.13.0, 2.14.1.
CACHE_RACE_IN_INFERENCE = CAPS.version < (2, 11)


@contextmanager
def _fast_switching() -> Iterator[None]:
    """Switch threads as often as the interpreter allows, so races show."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x))


def _context(i: int) -> AbstractContextManager[Any]:
    """A different (thread-local) context per thread."""
    stack = ExitStack()
    if i == 1:
        stack.enter_context(torch.autocast("cpu", dtype=torch.bfloat16))
    elif i == 2:
        stack.enter_context(torch.no_grad())
    elif i == 3:
        stack.enter_context(torch.inference_mode())
        stack.enter_context(torch.autocast("cpu", dtype=torch.float16))
    return stack


def _expected_state(i: int) -> tuple[tuple[tuple[str, torch.dtype], ...], bool, bool]:
    autocast = {1: (("cpu", torch.bfloat16),), 3: (("cpu", torch.float16),)}.get(i, ())
    return autocast, i not in (2, 3), i == 3


def _shapes(i: int) -> tuple[int, int]:
    return 2 + 2 * i, 3 + 2 * i  # two variants per thread, distinct across threads


@pytest.mark.xfail(CACHE_RACE_IN_INFERENCE, strict=True, raises=AssertionError,
                   reason="torch < 2.11: autocast's weight-cast cache is shared by threads "
                          "also in inference_mode, so the bfloat16 and float16 threads "
                          "get each other's casts (reproduced without ctxreplay: "
                          "test_torch_alone_races_in_its_autocast_weight_cache)")
def test_many_threads_observe_at_once_and_every_call_is_counted() -> None:
    model = Net()
    errors: list[BaseException] = []
    start = threading.Barrier(THREADS)
    inputs = {i: [torch.rand(b, 8) for b in _shapes(i)] for i in range(THREADS)}

    def work(i: int) -> None:
        try:
            start.wait()
            with _context(i):
                for n in range(CALLS):
                    model(inputs[i][n % 2])
        except BaseException as exc:  # reported below
            errors.append(exc)

    with ctxreplay.capture_with(model, max_variants=2 * THREADS,
                                backend="symbolic") as session, _fast_switching():
        threads = [threading.Thread(target=work, args=(i,)) for i in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert errors == []
    [scope] = session.scopes
    variants = list(scope.variants.values())
    assert len(variants) == 2 * THREADS, "a variant was lost or duplicated"
    assert sum(v.calls for v in variants) == THREADS * CALLS
    seen = set()
    for v in variants:
        batch = v.inputs.args[0].shape[0]  # type: ignore[union-attr]
        i = next(i for i in range(THREADS) if batch in _shapes(i))
        autocast, grad, inference = _expected_state(i)
        assert v.snapshot["autocast"].enabled == autocast, (i, v.snapshot.describe())
        assert v.snapshot["grad_mode"].grad_enabled == grad, (i, v.snapshot.describe())
        assert v.snapshot["grad_mode"].inference_mode == inference
        assert v.calls == CALLS // 2, (i, batch, v.calls)
        seen.add((i, batch))
    assert len(seen) == 2 * THREADS

    report = session.finalize()
    assert report.observation_errors == ()
    assert sum(c.calls for c in report.captures) == THREADS * CALLS
    assert report.failures == ()
    print(f"\nthreads x calls: {THREADS} x {CALLS} = {THREADS * CALLS}, "
          f"variants: {len(report.captures)}")
    assert_metadata_only(report.to_json())


def test_threads_share_one_variant_and_count_exactly() -> None:
    """Same context, same shape from every thread: one variant, no lost count."""
    model = Net()
    x = torch.rand(2, 8)
    start = threading.Barrier(THREADS)

    def work() -> None:
        start.wait()
        for _ in range(CALLS):
            model(x)

    with ctxreplay.capture_with(model, backend="symbolic") as session, _fast_switching():
        threads = [threading.Thread(target=work) for _ in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    [(_, v)] = session.variants
    assert v.calls == THREADS * CALLS
    session.finalize()


def _in_thread(fn: Callable[[], Any]) -> Any:
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:
            box["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box.get("value")


def test_session_created_in_one_thread_used_and_finalized_in_others() -> None:
    model = Net()
    # (signature: a symbolic graph holds no autocast, so the levels that run it
    # find the bf16 variant needs autocast around it; threads are the point here)
    session = _in_thread(lambda: ctxreplay.capture_with(model, backend="symbolic",
                                                        verify="signature"))

    def use() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(torch.rand(2, 8))
        model(torch.rand(2, 8))

    _in_thread(use)
    model(torch.rand(2, 8))  # and from the main thread
    report = _in_thread(session.finalize)
    assert "forward" not in model.__dict__
    assert sorted((bool(c.snapshot["autocast"].enabled), c.calls) for c in report.captures) \
        == [(False, 2), (True, 1)]
    assert report.ok


class Stack(nn.Module):
    def __init__(self, n: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = torch.relu(b(x))
        return x


@pytest.mark.parametrize("close_first", ["whole", "blocks"])
def test_overlapping_sessions_do_not_interfere(close_first: str) -> None:
    model = Stack()
    originals = {name: m.forward for name, m in model.named_modules()}
    x = torch.rand(2, 8)
    expected = model(x)
    whole = ctxreplay.capture_with(model, backend="symbolic")
    blocks = ctxreplay.capture_with(model, targets="repeated", backend="symbolic")
    n = 7
    for i in range(n):
        with torch.autocast("cpu", dtype=torch.bfloat16) if i % 2 else nullcontext():
            out = model(x)
            if not i % 2:
                assert torch.equal(out, expected)
    first, second = (whole, blocks) if close_first == "whole" else (blocks, whole)
    first.close()
    model(x)  # counted by the still-open session only
    second.close()
    model(x)  # counted by neither

    for name, m in model.named_modules():
        assert "forward" not in m.__dict__, f"{name or 'root'}: forward not restored"
        assert m.forward == originals[name]
    extra = {"whole": 0, "blocks": 1} if close_first == "whole" else {"whole": 1, "blocks": 0}
    plain = (n + 1) // 2
    w = {bool(v.snapshot["autocast"].enabled): v.calls for _, v in whole.variants}
    assert w == {False: plain + extra["whole"], True: n // 2}
    [scope] = blocks.scopes
    assert scope.members == ["blocks.0", "blocks.1", "blocks.2"]
    # the first block sees x, the others a float32 (or under autocast bf16)
    # output that requires grad: two variants per context
    assert len(blocks.variants) == 4
    assert sum(v.calls for _, v in blocks.variants) == 3 * (n + extra["blocks"])
    rw, rb = whole.finalize(), blocks.finalize()
    assert rw.failures == () and rb.failures == ()


@pytest.mark.parametrize("close_first", ["a", "b"])
def test_two_sessions_on_the_same_module_unwind_completely(close_first: str) -> None:
    model = Net()
    x = torch.rand(2, 8)
    a = ctxreplay.capture_with(model, backend="symbolic")
    b = ctxreplay.capture_with(model, backend="symbolic")
    model(x)
    model(x)
    (a if close_first == "a" else b).close()
    model(x)
    (b if close_first == "a" else a).close()
    model(x)
    assert "forward" not in model.__dict__, "a dead wrapper was left on the module"
    counts = {"a": a.variants[0][1].calls, "b": b.variants[0][1].calls}
    assert counts == ({"a": 2, "b": 3} if close_first == "a" else {"a": 3, "b": 2})
    a.finalize()
    b.finalize()


def test_a_third_party_wrapper_between_two_sessions_is_kept() -> None:
    """Unwinding a closed session's pass-through wrapper never removes another
    tool's wrapper, even one that copied our wrapper's attributes (functools.wraps)."""
    import functools

    model = Net()
    a = ctxreplay.capture_with(model, backend="symbolic")
    inner = model.forward

    @functools.wraps(inner)
    def tool(*args: Any, **kwargs: Any) -> Any:
        return inner(*args, **kwargs)

    model.forward = tool  # type: ignore[method-assign]
    b = ctxreplay.capture_with(model, backend="symbolic")
    model(torch.rand(2, 8))
    a.close()
    b.close()
    assert model.__dict__["forward"] is tool
    model(torch.rand(2, 8))  # a's wrapper passes straight through
    assert [v.calls for _, v in a.variants] == [1]
    assert [v.calls for _, v in b.variants] == [1]
    del model.forward
    a.finalize()
    b.finalize()


# -- torch's autocast weight-cast cache, without ctxreplay -------------------------------

def _torch_alone_races(fp16_in_inference: bool, rounds: int) -> bool:
    """Whether two plain threads -- no ctxreplay -- calling one nn.Linear, one
    under CPU bfloat16 autocast (grad enabled) and one under float16 autocast
    (in inference_mode or with grad enabled), ever see each other's casts."""
    errors: list[BaseException] = []

    def work(lin: nn.Linear, start: threading.Barrier, dtype: torch.dtype,
             inference: bool) -> None:
        try:
            start.wait()
            with torch.inference_mode() if inference else nullcontext(), \
                    torch.autocast("cpu", dtype=dtype):
                for _ in range(CALLS):
                    lin(torch.rand(4, 8))
        except RuntimeError as exc:
            errors.append(exc)

    for _ in range(rounds):
        lin = nn.Linear(8, 8)
        start = threading.Barrier(2)
        threads = [threading.Thread(target=work, args=(lin, start, torch.bfloat16, False)),
                   threading.Thread(target=work,
                                    args=(lin, start, torch.float16, fp16_in_inference))]
        with _fast_switching():
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        if errors:
            assert all("must have the same dtype" in str(e) for e in errors), errors
            return True
    return False


@pytest.mark.parametrize("fp16_in_inference", [True, False], ids=["inference", "grad"])
def test_torch_alone_races_in_its_autocast_weight_cache(fp16_in_inference: bool) -> None:
    """The justification of the xfail above, and its range: torch alone races
    where the xfail says, and only there (a race is seen within a few rounds
    where it exists: 5 of 5 rounds on every release measured)."""
    expected = CACHE_RACE_IN_INFERENCE if fp16_in_inference else True
    raced = _torch_alone_races(fp16_in_inference, rounds=10 if expected else 5)
    assert raced == expected, (
        f"torch {torch.__version__}: autocast cache race "
        f"{'seen' if raced else 'not seen'}; update CACHE_RACE_IN_INFERENCE / this test")
