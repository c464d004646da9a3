"""Sharded, parallel and sequence-parallel models on 2 gloo ranks (CPU).

Each test runs a per-rank program of tests/helpers/parallel_cases.py; the
oracle is eager on the same rank (the model's own outputs for the same
calls).  Every call is dispatched, or refused with a reason a person
understands.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import parallel_cases as cases
import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from ctxreplay._base.torchcaps import CAPS

pytestmark = [pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                 reason="platform limit: torch built without gloo"),
              pytest.mark.timeout(240),
              pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning"),
              # spawned multi-rank jobs run one at a time (their joins have deadlines)
              pytest.mark.xdist_group("spawned_ranks")]


def _start_method() -> str:
    """``forkserver`` with torch and ctxreplay preloaded in the server (a rank
    starts as a fork of an interpreter that has them); ``spawn`` where there
    is none.  Neither forks the test process itself."""
    if "forkserver" not in mp.get_all_start_methods():
        return "spawn"
    mp.set_forkserver_preload(["torch", "torch.distributed", "ctxreplay", "parallel_cases"])
    return "forkserver"


def _run(case: object, out: Path) -> list[dict[str, object]]:
    return cases.run_ranks(case, 2, out, start_method=_start_method())  # type: ignore[arg-type]


def test_sequence_parallel_captures_dispatch_on_every_rank_from_the_in_process_report(
        tmp_path: Path) -> None:
    """Ulysses attention (an all_to_all_single on each side of attention)
    under bf16 autocast: each rank captured some variants; installing from
    the merged report right after finalize() dispatched only those (the
    others ran eagerly as ``backend_not_dispatchable``).  Each rank now
    rebuilds the others' programs with its own blocks' weights."""
    results = _run(cases.sequence_parallel, tmp_path)
    for rank, r in enumerate(results):
        report = r["report"]
        assert report["ok"], report
        captures = report["captures"]
        assert {c["rank"] for c in captures} == {0, 1}  # both ranks captured some
        assert all(c["collective"] and c["checked"] == ["signature", "execute"]
                   for c in captures)
        assert r["install"] == {"hits": 6, "misses": 0, "reasons": {}, "unusable": {}}, rank
        assert r["same"] and r["eager_again"]


#: the tensor parallel plans ``cases.tensor_parallel`` runs: linears only, and
#: sequence parallel norms (each rank its own shard of the sequence)
PLANS = ("tp", "sp")


def test_tensor_parallel_blocks_are_checked_on_every_rank_and_dispatched(tmp_path: Path) -> None:
    """MLP blocks with ColwiseParallel / RowwiseParallel linears: export failed
    in DTensor.from_local (ok only through Dynamo at "signature", whose
    graph no rank could run or dispatch: "program not sent",
    ``backend_not_dispatchable``).  Now the program is re-traced into local
    shards and an all_reduce, run by both ranks together at "execute", and
    dispatched on both with each rank's own shards.  The same holds with
    sequence parallel norms, each rank its own shard of the sequence (an
    all_gather before ``up``, a reduce_scatter after ``down``)."""
    results = _run(cases.tensor_parallel, tmp_path)
    if not CAPS.export_traces_dtensor:
        _assert_tensor_parallel_refused(results)
        return
    for rank, r in enumerate(results):
        for plan, verify in itertools.product(PLANS, ("signature", "execute")):
            doc = r[f"{plan}/{verify}"]
            assert doc["ok"], (rank, verify, doc)
            assert all(c["backend"] == "export" and c["collective"] for c in doc["captures"])
            assert all(c["checked"][-1] == verify for c in doc["captures"])
            assert doc["install"] == {"hits": 6, "misses": 0, "reasons": {}, "unusable": {}}, \
                (rank, verify)
            assert doc["same"], (rank, verify)



def _assert_tensor_parallel_refused(results: list[dict[str, Any]]) -> None:
    """Where torch.export cannot trace DTensor parameters, no rank serves a
    program: the report names why, and every call runs eagerly, equal to
    the uninstalled model's."""
    for rank, r in enumerate(results):
        for plan, verify in itertools.product(PLANS, ("signature", "execute")):
            doc = r[f"{plan}/{verify}"]
            # export refused; Dynamo's graph agrees by signature, but no rank
            # can run it at "execute" or dispatch it
            assert all(c["backend"] == "dynamo" for c in doc["captures"]), (rank, verify)
            assert doc["ok"] == (verify == "signature"), (rank, verify, doc)
            assert doc["install"]["hits"] == 0 and \
                doc["install"]["reasons"] == {"backend_not_dispatchable": 6}, (rank, verify)
            assert doc["same"], (rank, verify)


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """One run of ``cases.fully_sharded`` on 2 ranks, each rank's findings:
    3 transformer blocks each ``fully_shard``-ed, with and without
    ``MixedPrecisionPolicy(param_dtype=bf16)``.  On HEAD before FSDP2 was
    served every block failed ``isolation_failed`` ("FSDP does not support
    deepcopy") and the Linear layers inside them ``bad_artifact``."""
    return _run(cases.fully_sharded, tmp_path_factory.mktemp("fsdp"))  # type: ignore[return-value]


_EVERY_CALL = {"hits": 6, "misses": 0, "reasons": {}, "unusable": {}}


