"""ctxreplay --version, inspect and check on every kind of artifact, and a
clear error naming what was expected for every wrong file."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from digests import redigest
from manifest_audit import manifests_are_metadata_only  # noqa: F401
from torch import nn

import ctxreplay
from ctxreplay.cli import main

pytestmark = [pytest.mark.filterwarnings("ignore:.*LeafSpec:FutureWarning")]


class Stage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.lin(x)
        return out


class Staged(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Stage() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = x + b(x)  # a float32 residual stream: one variant per shape
        return x


def _report(backend: str = "export") -> ctxreplay.CaptureReport:
    torch.manual_seed(0)
    model = Staged().eval()
    # one capture per size (fold=False): the files hold several captures; checked
    # at "signature", the level the listings below show (the symbolic backend
    # replays autocast around its trace, so a run outside it is not ok)
    with ctxreplay.capture_with(model, targets="repeated", backend=backend,
                                fold=False, verify="signature") as session, \
            torch.autocast("cpu", dtype=torch.bfloat16), torch.inference_mode():
        model(torch.rand(2, 8))
        model(torch.rand(3, 8))
    report = session.finalize()
    assert report.ok
    return report


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cli")
    report = _report()
    report.save(root / "report.json")
    with pytest.MonkeyPatch.context() as mp:
        from metadata_check import assert_metadata_only

        import ctxreplay.report.manifest as manifest
        original = manifest.write_manifest
        mp.setattr(manifest, "write_manifest",
                   lambda p, d: (assert_metadata_only(d), original(p, d))[1])
        saved = report.save_all(root / "captures")
        _report("symbolic").save_all(root / "symbolic")
    pt2 = saved.saved[0].path
    return {"manifest dir": root / "captures", "manifest.json": saved.manifest, "pt2": pt2,
            "sidecar": saved.saved[0].sidecar, "report": root / "report.json",
            "symbolic": root / "symbolic"}


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "--version")
    assert code == 0 and out.strip() == f"ctxreplay {ctxreplay.__version__}"
    proc = subprocess.run([sys.executable, "-m", "ctxreplay.cli", "--version"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == f"ctxreplay {ctxreplay.__version__}"


@pytest.mark.parametrize("kind", ["manifest dir", "manifest.json", "pt2", "sidecar", "report"])
def test_inspect_every_kind(files: dict[str, Path], capsys: pytest.CaptureFixture[str],
                            kind: str) -> None:
    code, out, err = _run(capsys, "inspect", str(files[kind]))
    assert code == 0, err
    lines = out.splitlines()
    head = lines[0]
    assert head.split()[0] == {"manifest dir": "manifest", "manifest.json": "manifest",
                               "pt2": "saved", "sidecar": "saved", "report": "report"}[kind]
    assert f"torch {torch.__version__}" in head and f"ctxreplay {ctxreplay.__version__}" in head
    assert lines[1].split() == ["capture", "members", "weights", "inputs", "fidelity",
                                "checked", "saved", "file"]
    rows = [line for line in lines[3:] if line.startswith("blocks.")]
    assert len(rows) == (1 if kind in ("pt2", "sidecar") else 2)
    assert all("blocks.0,blocks.1" in r and "ok (signature)" in r for r in rows)
    # calls checked by value of the calls each capture stands for: none at "signature"
    assert all(re.search(r" 0/[1-9]\d* ", r) for r in rows), rows
    assert {r.split()[3] for r in rows} <= {"float32[2,8]", "float32[3,8]"}
    if kind in ("pt2", "sidecar"):
        assert "context: autocast=cpu:bfloat16" in out
        # grad mode is traced, inference mode is not: carried in part, needed in part
        # (an integration probe whose framework is imported is carried too)
        line = next(x for x in lines if x.startswith("carried by the artifact: "))
        carried, needed = line.removeprefix("carried by the artifact: ").split("; ")
        assert {"autocast", "grad_mode (in part)"} <= set(carried.split(", "))
        assert needed == "to re-establish where it runs: grad_mode=inference_mode"


def test_inspect_shows_what_was_not_saved(files: dict[str, Path],
                                          capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "inspect", str(files["symbolic"]))
    assert code == 0
    assert out.count("no: backend_not_savable") == 2


@pytest.mark.parametrize("kind", ["manifest dir", "manifest.json", "pt2", "sidecar", "report"])
def test_check_every_kind(files: dict[str, Path], capsys: pytest.CaptureFixture[str],
                          kind: str) -> None:
    code, out, err = _run(capsys, "check", str(files[kind]))
    assert code == 0, (out, err)
    assert out.splitlines()[-1].startswith("ok: ")
    assert "establish around each call: grad_mode=inference_mode [blocks.0#" in out


def _copy(files: dict[str, Path], tmp_path: Path) -> Path:
    target = tmp_path / "copy"
    shutil.copytree(files["manifest dir"], target)
    return target


def _edit(path: Path, change: Any) -> None:
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc))


def test_check_exits_1_on_a_mismatch(files: dict[str, Path], tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    copy = _copy(files, tmp_path)
    _edit(copy / "manifest.json", lambda d: d["environment"].update(torch="2.0.0"))
    code, out, err = _run(capsys, "check", str(copy))
    assert code == 1
    assert out.splitlines()[0] == (f"torch: made with 2.0.0, now {torch.__version__} "
                                   "[blocks.0#0, blocks.0#1]")
    assert "NOT OK (1 differences" in err
    code, out, _ = _run(capsys, "check", str(files["symbolic"]))
    assert code == 1 and out.count("not saved: blocks.0#") == 2


def test_check_names_an_unknown_probe_a_capture_needs(files: dict[str, Path],
                                                      tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    copy = _copy(files, tmp_path)

    def add(d: Any) -> None:
        d["snapshot"]["probes"]["acme"] = {"portable": True, "state": 1}
        d["ambient_only"].append("acme")

    for side in copy.glob("*.pt2.json"):
        _edit(side, add)
    redigest(copy)  # saved so, not edited after
    with pytest.warns(ctxreplay.probes.UnknownProbeWarning):
        code, out, _ = _run(capsys, "check", str(copy))
    assert code == 1 and out.startswith("acme: needs ")
    assert "not registered in this process" in out
    with pytest.warns(ctxreplay.probes.UnknownProbeWarning):
        code, out, _ = _run(capsys, "check", str(copy), "--ignore", "acme")
    assert code == 0, out


@pytest.mark.parametrize("command", ["inspect", "check"])
@pytest.mark.parametrize(("make", "expected"), [
    (lambda p: p.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256))),
     "not a ctxreplay file (neither a .pt2 archive nor a JSON document)"),
    (lambda p: p.write_text('{"schema": "other/1"}'), "not a ctxreplay manifest, sidecar"),
    (lambda p: p.mkdir(), "a directory without manifest.json"),
])
def test_a_wrong_file_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                       command: str, make: Any, expected: str) -> None:
    path = tmp_path / "thing"
    make(path)
    code, out, err = _run(capsys, command, str(path))
    assert code == 2 and out == ""
    # the message starts with the path the user gave, not a JSON path ("$:")
    assert err.startswith(f"ctxreplay: error: {path}: ") and expected in err
    assert "$" not in err
    assert "expected a manifest directory or its manifest.json" in err


def test_a_pt2_without_its_sidecar_and_a_missing_path(files: dict[str, Path], tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]
                                                      ) -> None:
    lone = tmp_path / "lone.pt2"
    shutil.copy(files["pt2"], lone)
    code, _, err = _run(capsys, "inspect", str(lone))
    assert code == 2 and "a .pt2 archive without its sidecar lone.pt2.json" in err
    code, _, err = _run(capsys, "check", str(tmp_path / "absent"))
    assert code == 2 and "no such file or directory" in err


def test_explain_says_what_a_wrong_file_is(files: dict[str, Path], tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(capsys, "explain", str(files["pt2"]))
    assert code == 2 and "a saved capture (.pt2 archive), not a report" in err
    binary = tmp_path / "x.bin"
    binary.write_bytes(b"\xff\xfe\xfa")
    code, _, err = _run(capsys, "explain", str(binary))
    assert code == 2 and "not a JSON document (not UTF-8 text)" in err
    code, _, err = _run(capsys, "explain", str(files["sidecar"]))
    assert code == 2 and "not a report written by report.save()" in err
