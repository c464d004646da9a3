"""Files written before a capture's program record had one codec (a manifest
directory and its sidecar, by ctxreplay at commit 6ae7929) load with this
code: every field reads as it was written, and the program runs as the
sidecar says the live call ran."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from old_files import ARTIFACT_NAME, old_json, old_saved_dir, tiny_dit_report

import ctxreplay
from ctxreplay.artifacts import ProgramMeta

pytestmark = [pytest.mark.filterwarnings("ignore:.*LeafSpec:FutureWarning")]


@pytest.fixture(scope="module")
def capture() -> ctxreplay.Capture:
    return tiny_dit_report().captures[0]


def test_an_old_manifest_directory_loads_with_every_field(capture: ctxreplay.Capture,
                                                          tmp_path: Path) -> None:
    directory = old_saved_dir(tmp_path, capture)
    loaded = ctxreplay.load(directory)
    assert isinstance(loaded, ctxreplay.LoadedManifest) and loaded.ok
    (one,) = loaded.captures
    written = old_json("saved/manifest.json")["captures"][0]["capture"]
    side = old_json(f"saved/{ARTIFACT_NAME}.json")
    assert one.meta == ProgramMeta(side["backend"], side["binding"], side["fingerprint"],
                                   tuple(side["embedded"]), tuple(side["ambient_only"]))
    assert (one.meta.backend, one.binding, one.fingerprint) == \
        (written["backend"], written["binding"], written["fingerprint"])
    assert one.ambient_only == ("grad_mode",) and one.embedded == ("autocast", "grad_mode")
    assert (one.label, one.members, one.weights_from, one.fidelity) == \
        ("blocks.0#0", ("blocks.0",), "blocks.0", "ok")


def test_an_old_sidecar_loads_and_its_program_runs_as_the_live_call_did(
        capture: ctxreplay.Capture, tmp_path: Path) -> None:
    directory = old_saved_dir(tmp_path, capture)
    one = ctxreplay.load(directory / ARTIFACT_NAME)
    assert isinstance(one, ctxreplay.LoadedCapture)
    assert one.meta.fingerprint == old_json(f"saved/{ARTIFACT_NAME}.json")["fingerprint"]
    assert one.output_roles is None  # written before roles were recorded: not known
    args, kwargs = one.example_inputs()
    with one.replay():
        outputs = one.module()(*args, **kwargs)
    assert one.sidecar.check(outputs) == ()
    # the check can fail: outputs of another dtype disagree with the old sidecar
    assert one.sidecar.check(tuple(o.float() for o in torch.utils._pytree.tree_leaves(outputs)))


def test_inspect_says_an_old_files_output_roles_were_not_recorded(
        capture: ctxreplay.Capture, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from ctxreplay.cli import main
    directory = old_saved_dir(tmp_path, capture)
    for path in (directory, directory / ARTIFACT_NAME):
        assert main(["inspect", str(path)]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert "graph outputs of blocks.0#0: roles not recorded" in lines, lines