@pytest.mark.parametrize("policy", ["fp32", "bf16"])
@pytest.mark.parametrize("verify", ["default", "execute"])
def test_fsdp2_blocks_are_traced_on_the_gathered_parameters_and_dispatched(
        fsdp: list[dict[str, Any]], policy: str, verify: str) -> None:
    """Each variant is traced once on the whole parameters FSDP gathers for
    a call (the ranks gathering together, in the policy's dtype), checked
    at the default level and at "execute"; install dispatches every block
    call with FSDP's own hooks still gathering and resharding around it."""
    last = "sampled" if verify == "default" else "execute"
    dtype = "torch.bfloat16" if policy == "bf16" else "torch.float32"
    for rank, r in enumerate(fsdp):
        doc = r[f"{policy}/{verify}"]
        assert doc["ok"] and not doc["failures"], (rank, doc)
        assert doc["captures"] and all(c["ok"] and c["backend"] == "export"
                                       and c["checked"][-1] == last
                                       for c in doc["captures"]), (rank, doc["captures"])
        assert {c["rank"] for c in doc["captures"]} == {0, 1}, rank  # both ranks captured
        assert doc["calls"] == 12, rank  # 2 calls x 3 blocks x 2 ranks, every one counted
        assert doc["sharded_after_finalize"], rank
        # every call, a capture the other rank made included
        assert doc["install"] == _EVERY_CALL, (rank, doc["install"])
        # every parameter sharded again after each call, eager then installed
        assert doc["sharded_after_calls"] == [True] * 4, rank
        assert doc["same"] and doc["eager_again"], rank
        assert doc["dtypes"] == [dtype, dtype], rank
        # this rank's program was traced on what FSDP gathered: the policy's dtype
        assert doc["program_dtypes"] == [dtype], rank


def test_fsdp2_linears_inside_blocks_are_gathered_through_their_blocks(
        fsdp: list[dict[str, Any]]) -> None:
    """The Linear layers inside the blocks, targeted by name (they failed
    ``bad_artifact``): their parameters are in their blocks' FSDP groups."""
    for rank, r in enumerate(fsdp):
        doc = r["bf16/linears"]
        assert doc["ok"] and not doc["failures"], (rank, doc)
        assert doc["install"] == {**_EVERY_CALL, "hits": 12}, (rank, doc["install"])
        assert doc["sharded_after_finalize"] and doc["sharded_after_calls"] == [True] * 4
        assert doc["same"], rank


def test_fsdp2_captures_saved_and_loaded_dispatch_every_call(
        fsdp: list[dict[str, Any]]) -> None:
    """The bf16 captures after ``save_all`` and ``load``: every call
    dispatched with the parameters FSDP gathers, bit-identical to eager."""
    for rank, r in enumerate(fsdp):
        doc = r["loaded"]
        assert doc["install"] == _EVERY_CALL, (rank, doc["install"])
        assert doc["same"] and doc["sharded_after_calls"] == [True, True], rank


def test_fsdp2_a_training_step_through_installed_blocks_gives_eager_gradients(
        fsdp: list[dict[str, Any]]) -> None:
    """FSDP's hooks gather around each dispatched call, and after backward
    reduce-scatter gradient shards equal to eager's."""
    for rank, r in enumerate(fsdp):
        doc = r["fp32/train"]
        assert doc["ok"] and doc["same"] and doc["same_grads"] and doc["sharded"], (rank, doc)
        assert doc["install"]["hits"] == 3 and doc["install"]["misses"] == 0, (rank, doc)


def test_fsdp2_a_member_holding_fsdp_modules_is_not_dispatched(
        fsdp: list[dict[str, Any]]) -> None:
    """The whole model as one member holds the blocks' FSDP hooks, which
    gather inside its forward and which its program would skip.  Its capture
    reproduces the calls (compared by value, on the gathered weights), but
    install runs it eagerly, saying why (without a policy the shards even
    have the gathered dtype: nothing else would stop it)."""
    for rank, r in enumerate(fsdp):
        doc = r["fp32/whole"]
        assert doc["ok"] and all(c["checked"][-1] == "sampled" for c in doc["captures"]), \
            (rank, doc)
        assert doc["install"] == {"hits": 0, "misses": 2, "reasons": {"hooks": 2},
                                  "unusable": {}}, (rank, doc["install"])
        assert doc["same"] and doc["sharded_after_calls"] == [True] * 4, rank


def test_fsdp2_a_module_another_rank_cannot_name_is_refused_without_waiting(
        fsdp: list[dict[str, Any]]) -> None:
    """Rank 1 observed the model under another root, so the block rank 0
    gathers has another name there: the ranks say so to each other before
    anyone gathers, and the capture fails ``isolation_failed`` naming the
    rank and the module -- no rank waits on a gather the other never starts."""
    for rank, r in enumerate(fsdp):
        doc = r["fp32/renamed"]
        assert not doc["ok"] and not doc["captures"], (rank, doc)
        assert sorted(f[1] for f in doc["failures"]) == ["isolation_failed"] * 4, doc
        assert {f[3] for f in doc["failures"]} == {
            "rank 1 has no FSDP module 'blocks.0' to gather with rank 0",
            "rank 0 has no FSDP module '0.blocks.0' to gather with rank 1"}, doc
        assert doc["sharded_after_finalize"], rank
