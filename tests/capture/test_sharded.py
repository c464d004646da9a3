"""Views of FSDP2 (``fully_shard``) members: copied with the parameters FSDP
gathers for a call, in the policy's dtype, every parameter sharded again
after.  One gloo rank in this process (the many-rank runs, the ranks
gathering together, are in tests/distributed/test_parallel.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import parallel_cases as cases
import pytest
import torch
import torch.distributed as dist
from torch import nn

from ctxreplay.capture.isolate import isolated
from ctxreplay.capture.sharded import fsdp_owners

pytestmark = [pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                 reason="platform limit: torch built without gloo"),
              pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning")]


@pytest.fixture
def model(tmp_path: Path) -> Iterator[nn.Module]:
    with cases.one_rank_group(tmp_path / "store"):
        torch.manual_seed(0)
        built = cases.fsdp_model(1, bf16=True)
        with torch.no_grad():  # FSDP's lazy init: the model is the root
            built(torch.rand(2, 3, cases.DIM))
        yield built


def _whole(p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return p.full_tensor().to(dtype)  # type: ignore[attr-defined, no-any-return]


def test_a_view_holds_the_gathered_parameters_as_its_own_class(model: nn.Module) -> None:
    """The view is a plain ``TransformerBlock`` (not ``FSDPTransformerBlock``,
    which refuses deepcopy) holding the whole parameters in the policy's
    dtype, as FSDP registers them for a call; the block is sharded again
    after, and the view's copies outlive the gathered storage FSDP frees."""
    block = model.blocks[0]
    wanted = {n: _whole(p, torch.bfloat16) for n, p in block.named_parameters()}
    with isolated(block) as view:
        assert type(view) is cases.TransformerBlock
        assert cases.sharding(block, 1)  # resharded once the view was made
        got = dict(view.named_parameters())
        assert got.keys() == wanted.keys()
        for name, p in got.items():
            assert type(p) is nn.Parameter and torch.equal(p, wanted[name]), name
        assert not any(k.startswith("__composable_api_state_key_") or
                       k == "_is_fsdp_managed_module"
                       for m in view.modules() for k in m.__dict__)
        assert not view._forward_pre_hooks and not view._forward_hooks  # FSDP's, not run
        x = torch.rand(2, 3, cases.DIM, dtype=torch.bfloat16)
        with torch.no_grad():
            live = block(x)  # FSDP's hooks gather, run and free again
            assert torch.equal(view(x), live)
    assert cases.sharding(model, 1)


def test_a_layer_inside_a_block_is_gathered_through_the_block(model: nn.Module) -> None:
    """A Linear inside a ``fully_shard``-ed block is not an FSDP module; its
    parameters are in the block's group, so the block is gathered."""
    up = model.blocks[1].up
    assert fsdp_owners(up) == [model.blocks[1]]
    with isolated(up) as view:
        assert type(view) is nn.Linear
        assert torch.equal(view.weight, _whole(up.weight, torch.bfloat16))
    assert cases.sharding(model, 1)


def test_an_owner_found_gathered_is_left_gathered(model: nn.Module) -> None:
    """A block whose parameters were gathered before (``unshard()``, as a
    root FSDP keeps them after a forward) is used as it is and not
    resharded by the view."""
    block = model.blocks[2]
    block.unshard()
    try:
        with isolated(block) as view:
            assert view.up.weight.dtype == torch.bfloat16
        assert type(block.up.weight) is nn.Parameter  # still gathered
    finally:
        block.reshard()
    assert cases.sharding(model, 1)
