"""A Capture is a core and four parts (the program's metadata, its ranks,
what the cache did, its folds): every field reads under its own name as
before, ``evolve`` changes it by that name, and the record's JSON keeps the
shape users' reports and saved files have."""

from __future__ import annotations

import json

import attrs
import pytest
import torch
from old_files import old_json, tiny_dit_report

import ctxreplay
from ctxreplay.artifacts import ProgramMeta
from ctxreplay.capture.results import make_capture
from ctxreplay.report import CacheDetails, DistributedDetails, FoldDetails

pytestmark = [pytest.mark.filterwarnings("ignore:.*LeafSpec:FutureWarning")]

#: each part's fields, as ``Capture`` reads them under their own names
PARTS = {"meta": ProgramMeta, "distributed": DistributedDetails, "caching": CacheDetails,
         "fold": FoldDetails}


@pytest.fixture(scope="module")
def capture() -> ctxreplay.Capture:
    return tiny_dit_report().captures[0]


def test_the_json_of_a_capture_is_what_it_was_before_the_split(
        capture: ctxreplay.Capture) -> None:
    before = old_json("capture.json")
    now = json.loads(json.dumps(capture.to_json()))
    # the same keys, in the same order, and the ones added since the split
    # (each output's role, after the graph's own outputs; the state its trace
    # read beside its arguments, after those; in its fidelity, the calls its
    # check stood for and those its level could not keep)
    fidelity = now["fidelity"]
    assert (fidelity.pop("calls"), fidelity.pop("not_retained")) == (capture.calls, 0)
    added = ("output_roles", "baked")
    assert [k for k in now if k not in added] == list(before)
    assert list(now).index("output_roles") == list(now).index("graph_outputs") + 1
    assert list(now).index("baked") == list(now).index("output_roles") + 1
    assert now["output_roles"] == [{"kind": "output", "path": "out", "returned": True}]
    assert now["baked"] == {"sources": [], "complete": True}  # the block reads nothing else
    varies = {"seconds", *added}
    if old_json("saved/manifest.json")["environment"]["torch"] != str(torch.__version__):
        # another torch release traces other op names, so other digests, and
        # its probes may know other states: the rest must still be equal
        varies |= {"fingerprint", "graph_digest", "graph", "graph_outputs", "snapshot",
                   "context"}
    assert {k: v for k, v in now.items() if k not in varies} == \
        {k: v for k, v in before.items() if k not in varies}


def test_every_field_of_a_part_reads_under_its_own_name(capture: ctxreplay.Capture) -> None:
    for part, cls in PARTS.items():
        for field in attrs.fields(cls):
            assert getattr(capture, field.name) is getattr(getattr(capture, part), field.name), \
                f"Capture.{field.name} is not Capture.{part}.{field.name}"
    assert capture.backend == "export" and capture.ambient_only == ("grad_mode",)
    assert capture.rank is None and capture.from_cache is False and capture.folding is None


def test_evolve_puts_each_name_into_its_part(capture: ctxreplay.Capture) -> None:
    changed = capture.evolve(rank=3, observed_on=(0, 3), not_cached="collective", folded=(4,),
                             graph_digest="x", calls=99)
    assert (changed.rank, changed.observed_on, changed.distributed.rank) == (3, (0, 3), 3)
    assert changed.caching == CacheDetails(from_cache=False, not_cached="collective")
    assert changed.fold.folded == (4,) and changed.meta.graph_digest == "x"
    assert changed.calls == 99
    # the rest of each part is kept, and the original is untouched
    assert changed.meta.ops == capture.meta.ops and changed.backend == capture.backend
    assert changed.artifact is capture.artifact
    assert (capture.rank, capture.not_cached, capture.folded, capture.calls) == \
        (None, "", (), 1)


def test_evolve_refuses_an_unknown_name_listing_the_fields(capture: ctxreplay.Capture) -> None:
    with pytest.raises(TypeError, match=r"no field 'rnak'; the fields are \[.*'rank'"):
        capture.evolve(rnak=3)
    with pytest.raises(TypeError, match=r"'meta' given whole and by its fields \['backend'\]"):
        capture.evolve(meta=capture.meta, backend="dynamo")


def test_a_capture_is_made_from_flat_names(capture: ctxreplay.Capture) -> None:
    core = {f.alias or f.name: getattr(capture, f.name) for f in attrs.fields(type(capture))
            if f.name not in PARTS}
    flat = {f.name: getattr(capture, f.name) for cls in PARTS.values()
            for f in attrs.fields(cls)}
    made = make_capture(**core, **{**flat, "rank": 1, "folded": (2,)})
    assert made.meta == capture.meta
    assert (made.rank, made.folded, made.from_cache) == (1, (2,), False)

