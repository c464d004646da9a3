"""A member's identity under FSDP2: one parameter in two forms (the shard
between calls, the gathered whole in the policy's dtype during one) is one
identity, and FSDP's per-process state keys are not part of it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import parallel_cases as cases
import pytest
import torch
import torch.distributed as dist

from ctxreplay.observation.targets import identity_of

pytestmark = [pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                 reason="platform limit: torch built without gloo"),
              pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning")]


def test_the_shard_and_the_gathered_parameter_are_one_identity(tmp_path: Path) -> None:
    """Under a bf16 policy the gathered parameters are bf16, the shards
    float32: the identity recorded during a call and the one read at
    finalize() (or install) were different, and every capture failed
    ``state_not_restorable``."""
    with cases.one_rank_group(tmp_path / "store"):
        torch.manual_seed(0)
        model = cases.fsdp_model(1, bf16=True)
        with torch.no_grad():
            model(torch.rand(2, 3, cases.DIM))
        block = model.blocks[0]
        sharded = identity_of(block)
        block.unshard()
        try:
            assert block.up.weight.dtype == torch.bfloat16
            gathered = identity_of(block)
        finally:
            block.reshard()
    assert sharded == gathered


def test_fsdp_state_keys_are_not_part_of_an_identity(tmp_path: Path) -> None:
    """``fully_shard`` keeps its state under attribute names holding a uuid
    made per process: two ranks keyed the same block differently, so every
    variant was captured once per rank."""
    with cases.one_rank_group(tmp_path / "store"):
        model = cases.fsdp_model(1, bf16=False)
        block = model.blocks[0]
        assert any(k.startswith("__composable_api_state_key_") for k in block.__dict__)
        identity = identity_of(block)
        text = repr(identity)
    assert "__composable_api_state_key_" not in text


def test_fsdp_swapping_parameters_around_a_call_does_not_recheck_identity(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """FSDP registers the gathered parameters before each block call and the
    shards after, by assignment once a class's ``__setattr__`` is not
    ``nn.Module``'s (the watch's is): every block call recomputed its
    identity (~20 us a block on this machine).  A swap between the two
    forms of one parameter is no change of identity."""
    import ctxreplay
    from ctxreplay.observation import wrapper

    reads = [0]
    real = wrapper.identity_of

    def counted(*args: Any, **kwargs: Any) -> Any:
        reads[0] += 1
        return real(*args, **kwargs)

    with cases.one_rank_group(tmp_path / "store"):
        model = cases.fsdp_model(1, bf16=True)
        x = torch.rand(2, 3, cases.DIM)
        with ctxreplay.capture_with(model, targets="repeated") as session, torch.no_grad():
            model(x)
            monkeypatch.setattr(wrapper, "identity_of", counted)
            for _ in range(3):
                model(x)
            monkeypatch.setattr(wrapper, "identity_of", real)
            model.blocks[0].norm1.eps = 1e-3  # an assignment that is a change
            model(x)
        report = session.finalize()
    assert reads[0] == 0  # 9 block calls, none rechecked
    assert report.ok and len(report.captures) == 2  # the changed eps: its own variant


def test_a_plain_tensor_assigned_over_a_managed_parameter_is_refused_as_eager_does(
        tmp_path: Path) -> None:
    """The watch lets FSDP's parameter swaps through without telling anyone;
    a plain tensor assigned over a parameter is no swap: ``nn.Module``
    refuses it, observed or not (before, the watch wrote it in)."""
    import ctxreplay

    with cases.one_rank_group(tmp_path / "store"):
        model = cases.fsdp_model(1, bf16=False)
        lin = model.blocks[0].up
        plain = torch.zeros(lin.weight.shape)
        with pytest.raises(TypeError, match="cannot assign"):
            lin.weight = plain  # type: ignore[assignment]
        with ctxreplay.capture_with(model, targets="repeated"), \
                pytest.raises(TypeError, match="cannot assign"):
            lin.weight = plain  # type: ignore[assignment]
        assert isinstance(lin.weight, torch.nn.Parameter)
