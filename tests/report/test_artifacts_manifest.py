"""report.save_all: every capture on disk with one metadata-only manifest;
ctxreplay.load reads it back strictly and says what a wrong file is."""

from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from digests import redigest
from manifest_audit import SENTINEL, manifests_are_metadata_only  # noqa: F401
from metadata_check import assert_metadata_only

import ctxreplay
import ctxreplay.report.manifest
from ctxreplay.demo import TinyDiT

pytestmark = [pytest.mark.filterwarnings("ignore:.*LeafSpec:FutureWarning")]

def dit_report(*, backend: str = "export", depth: int = 2,
               verify: str = "execute") -> tuple[TinyDiT, ctxreplay.CaptureReport]:
    torch.manual_seed(0)
    model = TinyDiT(dim=16, depth=depth, heads=2).eval()
    model.tag = SENTINEL  # a plain attribute with user text: never written
    with ctxreplay.capture_with(model, targets="repeated", verify=verify,
                                backend=backend) as session, \
            torch.autocast("cpu", dtype=torch.bfloat16), torch.inference_mode():
        for batch, tokens in ((1, 8), (2, 4)):
            model(torch.rand(batch, tokens, 16), torch.full((batch,), 500.0))
    report = session.finalize()
    assert report.ok, report.failures
    return model, report


@pytest.fixture(scope="module")
def saved_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("manifest") / "captures"
    _, report = dit_report()
    with pytest.MonkeyPatch.context() as mp:  # module scope: audit here too
        original = ctxreplay.report.manifest.write_manifest

        def checked(path: Path, doc: Any) -> None:
            assert_metadata_only(doc, sentinels=[SENTINEL])
            original(path, doc)

        mp.setattr(ctxreplay.report.manifest, "write_manifest", checked)
        saved = report.save_all(directory)
    assert saved.ok and len(saved.saved) == 2 and saved.not_saved == ()
    return directory


def test_save_all_writes_every_capture_and_one_manifest(tmp_path: Path) -> None:
    _, report = dit_report()
    saved = report.save_all(tmp_path / "new" / "dir")  # parents are created
    files = sorted(p.name for p in saved.directory.iterdir())
    assert files == sorted(["manifest.json", *(s.path.name for s in saved.saved),
                            *(s.sidecar.name for s in saved.saved)])
    doc = json.loads(saved.manifest.read_text())
    assert doc["schema"] == "ctxreplay.manifest/1"
    env = doc["environment"]
    assert env["ctxreplay"] == ctxreplay.__version__ == doc["ctxreplay"]
    assert env["torch"] == str(torch.__version__)
    assert set(env) >= {"python", "device", "capability", "autocast_policy"}
    assert set(env["autocast_policy"]) >= {"cpu"}
    assert doc["ok"] is True and doc["failures"] == [] and doc["problems"] == []
    assert [(e["capture"]["scope"], e["capture"]["variant"]) for e in doc["captures"]] == \
        [(c.scope, c.variant) for c in report.captures]
    for entry, c, s in zip(doc["captures"], report.captures, saved.saved):
        assert entry["capture"]["members"] == list(c.members) == ["blocks.0", "blocks.1"]
        assert entry["capture"]["weights_from"] == "blocks.0"
        assert entry["capture"]["fingerprint"] == c.fingerprint
        assert entry["artifact"] == s.path.name and entry["sidecar"] == s.sidecar.name
        assert entry["not_saved"] is None and entry["saved_fidelity"]["ok"] is True
        # the sidecar names the members and whose weights the file holds, too
        side = ctxreplay.load_sidecar(s.path)
        assert side.members == c.members and side.weights_from == "blocks.0"


def test_a_capture_no_pt2_can_hold_is_recorded_not_saved(tmp_path: Path) -> None:
    _, report = dit_report(backend="symbolic", depth=2, verify="signature")
    saved = report.save_all(tmp_path)
    assert saved.saved == () and not saved.ok
    assert [r for _, _, r in saved.not_saved] == ["backend_not_savable"] * len(report.captures)
    doc = json.loads(saved.manifest.read_text())
    assert [e["not_saved"] for e in doc["captures"]] == ["backend_not_savable"] * 2
    assert all(e["artifact"] is None for e in doc["captures"])
    loaded = ctxreplay.load(tmp_path)
    assert isinstance(loaded, ctxreplay.LoadedManifest)
    assert loaded.captures == () and [r for _, r in loaded.not_saved] == \
        ["backend_not_savable"] * 2


