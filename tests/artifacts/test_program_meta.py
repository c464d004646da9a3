"""ProgramMeta: what every document of a capture records of its program,
written and read by one codec -- the report, the manifest and the sidecar
all go through it, and a malformed field is named by its JSON path."""

from __future__ import annotations

import collections
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from old_files import tiny_dit_report

import ctxreplay
from ctxreplay.artifacts import ProgramMeta
from ctxreplay.artifacts.program import BRIEF_KEYS, PROGRAM_KEYS, program_json
from ctxreplay.artifacts.roles import OutputRole
from ctxreplay.report.manifest import read_manifest
from ctxreplay.specs.signature import ConstSpec, SeqSpec, TensorSpec

pytestmark = [pytest.mark.filterwarnings("ignore:.*LeafSpec:FutureWarning")]


def _meta(**changes: Any) -> ProgramMeta:
    fields: dict[str, Any] = dict(
        backend="export", binding="flattened", fingerprint="f" * 16,
        embedded=("autocast",), ambient_only=("grad_mode",),
        graph_outputs=SeqSpec(tuple, (TensorSpec((2, 3), (3, 1), torch.bfloat16, "cpu"),
                                      ConstSpec(None, "NoneType", (type(None), None)))),
        constants=("args[1]",), ops=(("aten.mm.default", "bfloat16"), ("aten.view", None)),
        op_args=("a1", "b2"), graph_digest="d" * 16,
        output_roles=(OutputRole("buffer", "steps"), OutputRole("output", "out"),
                      OutputRole("assigned", "kwargs['cache'].layers[0].keys")))
    fields.update(changes)
    return ProgramMeta(**fields)


def test_the_codec_gives_back_every_field() -> None:
    meta = _meta()
    doc = meta.to_json()
    assert tuple(doc) == PROGRAM_KEYS
    assert ProgramMeta.from_json(json.loads(json.dumps(doc))) == meta


def test_a_document_with_the_brief_fields_only_reads_the_rest_as_not_known() -> None:
    brief = program_json(_meta(), BRIEF_KEYS)
    assert tuple(brief) == BRIEF_KEYS
    read = ProgramMeta.from_json(brief)
    assert (read.backend, read.binding, read.embedded) == ("export", "flattened", ("autocast",))
    assert (read.graph_outputs, read.constants, read.ops, read.op_args, read.graph_digest,
            read.output_roles) == (None, (), (), (), "", None)


def test_program_json_refuses_a_key_that_is_not_a_field() -> None:
    with pytest.raises(ValueError, match=r"\['weights'\] are not fields of ProgramMeta.*backend"):
        program_json(_meta(), ("backend", "weights"))


@pytest.mark.parametrize(("key", "bad", "named"), [
    ("binding", "sideways", r"\$\.capture\.binding: 'sideways' is not one of \['flattened', "
                            r"'native'\]"),
    ("embedded", ["autocast", 3], r"\$\.capture\.embedded\[1\]: expected a string, got int"),
    ("ops", [["aten.mm.default", 7]], r"\$\.capture\.ops\[0\]\[1\]: expected a string"),
    ("ops", [["aten.mm.default"]], r"\$\.capture\.ops\[0\]: expected \[op, dtype\]"),
    ("graph_outputs", {"tensor": {"shape": [2], "stride": [1], "dtype": "float99",
                                  "device": "cpu", "requires_grad": False}},
     r"\$\.capture\.graph_outputs\.tensor\.dtype: unknown dtype 'float99'"),
    ("graph_digest", 5, r"\$\.capture\.graph_digest: expected a string, got int"),
    ("output_roles", [{"kind": "output", "path": "out"}, {"kind": "cache", "path": "x"}],
     r"\$\.capture\.output_roles\[1\]\.kind: 'cache' is not one of \['assigned', 'buffer'"),
    ("output_roles", [{"kind": "buffer", "path": "steps", "returned": True}],
     r"\$\.capture\.output_roles\[0\]\.returned: a 'buffer' output is not returned"),
    ("output_roles", [{"kind": "output"}],
     r"\$\.capture\.output_roles\[0\]\.path: missing required field"),
])
def test_a_malformed_field_is_named_by_its_path(key: str, bad: object, named: str) -> None:
    doc = {"capture": {**_meta().to_json(), key: bad}}
    with pytest.raises(ValueError, match=named):
        ProgramMeta.from_json(doc["capture"], "$.capture")


