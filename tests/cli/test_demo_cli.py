"""The ``ctxreplay`` command: probes, snapshot, demo."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from metadata_check import assert_metadata_only

import ctxreplay
from ctxreplay.cli import main

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


def _table(out: str) -> tuple[list[str], list[list[str]]]:
    """The demo's capture table: header cells and the rows under its rule."""
    lines = out.splitlines()
    head_at = next(i for i, line in enumerate(lines) if line.startswith("variant "))
    header = re.split(r"\s{2,}", lines[head_at].strip())
    rows = []
    for line in lines[head_at + 2:]:
        if not line.strip() or not re.match(r"^\S+#\d+ ", line):
            break
        rows.append(re.split(r"\s{2,}", line.strip()))
    return header, rows


def test_demo_writes_a_faithful_metadata_only_report(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "report.json"
    assert main(["demo", "--depth", "2", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    doc = json.loads(path.read_text())
    assert_metadata_only(doc)
    assert doc["schema"] == "ctxreplay.report/1"
    assert doc["ok"] is True and doc["failures"] == []
    assert len(doc["captures"]) == 2
    for c in doc["captures"]:
        assert c["fidelity"]["ok"] is True
        assert c["context"]["autocast"] == "cpu:bfloat16"
        assert c["context"]["grad_mode"] == "inference_mode"
        assert [leaf["tensor"]["dtype"] for leaf in c["graph_outputs"]["items"]] == ["bfloat16"]

    header, rows = _table(out)
    assert {"live", "no replay", "ctxreplay", "fidelity"} <= set(header)
    assert len(rows) == 2
    col = {name: header.index(name) for name in header}
    for row in rows:
        assert row[col["live"]] == "bfloat16"
        assert row[col["no replay"]] == "float32"  # the bug ctxreplay fixes
        assert row[col["ctxreplay"]] == "bfloat16"
        assert row[col["fidelity"]] == "ok"
    assert "every capture matches its live call" in out


def test_probes_lists_the_default_probes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["probes"]) == 0
    out = capsys.readouterr().out
    listed = {line.split()[0] for line in out.splitlines() if line and not line[0].isspace()}
    assert set(ctxreplay.probes.default_probes()) <= listed
    assert re.search(r"^autocast\s+\[default, builtin\]", out, re.M)


def test_probes_fits_the_terminal(capsys: pytest.CaptureFixture[str],
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "88")
    assert main(["probes"]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 88
    # a wrapped description continues under itself, every word kept
    words = " ".join(out.split())
    for info in ctxreplay.probes.available_probes().values():
        assert " ".join(info.description.split()) in words


def test_snapshot_json_is_a_snapshot_document(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["snapshot", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema"] == "ctxreplay.snapshot/1"
    assert set(doc["probes"]) == set(ctxreplay.probes.default_probes())
    snap = ctxreplay.ContextSnapshot.from_json(doc)
    assert snap == ctxreplay.snapshot(ctxreplay.probes.default_probes())


def test_snapshot_text_and_an_unknown_probe(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["snapshot", "autocast"]) == 0
    assert capsys.readouterr().out.split() == ["autocast", "off"]
    assert main(["snapshot", "autocats"]) == 2
    err = capsys.readouterr().err
    assert "autocats" in err and "'autocast'" in err


def test_the_console_entry_runs_the_demo() -> None:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-m", "ctxreplay.cli", "demo", "--depth", "1"],
                          capture_output=True, text=True, timeout=120, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    header, rows = _table(proc.stdout)
    assert rows and all(r[header.index("ctxreplay")] == "bfloat16" for r in rows)


def test_the_installed_script_exists_and_runs() -> None:
    script = Path(sys.executable).with_name("ctxreplay")
    if not script.exists():
        pytest.skip("no console script next to this interpreter")
    proc = subprocess.run([str(script), "probes"], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "autocast" in proc.stdout
