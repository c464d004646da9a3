"""Sharded, parallel and sequence-parallel models on 2 gloo ranks (CPU).

Each test runs a per-rank program of tests/helpers/parallel_cases.py; the
oracle is eager on the same rank (the model's own outputs for the same
calls).  Every call is dispatched, or refused with a reason a person
understands.
"""

from __future__ import annotations

from pathlib import Path

import parallel_cases as cases
import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

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


def test_tensor_parallel_blocks_are_checked_on_every_rank_and_dispatched(tmp_path: Path) -> None:
    """MLP blocks with ColwiseParallel / RowwiseParallel linears: export failed
    in DTensor.from_local (ok only through Dynamo at "signature", whose
    graph no rank could run or dispatch: "program not sent",
    ``backend_not_dispatchable``).  Now the program is re-traced into local
    shards and an all_reduce, run by both ranks together at "execute", and
    dispatched on both with each rank's own shards."""
    results = _run(cases.tensor_parallel, tmp_path)
    for rank, r in enumerate(results):
        for verify in ("signature", "execute"):
            doc = r[verify]
            assert doc["ok"], (rank, verify, doc)
            assert all(c["backend"] == "export" and c["collective"] for c in doc["captures"])
            assert all(c["checked"][-1] == verify for c in doc["captures"])
            assert doc["install"] == {"hits": 6, "misses": 0, "reasons": {}, "unusable": {}}, \
                (rank, verify)
            assert doc["same"], (rank, verify)


def test_fsdp2_blocks_are_captured_gathered_and_dispatched_with_fsdp_gathering(
        tmp_path: Path) -> None:
    """Transformer blocks each ``fully_shard``-ed, with and without
    ``MixedPrecisionPolicy(param_dtype=bf16)``: every block failed
    ``isolation_failed`` ("FSDP does not support deepcopy").  Now each
    variant is traced once on the whole parameters FSDP gathers for a call
    (the ranks gathering together, in the policy's dtype), checked at the
    default level and at "execute", and install dispatches every block call
    with FSDP's own hooks still gathering and resharding around it."""
    results = _run(cases.fully_sharded, tmp_path)
    for rank, r in enumerate(results):
        for policy in ("fp32", "bf16"):
            for verify, last in (("default", "sampled"), ("execute", "execute")):
                doc = r[f"{policy}/{verify}"]
                where = (rank, policy, verify)
                assert doc["ok"] and not doc["failures"], (where, doc)
                assert doc["captures"] and all(
                    c["ok"] and c["backend"] == "export" and c["checked"][-1] == last
                    for c in doc["captures"]), (where, doc["captures"])
                assert {c["rank"] for c in doc["captures"]} == {0, 1}, where  # both captured
                assert doc["calls"] == 12, where  # 2 calls x 3 blocks x 2 ranks, all counted
                assert doc["sharded_after_finalize"], where
                assert doc["install"] == {"hits": 6, "misses": 0, "reasons": {},
                                          "unusable": {}}, (where, doc["install"])
                # every parameter sharded again after each call: the eager
                # ones, then the installed ones
                assert doc["sharded_after_calls"] == [True] * 4, where
                assert doc["same"] and doc["eager_again"], where
                dtype = "torch.bfloat16" if policy == "bf16" else "torch.float32"
                assert doc["dtypes"] == [dtype, dtype], where
                # the rank's own program was traced on the parameters FSDP
                # gathered for the call: in the policy's dtype
                assert doc["program_dtypes"] == [dtype], where
        # Linear layers inside the blocks, targeted by name (they failed
        # bad_artifact): gathered through their blocks' FSDP groups
        doc = r["bf16/linears"]
        assert doc["ok"] and not doc["failures"], (rank, doc)
        assert doc["install"] == {"hits": 12, "misses": 0, "reasons": {}, "unusable": {}}, \
            (rank, doc["install"])
        assert doc["sharded_after_finalize"] and doc["sharded_after_calls"] == [True] * 4
        assert doc["same"], rank
        # the bf16 captures after save_all and load (the graph of each with
        # the weights of the rank that traced it): every call dispatched
        doc = r["loaded"]
        assert doc["install"] == {"hits": 6, "misses": 0, "reasons": {}, "unusable": {}}, \
            (rank, doc["install"])
        assert doc["same"] and doc["sharded_after_calls"] == [True, True], rank
        # not dispatched: the whole model as one member holds the blocks'
        # FSDP hooks, which gather inside its forward and which its program
        # would skip.  Its capture reproduces the calls (compared by value,
        # on the gathered weights), but install runs it eagerly, saying why
        # (without a policy the shards even have the gathered dtype)
        doc = r["fp32/whole"]
        assert doc["ok"] and all(c["checked"][-1] == "sampled" for c in doc["captures"]), \
            (rank, doc)
        assert doc["install"] == {"hits": 0, "misses": 2, "reasons": {"hooks": 2},
                                  "unusable": {}}, (rank, doc["install"])
        assert doc["same"] and doc["sharded_after_calls"] == [True] * 4, rank
