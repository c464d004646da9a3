"""One finalize pipeline: a single process runs the steps of a distributed
job as its one-rank case, so a session over an explicit group of one rank and
a plain session make equal reports (but for what only a group has to say)."""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from distributed_cases import Stack

import ctxreplay

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="platform limit: torch built without gloo")


@pytest.fixture
def one_rank_group(tmp_path: Path) -> Iterator[Any]:
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1, timeout=datetime.timedelta(seconds=30))
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def _report(group: Any, verify: str) -> ctxreplay.CaptureReport:
    torch.manual_seed(0)
    model = Stack()
    with ctxreplay.capture_with(model, targets="repeated", verify=verify,
                                group=group) as session:
        model(torch.rand(2, 8))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(torch.rand(3, 8))
        model(torch.rand(2, 8))
    return session.finalize()


def _comparable(doc: Any) -> Any:
    """A report document without timings and the distributed section."""
    if isinstance(doc, dict):
        return {k: _comparable(v) for k, v in doc.items()
                if k not in ("seconds", "distributed", "rank", "observed_on", "rank_calls")}
    if isinstance(doc, list):
        return [_comparable(v) for v in doc]
    return doc


@pytest.mark.parametrize("verify", ["signature", "execute"])
def test_a_one_rank_group_and_a_plain_session_give_equal_reports(
        one_rank_group: Any, verify: str) -> None:
    plain = _report(None, verify)  # no group named, a world of one: one process
    grouped = _report(one_rank_group, verify)  # the collective path over one rank
    assert plain.distributed is None
    assert grouped.distributed is not None and grouped.distributed["group_ranks"] == [0]
    assert grouped.distributed["assigned"] == [len(grouped.captures)]
    assert plain.ok and grouped.ok
    # (the first block, the later ones: their input requires grad) x (float32, bfloat16)
    assert len(plain.captures) == 4
    assert _comparable(grouped.to_json()) == _comparable(plain.to_json())
    # the comparison sees what differs: another session's report is not equal
    other = _report(None, "off" if verify == "signature" else "signature")
    assert _comparable(other.to_json()) != _comparable(plain.to_json())