def test_a_missing_required_field_is_named() -> None:
    doc = _meta().to_json()
    del doc["fingerprint"]
    with pytest.raises(ValueError, match=r"\$\.fingerprint: missing required field"):
        ProgramMeta.from_json(doc)


def test_outputs_json_does_not_rebuild_are_refused_or_read_as_not_known() -> None:
    Pair = collections.namedtuple("Pair", "a b")  # a class JSON names, never rebuilds
    t = TensorSpec((2,), (1,), torch.float32, "cpu")
    doc = _meta(graph_outputs=SeqSpec(Pair, (t, t))).to_json()
    with pytest.raises(ValueError, match=r"\$\.graph_outputs: a sequence of type Pair cannot "
                                         "be rebuilt"):
        ProgramMeta.from_json(doc)
    lenient = ProgramMeta.from_json(doc, rebuild_outputs=False)
    assert lenient.graph_outputs is None and lenient.ops == _meta().ops


def test_a_bad_binding_is_refused_when_the_record_is_made() -> None:
    with pytest.raises(ValueError, match="binding"):
        _meta(binding="sideways")


@pytest.fixture(scope="module")
def report() -> ctxreplay.CaptureReport:
    return tiny_dit_report()


def test_a_capture_writes_its_program_through_the_codec(report: ctxreplay.CaptureReport) -> None:
    capture = report.captures[0]
    written = capture.to_json()
    program = capture.meta.to_json()
    for key in PROGRAM_KEYS:
        if key not in ("ops", "op_args"):  # summarised under "graph"
            assert written[key] == program[key], key
    assert written["graph"]["nodes"] == len(capture.meta.ops) > 0
    # and reads back as the record it is, but for the op list the report leaves out
    read = ProgramMeta.from_json(json.loads(json.dumps(written)))
    assert read == ProgramMeta(**{**_fields(capture.meta), "ops": (), "op_args": ()})


def _fields(meta: ProgramMeta) -> dict[str, Any]:
    return {k: getattr(meta, k) for k in PROGRAM_KEYS}


def test_the_sidecar_and_the_manifest_hold_the_captures_program_record(
        report: ctxreplay.CaptureReport, tmp_path: Path) -> None:
    capture = report.captures[0]
    saved = report.save_all(tmp_path)
    side = ctxreplay.load_sidecar(saved.saved[0].path)
    # the sidecar holds the brief fields, the output roles and the state the
    # trace baked in; the rest it never held reads as not known
    assert side.meta == ProgramMeta.from_json(
        program_json(capture.meta, (*BRIEF_KEYS, "output_roles", "baked")))
    assert side.meta.baked == capture.baked is not None
    assert side.output_roles == capture.output_roles is not None
    assert (side.backend, side.binding, side.fingerprint, side.embedded, side.ambient_only) == \
        (capture.backend, capture.binding, capture.fingerprint, capture.embedded,
         capture.ambient_only)
    entry = read_manifest(tmp_path).entries[0]
    assert entry.meta == ProgramMeta(**{**_fields(capture.meta), "ops": (), "op_args": ()})
    assert entry.meta.graph_digest == capture.graph_digest != ""
    loaded = ctxreplay.load(tmp_path)
    assert isinstance(loaded, ctxreplay.LoadedManifest)
    assert loaded.captures[0].meta == side.meta


def test_a_malformed_program_field_of_a_sidecar_is_named(report: ctxreplay.CaptureReport,
                                                         tmp_path: Path) -> None:
    saved = report.captures[0].save(tmp_path / "block.pt2")
    doc = json.loads(saved.sidecar.read_text())
    doc["ambient_only"] = [None]
    saved.sidecar.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=r"\$\.ambient_only\[0\]: expected a string, got "
                                         "NoneType"):
        ctxreplay.load_sidecar(saved.path)
