"""``capture.pystate``: the Python state a forward reaches, named and put
back after a run -- closure cells, globals its code names, objects a
replacement forward holds -- read and written through the base classes'
own methods, never through a subclass's overrides."""

from __future__ import annotations

import collections
import queue
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from ctxreplay.capture.pystate import reach

STEPS: dict[str, int] = {"n": 0}
LOG: queue.SimpleQueue[int] = queue.SimpleQueue()


class _Memo:
    def __init__(self) -> None:
        self.last: torch.Tensor | None = None


def _memoised() -> tuple[nn.Module, _Memo]:
    block = nn.Linear(4, 4)
    memo = _Memo()
    orig = block.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        STEPS["n"] += 1
        LOG.put(1)
        memo.last = orig(x)
        return memo.last

    block.forward = forward  # type: ignore[method-assign]
    return block, memo


def test_a_trace_writes_a_closures_memo_and_a_global_and_both_go_back() -> None:
    block, memo = _memoised()
    kept = reach(block)
    torch.export.export(block, (torch.rand(2, 4),), strict=False)
    # the control: torch's trace left its FakeTensor in the user's memo
    assert isinstance(memo.last, FakeTensor) and STEPS["n"] == 1
    assert set(kept.changes()) == {"_Memo.last: assigned (new Tensor)",
                                   f"{__name__}.STEPS['n']: assigned (new int)"}
    assert kept.restore() == 2
    assert memo.last is None and STEPS == {"n": 0} and kept.changes() == []
    LOG.get_nowait()  # a standard library object: neither followed nor put back


class Instantiating(collections.OrderedDict[str, Any]):
    """transformers' ACT2FN: ``__getitem__`` makes an instance of the class
    an item names."""

    def __getitem__(self, key: str) -> Any:
        return super().__getitem__(key)()


TABLE = Instantiating(relu=nn.ReLU)


class UsesTable(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return TABLE["relu"](x)


def test_a_mapping_that_overrides_getitem_is_read_and_restored_as_stored() -> None:
    kept = reach(UsesTable())
    assert kept.changes() == []  # read as stored: classes, not fresh instances
    TABLE["gelu"] = nn.GELU
    TABLE["relu"] = nn.Tanh
    assert set(kept.changes()) == {f"{__name__}.TABLE['relu']: assigned (new type)",
                                   f"{__name__}.TABLE['gelu']: assigned (new type)"}
    kept.restore()
    assert list(TABLE) == ["relu"] and dict.__getitem__(TABLE, "relu") is nn.ReLU


def test_an_equal_tuple_put_back_by_a_tracer_is_no_change() -> None:
    norm = nn.LayerNorm(4)
    kept = reach(norm)
    norm.normalized_shape = tuple(norm.normalized_shape)  # another object, equal
    assert kept.changes() == [] and kept.restore() == 0


def test_a_class_forward_closure_counter_is_named_and_restored() -> None:
    count = 0

    class Counting(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            nonlocal count
            count += 1
            return super().forward(x) * count

    block = Counting(4, 4)
    kept = reach(block)
    block(torch.rand(2, 4))
    assert count == 1
    [change] = kept.changes()
    assert change.endswith("Counting.forward closure 'count': assigned (new int)")
    kept.restore()
    assert count == 0