def test_save_all_refuses_a_file_as_directory(tmp_path: Path) -> None:
    _, report = dit_report(depth=2, verify="signature")
    (tmp_path / "f").write_text("x")
    with pytest.raises(NotADirectoryError, match="not a directory"):
        report.save_all(tmp_path / "f")


def test_load_a_manifest_directory(saved_dir: Path) -> None:
    loaded = ctxreplay.load(saved_dir)
    assert isinstance(loaded, ctxreplay.LoadedManifest)
    assert ctxreplay.load(saved_dir / "manifest.json").path == loaded.path
    assert loaded.ok and len(loaded) == 2 and loaded.unknown_probes == ()
    assert loaded.environment["torch"] == str(torch.__version__)
    for cap in loaded:
        assert cap.members == ("blocks.0", "blocks.1") and cap.weights_from == "blocks.0"
        assert cap.fidelity == "ok" and cap.binding == "native"
        assert "autocast" in cap.embedded and "grad_mode" in cap.ambient_only
        args, kwargs = cap.example_inputs()
        with torch.inference_mode():
            out = cap.module()(*args, **kwargs)
        assert out.dtype == torch.bfloat16
        assert cap.sidecar.check(out) == ()


def test_load_a_single_capture(saved_dir: Path) -> None:
    pt2 = sorted(saved_dir.glob("*.pt2"))[0]
    for path in (pt2, Path(str(pt2) + ".json")):
        cap = ctxreplay.load(path)
        assert isinstance(cap, ctxreplay.LoadedCapture)
        assert cap.path == pt2 and cap.members == ("blocks.0", "blocks.1")
        assert cap.environment["torch"] == str(torch.__version__)


def _copy(saved_dir: Path, tmp_path: Path) -> Path:
    target = tmp_path / "copy"
    shutil.copytree(saved_dir, target)
    return target


def _edit(path: Path, change: Callable[[Any], Any]) -> None:
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc))


@pytest.mark.parametrize(("mutate", "where"), [
    (lambda d: d.update(bogus=1), "$.bogus: unknown field"),
    (lambda d: d.update(schema="ctxreplay.manifest/9"), "$.schema: unsupported schema"),
    (lambda d: d.pop("captures"), "$.captures: missing required field"),
    (lambda d: d["captures"][0].update(artifact="../x.pt2"), "$.captures[0].artifact"),
    (lambda d: d["captures"][0].update(sidecar="other.json"), "$.captures[0].sidecar"),
    (lambda d: d["captures"][1].update(artifact=d["captures"][0]["artifact"],
                                       sidecar=d["captures"][0]["sidecar"],
                                       digests=d["captures"][0]["digests"]),
     r"$.captures[1]: file"),
    (lambda d: d["captures"][0]["digests"].update(bogus="sha256:" + "0" * 64),
     "$.captures[0].digests.bogus: unknown field"),
    (lambda d: d["captures"][0]["digests"].update({d["captures"][0]["artifact"]: "md5:0"}),
     "$.captures[0].digests."),
    (lambda d: d["captures"][0].update(not_saved="backend_not_savable"), "$.captures[0]: "),
    (lambda d: d["captures"][0]["capture"].update(members="blocks.0"),
     "$.captures[0].capture.members: expected a list"),
    (lambda d: d["captures"][0]["capture"].update(binding="pickled"),
     "$.captures[0].capture.binding"),
    (lambda d: d["captures"][0]["capture"]["fidelity"].update(ok="yes"),
     "$.captures[0].capture.fidelity.ok: expected a boolean"),
    (lambda d: d["captures"][0]["capture"].update(fingerprint="0" * 32),
     "$.captures[0].capture.fingerprint: does not match its sidecar"),
    (lambda d: d["environment"].pop("torch"), "$.environment.torch: missing"),
    (lambda d: d["failures"].append({"scope": "x"}), "$.failures[0].backend: missing"),
])
def test_load_validates_the_manifest_strictly(saved_dir: Path, tmp_path: Path, mutate: Any,
                                              where: str) -> None:
    copy = _copy(saved_dir, tmp_path)
    _edit(copy / "manifest.json", mutate)
    with pytest.raises(ValueError) as info:
        ctxreplay.load(copy)
    assert str(info.value).startswith(where), str(info.value)


def test_load_names_a_missing_file(saved_dir: Path, tmp_path: Path) -> None:
    copy = _copy(saved_dir, tmp_path)
    gone = sorted(copy.glob("*.pt2"))[0]
    gone.unlink()
    loaded = ctxreplay.load(copy)
    assert isinstance(loaded, ctxreplay.LoadedManifest)
    ((_, why),) = loaded.refused  # that capture is refused, the other loads
    assert why == f"{gone}: is missing" and len(loaded.captures) == 1


