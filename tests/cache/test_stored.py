"""The capture cache's record of a capture: the program's metadata through
ProgramMeta's codec beside what the cache adds; a record written before it
had that codec reads, and writes back byte for byte."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from old_files import old_json, tiny_dit_report

from ctxreplay.artifacts import ProgramMeta
from ctxreplay.cache.stored import Stored

pytestmark = [pytest.mark.filterwarnings("ignore:.*LeafSpec:FutureWarning")]


def test_an_old_record_reads_and_writes_back_the_same() -> None:
    record = old_json("cache_record.json")
    stored = Stored.read(record)
    assert (stored.format, stored.flatten_out, stored.verify) == ("pt2", False, "execute")
    assert stored.carried == tuple(record["capture"]["carried"])
    assert stored.embedded == ("autocast", "grad_mode") and stored.ambient_only == ("grad_mode",)
    assert stored.meta == ProgramMeta.from_json(record["capture"])
    assert len(stored.ops) == len(stored.op_args) == record["about"]["nodes"]
    assert stored.graph_outputs is not None
    assert json.dumps(stored.to_json(), sort_keys=True) == \
        json.dumps(record["capture"], sort_keys=True)


def _broken(change: Any) -> dict[str, Any]:
    record = copy.deepcopy(old_json("cache_record.json"))
    change(record)
    return record


@pytest.mark.parametrize(("change", "named"), [
    (lambda r: r["capture"].pop("graph_digest"), r"\$\.capture\.graph_digest: missing required"),
    (lambda r: r["capture"]["ops"][3].append("x"), r"\$\.capture\.ops\[3\]: list longer than 2"),
    (lambda r: r["capture"].update(flatten_out="no"), r"\$\.capture\.flatten_out: expected a "
                                                      "boolean"),
    (lambda r: r["capture"]["carried"].insert(0, 1), r"\$\.capture\.carried\[0\]: expected a "
                                                     "string"),
    (lambda r: r["about"].pop("verify"), r"\$\.about\.verify: missing required field"),
])
def test_a_malformed_record_is_refused_naming_the_field(change: Any, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        Stored.read(_broken(change))


def test_a_capture_is_recorded_through_its_program_record(tmp_path: Path) -> None:
    capture = tiny_dit_report(cache=tmp_path / "cache").captures[0]
    (path,) = (tmp_path / "cache").glob("*/*/record.json")
    written = json.loads(path.read_text())
    stored = Stored.read(written)
    assert stored.meta == capture.meta  # every field, the op list included
    made = Stored(stored.format, stored.flatten_out, stored.carried, stored.verify, capture.meta)
    assert made.to_json() == written["capture"]
