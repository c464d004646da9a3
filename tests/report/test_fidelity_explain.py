"""report.explain(model): which probes changed each captured graph, kept in
the report JSON, and printed by ``ctxreplay explain REPORT.json``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from metadata_check import assert_metadata_only
from torch import nn
from torchstate import default_dtype

import ctxreplay
from ctxreplay.cli import main
from ctxreplay.demo import TinyDiT
from ctxreplay.report.explain import CaptureExplanation, Explanation, ProbeEffect, compare_ops

pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec:FutureWarning")


@pytest.fixture(scope="module")
def explained() -> tuple[ctxreplay.CaptureReport, ctxreplay.Explanation]:
    torch.manual_seed(0)
    model = TinyDiT(dim=32, depth=2, heads=4).eval()
    with ctxreplay.capture_with(model, targets="repeated", verify="execute") as session, \
            torch.autocast("cpu", dtype=torch.bfloat16), torch.inference_mode():
        model(torch.rand(1, 8, 32), torch.full((1,), 500.0))
    report = session.finalize()
    return report, report.explain(model)


def test_autocast_changes_the_graph_and_determinism_does_not(
        explained: tuple[ctxreplay.CaptureReport, ctxreplay.Explanation]) -> None:
    report, explanation = explained
    (ce,) = explanation.captures
    assert (ce.scope, ce.variant) == ("blocks.0", 0)
    auto = ce["autocast"]
    assert auto.status == "changed" and auto.changed > 0 and auto.retyped > 0
    assert auto.changed == auto.retyped + auto.added + auto.removed
    assert auto.live_outputs == ("bfloat16",) and auto.outputs == ("float32",)
    assert ce["determinism"].status == "neutral" and ce["determinism"].changed == 0
    assert ce["grad_mode"].status == "no effect"  # inference mode: same ops either way
    assert ce.changing == ("autocast",)
    assert {e.probe for e in ce.effects} == set(report.captures[0].snapshot.names)
    table = explanation.table()
    auto_line = next(line for line in table.splitlines() if " autocast " in line)
    assert "nodes changed" in auto_line and "bfloat16 -> float32" in auto_line
    # the probes that changed nothing share one row
    quiet = [line for line in table.splitlines() if "determinism" in line]
    assert len(quiet) == 1 and "no effect: grad_mode (inference_mode)" in quiet[0]
    assert "neutral state, nothing to replay: " in quiet[0]
    assert str(explanation) == table


def _explanation(*effects: ProbeEffect) -> Explanation:
    return Explanation((CaptureExplanation("blocks.0", 0, effects),))


def test_the_probes_that_changed_nothing_share_one_row() -> None:
    changed = ProbeEffect("autocast", "cpu:bfloat16", "changed", 3, 2, 1, 0)
    failed = ProbeEffect("acme", "on", "failed", reason="trace_error")
    quiet = [ProbeEffect("grad_mode", "inference_mode", "no effect"),
             ProbeEffect("default_dtype", "float32", "neutral"),
             ProbeEffect("determinism", "default", "neutral")]
    rows = _explanation(changed, *quiet, failed).table().splitlines()[2:]
    assert [r.split()[:2] for r in rows] == [["blocks.0#0", "autocast"],
                                             ["blocks.0#0", "acme"],
                                             ["blocks.0#0", "3"]]
    assert rows[2].split("  -  ")[1].strip() == (
        "no effect: grad_mode (inference_mode); neutral state, nothing to replay: "
        "default_dtype, determinism")
    # one probe that changed nothing keeps its own row, state and words
    (row,) = _explanation(quiet[1]).table().splitlines()[2:]
    assert row.split() == ["blocks.0#0", "default_dtype", "float32", "no", "effect",
                           "(neutral", "state:", "nothing", "to", "replay)"]


def test_the_table_wraps_its_effect_column_to_a_width() -> None:
    quiet = [ProbeEffect(f"probe_{i}", "default", "neutral") for i in range(12)]
    table = _explanation(ProbeEffect("autocast", "cpu:bfloat16", "changed", 34, 32, 0, 2,
                                     ("float32",), ("bfloat16",)), *quiet)
    wide, narrow = table.table(), table.table(width=72)
    assert max(len(line) for line in wide.splitlines()) > 100
    assert max(len(line) for line in narrow.splitlines()) <= 72
    # the same words, each row's continuation lines indented under its effect
    assert narrow.split() == wide.split()
    indent = narrow.splitlines()[0].index("effect")
    continued = [line for line in narrow.splitlines()[2:] if not line.startswith("blocks")]
    assert continued and all(line[:indent].isspace() for line in continued)


def test_explain_results_are_stored_in_the_report_json(
        explained: tuple[ctxreplay.CaptureReport, ctxreplay.Explanation]) -> None:
    report, explanation = explained
    doc = json.loads(json.dumps(report.to_json()))
    assert_metadata_only(doc)
    stored = doc["captures"][0]["explain"]
    assert stored == [e.to_json() for e in explanation.captures[0].effects]
    assert Explanation.from_report_json(doc) == explanation


def test_probe_effect_json_is_validated() -> None:
    good = ProbeEffect("autocast", "cpu:bfloat16", "changed", 3, 2, 1, 0).to_json()
    assert ProbeEffect.from_json(good) == ProbeEffect("autocast", "cpu:bfloat16", "changed",
                                                      3, 2, 1, 0)
    with pytest.raises(ValueError, match=r"^\$\.status"):
        ProbeEffect.from_json({**good, "status": "maybe"})
    with pytest.raises(ValueError, match=r"^\$\.changed"):
        ProbeEffect.from_json({**good, "changed": -1})
    with pytest.raises(ValueError, match=r"^\$\.extra"):
        ProbeEffect.from_json({**good, "extra": 1})


def test_compare_ops_aligns_by_op_and_counts_retyped_nodes() -> None:
    a = [("aten.linear.default", "bfloat16"), ("aten.relu.default", "bfloat16")]
    b = [("aten.linear.default", "float32"), ("aten.relu.default", "float32"),
         ("aten.add.Tensor", "float32")]
    assert compare_ops(a, b) == (2, 1, 0)
    assert compare_ops(a, a) == (0, 0, 0)


class OnesPlus(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ones(3) + x


def test_explain_finds_the_default_dtype() -> None:
    model = OnesPlus()
    with ctxreplay.capture_with(model, backend="export") as session, \
            default_dtype(torch.float64):
        model(torch.rand(3, dtype=torch.float32))
    report = session.finalize()
    (ce,) = report.explain(model).captures
    assert ce["default_dtype"].status == "changed"
    assert ce["default_dtype"].outputs == ("float32",)
    assert ce["autocast"].status == "neutral"


class Lin(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.lin(x)
        return out


class Custom:
    name = "mine"

    def capture(self, module: nn.Module, args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> Any:
        return torch.export.export(module, args, kwargs or None, strict=False)


def test_explain_reuses_the_sessions_custom_backend() -> None:
    model = Lin()
    with ctxreplay.capture_with(model, backend=Custom()) as session, \
            torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.rand(2, 4))
    report = session.finalize()
    # the report keeps the session's options, custom backend included
    (ce,) = report.explain(model).captures
    assert ce["autocast"].status == "changed"
    (ce,) = report.explain(model, backend=Custom()).captures
    assert ce["autocast"].status == "changed"


def test_explain_with_the_wrong_model_says_module_not_found() -> None:
    model = nn.Sequential(nn.ModuleList([Lin(), Lin()]))
    with ctxreplay.capture_with(model, targets="repeated") as session, \
            torch.autocast("cpu", dtype=torch.bfloat16):
        for block in model[0]:
            block(torch.rand(2, 4))
    report = session.finalize()
    (ce,) = report.explain(Lin()).captures
    assert {e.status for e in ce.effects} == {"failed"}
    assert {e.reason for e in ce.effects} == {"module_not_found"}


def test_cli_explain_on_the_demo_report(tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "report.json"
    assert main(["demo", "--depth", "2", "--json", str(path)]) == 0
    capsys.readouterr()
    assert main(["explain", str(path)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split() == ["capture", "probe", "state", "effect"]
    autocast = [line for line in lines if line.split()[1:2] == ["autocast"]]
    quiet = [line for line in lines if "no effect: grad_mode" in line]
    assert len(autocast) == 2 and all("nodes changed" in line for line in autocast)
    assert len(quiet) == 2 and all(line.split()[2:4] == ["others", "-"] for line in quiet)
    # wrapped to 88 columns, stdout not being a terminal
    assert max(len(line) for line in lines) <= 88 < len(" ".join(lines[2:4]))


def test_cli_explain_without_results_or_on_bad_input(
        explained: tuple[ctxreplay.CaptureReport, ctxreplay.Explanation], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    report, _ = explained
    doc = report.to_json()
    for c in doc["captures"]:
        c.pop("explain", None)
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps(doc))
    assert main(["explain", str(bare)]) == 1
    assert "no explain results" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    doc["captures"][0]["explain"] = [{"probe": "autocast", "state": "x", "status": "odd"}]
    bad.write_text(json.dumps(doc))
    assert main(["explain", str(bad)]) == 2
    assert "$.captures[0].explain[0].status" in capsys.readouterr().err
    (tmp_path / "junk.json").write_text("{")
    assert main(["explain", str(tmp_path / "junk.json")]) == 2


def test_a_capture_checked_by_value_shows_its_counts_in_one_row() -> None:
    quiet = (ProbeEffect("grad_mode", "no_grad", "neutral"),
             ProbeEffect("default_dtype", "float32", "neutral"))
    proven = Explanation((CaptureExplanation("blocks.0", 0, quiet, 9, 90),))
    *_, row = proven.table().splitlines()
    assert row.split("  -  ")[0].split() == ["blocks.0#0", "by", "value"]
    assert row.endswith("9 of 90 calls compared by value")
    lost = Explanation((CaptureExplanation("blocks.0", 0, quiet, 3, 90, 18),))
    assert lost.table().splitlines()[-1].endswith(
        "3 of 90 calls compared by value; 18 not kept (retain_bytes reached): not ok, "
        "those calls were never compared")
    # nothing compared by value, nor meant to be (verify="execute"): no row
    assert "by value" not in _explanation(*quiet).table()


def test_ctxreplay_explain_reads_the_counts_from_the_saved_fidelity() -> None:
    doc = {"captures": [{"scope": "blocks.0", "variant": 0, "explain": [],
                         "fidelity": {"ok": False, "by_value": 3, "calls": 90,
                                      "not_retained": 18}},
                        {"scope": "blocks.0", "variant": 1, "explain": [],
                         "fidelity": {"ok": True}}]}
    first, older = Explanation.from_report_json(doc).captures
    assert (first.compared, first.calls, first.not_retained) == (3, 90, 18)
    assert (older.compared, older.calls, older.not_retained) == (0, 0, 0)
    with pytest.raises(ValueError, match=r"fidelity\.not_retained"):
        Explanation.from_report_json({"captures": [
            {"scope": "b", "variant": 0, "explain": [], "fidelity": {"not_retained": -1}}]})