@pytest.mark.parametrize(("make", "expected"), [
    (lambda p: p.write_bytes(b"\xff\xfe\x00binary"), "not a ctxreplay file"),
    (lambda p: p.write_text('{"schema": "something/1"}'), "not a ctxreplay manifest"),
    (lambda p: p.write_text("[1, 2]"), "not a ctxreplay manifest"),
    (lambda p: p.mkdir(), "a directory without manifest.json"),
])
def test_load_says_what_a_wrong_file_is(tmp_path: Path, make: Any, expected: str) -> None:
    path = tmp_path / "thing"
    make(path)
    with pytest.raises(ValueError, match=expected) as info:
        ctxreplay.load(path)
    assert "expected a manifest directory" in str(info.value)


def test_load_refuses_a_report_and_a_pt2_without_sidecar(saved_dir: Path,
                                                          tmp_path: Path) -> None:
    _, report = dit_report(depth=2, verify="signature")
    report.save(tmp_path / "report.json")
    with pytest.raises(ValueError, match=r"a report holds no artifacts; .*save_all"):
        ctxreplay.load(tmp_path / "report.json")
    lone = tmp_path / "lone.pt2"
    shutil.copy(next(saved_dir.glob("*.pt2")), lone)
    with pytest.raises(ValueError, match=r"without its sidecar lone\.pt2\.json"):
        ctxreplay.load(lone)
    with pytest.raises(FileNotFoundError, match="no such file"):
        ctxreplay.load(tmp_path / "absent")


def _add_probe(doc: Any, name: str, *, ambient: bool) -> None:
    """A probe from a package this process does not have."""
    snap = doc["snapshot"] if "snapshot" in doc else doc["capture"]["snapshot"]
    snap["probes"][name] = {"portable": True, "state": {"mode": "fancy", "level": 3}}
    if ambient:
        target = doc if "ambient_only" in doc else doc["capture"]
        target["ambient_only"].append(name)


def test_an_unknown_probe_loads_opaque_with_one_warning(saved_dir: Path,
                                                        tmp_path: Path) -> None:
    copy = _copy(saved_dir, tmp_path)
    for side in copy.glob("*.pt2.json"):
        _edit(side, lambda d: _add_probe(d, "acme_context", ambient=False))
    redigest(copy)  # saved so, not edited after
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        loaded = ctxreplay.load(copy)
    unknown = [w for w in seen if issubclass(w.category, ctxreplay.probes.UnknownProbeWarning)]
    assert len(unknown) == 1 and "acme_context" in str(unknown[0].message)
    assert isinstance(loaded, ctxreplay.LoadedManifest)
    assert loaded.unknown_probes == ("acme_context",)
    cap = loaded.captures[0]
    assert cap.snapshot.unknown == ("acme_context",)
    # not needed around the call (carried, or neutral when made): nothing to check
    with torch.inference_mode():
        assert cap.check() == ()
    with pytest.raises(ValueError, match="acme_context"), cap.snapshot.replay():
        pass
    # the state passes through this process unchanged
    again = cap.snapshot.to_json()["probes"]["acme_context"]
    assert again == {"portable": True, "state": {"level": 3, "mode": "fancy"}}
    # load_sidecar in a consumer process: one warning, never an error
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        side = ctxreplay.load_sidecar(cap.path)
    assert [str(w.message) for w in seen if w.category is ctxreplay.probes.UnknownProbeWarning]
    assert side.snapshot.unknown == ("acme_context",)
    with pytest.raises(ValueError, match="acme_context"):
        ctxreplay.load_sidecar(cap.path, unknown="error")


def test_an_unknown_probe_a_capture_needs_is_a_difference(saved_dir: Path,
                                                          tmp_path: Path) -> None:
    copy = _copy(saved_dir, tmp_path)
    for side in copy.glob("*.pt2.json"):
        _edit(side, lambda d: _add_probe(d, "acme_context", ambient=True))
    redigest(copy)  # saved so, not edited after
    with pytest.warns(ctxreplay.probes.UnknownProbeWarning):
        loaded = ctxreplay.load(copy)
    with torch.inference_mode():
        found = loaded.check()
    assert [d.field for d in found] == ["acme_context"]
    assert "not registered in this process" in found[0].text
    assert len(found[0].captures) == 2  # one difference, naming both captures
    with torch.inference_mode():
        assert loaded.check(ignore=["acme_context"]) == ()
    with pytest.raises(ValueError, match="acme_context"), loaded.captures[0].replay():
        pass
