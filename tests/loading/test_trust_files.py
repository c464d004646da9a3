"""Files you can trust: nothing a saved directory or a cache entry holds runs,
nothing outside a directory is read, written or deleted through it, and a
file that is not what was saved is refused naming it while the others serve.

Each hostile case is built as an attacker would: the payload pickles
``open(marker, "w")`` (it runs where the marker appears), and where a
directory's digests would give the change away the attacker records them
again (``digests.redigest``, ``hashlib`` only), so the reader's own refusal
is what is tested.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from digests import redigest, sha256
from tampering import plant_symlinks, rewrite_zip
from torch import nn

import ctxreplay
from ctxreplay.cache.store import PROGRAM, READY, CacheDir, CacheWarning
from ctxreplay.cli import main

pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec:FutureWarning")


class _Payload:
    """Pickles as a call of ``open(marker, "w")``: it runs where it is unpickled
    with anything but ``weights_only``."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.marker, "w"))


def _pickled(value: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


class _A(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x))


class _B(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.register_buffer("shift", torch.full((16,), 1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) + self.shift


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.ModuleList(_A() for _ in range(2))
        self.b = nn.ModuleList(_B() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for m in [*self.a, *self.b]:
            x = m(x)
        return x


SHAPES = ((2, 16), (3, 16))


def _net() -> _Net:
    torch.manual_seed(0)
    return _Net().eval()


def _four_captures() -> ctxreplay.CaptureReport:
    """``a.0`` and ``b.0`` captured at two shapes each (not folded)."""
    model = _net()
    with ctxreplay.capture_with(model, targets="repeated", backend="export",
                                fold=False) as session, \
            torch.no_grad():
        for shape in SHAPES:
            model(torch.rand(shape))
    return session.finalize()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four captures (``a.0`` and ``b.0`` at two shapes), saved."""
    report = _four_captures()
    assert report.ok and len(report.captures) == 4
    target = tmp_path_factory.mktemp("trust") / "saved"
    assert report.save_all(target).ok
    return target


@pytest.fixture
def copy(saved: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(saved, tmp_path / "copy"))


def _entries(directory: Path) -> list[dict[str, Any]]:
    return [e for e in json.loads((directory / "manifest.json").read_text())["captures"]
            if e["artifact"]]


def _file(directory: Path, label: str) -> Path:
    for e in _entries(directory):
        if f"{e['capture']['scope']}#{e['capture']['variant']}" == label:
            return directory / e["artifact"]
    raise AssertionError(label)


def _labels(directory: Path) -> list[str]:
    return [f"{e['capture']['scope']}#{e['capture']['variant']}" for e in _entries(directory)]


def _served(directory: Path) -> dict[str, int]:
    """Hits per capture of the model installed from ``directory``, one call per shape."""
    model = _net()
    loaded = ctxreplay.load(directory)
    with ctxreplay.install(model, loaded) as handle, torch.no_grad():
        for shape in SHAPES:
            model(torch.rand(shape))
        return dict(handle.stats().hits)


# -- 1. code in a file never runs --------------------------------------------------

def _evil_inputs(marker: Path) -> Callable[[str, bytes], bytes]:
    def edit(name: str, data: bytes) -> bytes:
        if name.endswith(("sample_inputs/model.pt", "serialized_example_inputs.pt")):
            return _pickled(((_Payload(marker),), {}))
        return data
    return edit


def _evil_weights(marker: Path) -> Callable[[str, bytes], bytes]:
    """The first weight a pickle: torch's layout marks it ``use_pickle`` in its
    config (a tensor subclass's form); the older layout pickles all weights."""
    chosen: list[str] = []

    def edit(name: str, data: bytes) -> bytes:
        if name.endswith("serialized_state_dict.pt"):
            return _pickled({"lin.weight": _Payload(marker)})
        if name.endswith("model_weights_config.json"):
            doc = json.loads(data)
            first = next(iter(doc["config"].values()))
            first["use_pickle"] = True
            chosen.append(first["path_name"])
            return json.dumps(doc).encode()
        return data

    def second(name: str, data: bytes) -> bytes:
        if chosen and name.endswith(f"data/weights/{chosen[0]}"):
            return _pickled(_Payload(marker))
        return data
    edit.second = second  # type: ignore[attr-defined]
    return edit


@pytest.mark.parametrize("where", ["inputs", "weights"])
def test_a_pickle_payload_in_a_saved_file_never_runs_at_install(
        copy: Path, tmp_path: Path, where: str) -> None:
    marker = tmp_path / "ran"
    victim = _file(copy, _labels(copy)[0])
    if where == "inputs":
        rewrite_zip(victim, _evil_inputs(marker))
    else:
        edit = _evil_weights(marker)
        rewrite_zip(victim, edit)
        rewrite_zip(victim, edit.second)  # type: ignore[attr-defined]
    redigest(copy)  # an attacker who can write the directory writes its manifest too
    raised: Exception | None = None
    try:
        ctxreplay.install(_net(), ctxreplay.load(copy))
    except Exception as exc:
        raised = exc
    assert not marker.exists()  # the payload never ran
    assert isinstance(raised, ctxreplay.Error)
    assert re.search(f"{re.escape(victim.name)}.*refused: unpickling it", str(raised))


def _cache_entry_with_payload(root: Path, marker: Path) -> None:
    """Every cache entry's program rewritten so its example inputs are a
    payload, its READY checksums recorded again (as an attacker would)."""
    for ready_file in root.glob(f"??/*/{READY}"):
        entry = ready_file.parent
        data = (entry / PROGRAM).read_bytes()
        n_head, n_program, n_consts = struct.unpack_from("<III", data)
        at = struct.calcsize("<III")
        head = json.loads(data[at:at + n_head])
        head["inputs"] = base64.b64encode(_pickled(((_Payload(marker),), {}))).decode()
        new_head = json.dumps(head).encode()
        rest = data[at + n_head:]
        program = struct.pack("<III", len(new_head), n_program, n_consts) + new_head + rest
        (entry / PROGRAM).write_bytes(program)
        ready = json.loads(ready_file.read_bytes())
        ready.update(program=hashlib.sha256(program).hexdigest(), program_bytes=len(program))
        ready_file.write_text(json.dumps(ready))


@pytest.mark.parametrize("verify", ["signature", "execute"])
def test_a_rewritten_cache_entry_never_runs_its_payload(tmp_path: Path, verify: str) -> None:
    root, marker = tmp_path / "cache", tmp_path / "ran"

    def finalize() -> ctxreplay.CaptureReport:
        model = _net()
        with ctxreplay.capture_with(model, targets="repeated", backend="export",
                                    verify=verify, cache=root) as session, torch.no_grad():
            model(torch.rand(2, 16))
        return session.finalize()

    assert finalize().ok
    _cache_entry_with_payload(root, marker)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        report = finalize()
    assert not marker.exists()
    # the entry is not served: discarded with a warning, the variant captured again
    assert report.ok and not any(c.from_cache for c in report.captures)
    assert any("discarded" in str(w.message) for w in seen)


# -- 2. nothing outside the directory ------------------------------------------------

@pytest.mark.parametrize("which", ["sidecar", "artifact"])
def test_a_file_symlinked_outside_is_refused_and_the_others_serve(
        copy: Path, tmp_path: Path, which: str) -> None:
    label = _labels(copy)[0]
    artifact = _file(copy, label)
    target = artifact if which == "artifact" else Path(f"{artifact}.json")
    outside = tmp_path / "outside" / target.name
    outside.parent.mkdir()
    shutil.move(target, outside)
    target.symlink_to(outside)
    loaded = ctxreplay.load(copy)
    assert isinstance(loaded, ctxreplay.LoadedManifest)
    ((refused, why),) = loaded.refused
    assert refused == label and f"{target}: a symlink" in why
    assert label not in [c.label for c in loaded.captures] and len(loaded.captures) == 3


def test_a_manifest_symlinked_outside_is_refused(copy: Path, tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere.json"
    shutil.move(copy / "manifest.json", outside)
    (copy / "manifest.json").symlink_to(outside)
    with pytest.raises(ValueError, match=r"manifest\.json: a symlink"):
        ctxreplay.load(copy)


def test_save_all_never_writes_through_a_planted_symlink(saved: Path, tmp_path: Path) -> None:
    names = [p.name for p in saved.iterdir()]
    target = tmp_path / "again"
    target.mkdir()
    held = plant_symlinks(target, names, tmp_path / "outside")
    assert _four_captures().save_all(target).ok
    assert {p: p.read_bytes() for p in held} == held  # nothing outside written
    assert all(not (target / n).is_symlink() and (target / n).is_file() for n in names)
    assert len(ctxreplay.load(target).captures) == 4  # type: ignore[arg-type]


def _old(path: Path) -> None:
    os.utime(path, (time.time() - 7200, time.time() - 7200))


def test_cache_clear_never_deletes_through_a_tmp_symlink(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    assert CacheDir(root).write("ab" + "0" * 62, {"key": "ab" + "0" * 62}, b"x")
    shutil.rmtree(root / ".tmp", ignore_errors=True)
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "keep").mkdir()
    (outside / "keep" / "data.txt").write_text("mine")
    _old(outside / "keep")
    (root / ".tmp").symlink_to(outside)
    assert main(["cache", "clear", str(root)]) == 0
    assert (outside / "keep" / "data.txt").read_text() == "mine"
    assert sorted(p.name for p in outside.iterdir()) == ["keep"]  # nothing moved there
    assert CacheDir(root).entries() == []


def test_cache_clear_never_follows_a_symlinked_bucket(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    key = "cd" + "1" * 62
    assert CacheDir(root).write("ab" + "0" * 62, {"key": "ab" + "0" * 62}, b"x")
    outside = tmp_path / "elsewhere"
    (outside / key).mkdir(parents=True)
    (outside / key / "data.txt").write_text("mine")
    (root / "cd").symlink_to(outside)
    assert main(["cache", "clear", str(root)]) == 0
    assert (outside / key / "data.txt").read_text() == "mine"


@pytest.mark.parametrize("action", ["clear", "list", "size"])
def test_cache_commands_refuse_a_directory_the_cache_did_not_make(
        tmp_path: Path, action: str, capsys: pytest.CaptureFixture[str]) -> None:
    project = tmp_path / "project"
    (project / "mlruns" / "0").mkdir(parents=True)
    (project / "mlruns" / "0" / "meta.yaml").write_text("run")
    (project / "ab").mkdir()  # a bucket-like name, and a key-like folder in it
    (project / "ab" / ("ab" + "2" * 62)).mkdir()
    before = sorted(str(p) for p in project.rglob("*"))
    assert main(["cache", action, str(project)]) == 2
    err = capsys.readouterr().err
    assert "is not a ctxreplay capture cache" in err and "CACHEDIR.TAG" in err
    assert len(err.strip().splitlines()) == 1
    assert sorted(str(p) for p in project.rglob("*")) == before


def test_the_cache_never_writes_into_a_directory_it_did_not_make(tmp_path: Path) -> None:
    project = tmp_path / "project"
    (project / "mlruns").mkdir(parents=True)
    with pytest.warns(CacheWarning, match="mlruns"):
        assert not CacheDir(project).write("ab" + "0" * 62, {"key": "x"}, b"x")
    assert sorted(p.name for p in project.iterdir()) == ["mlruns"]


# -- 3. a changed file is never served -----------------------------------------------

def _check(directory: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(["check", str(directory)])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_swapped_files_are_refused_by_name_and_the_others_serve(
        copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    labels = _labels(copy)
    first, other = _file(copy, labels[0]), _file(copy, next(
        lb for lb in labels if lb.split("#")[0] != labels[0].split("#")[0]))
    tmp = first.with_name("swap")
    first.rename(tmp)
    other.rename(first)
    tmp.rename(other)
    code, out = _check(copy, capsys)
    assert code == 1
    assert f"{first}: does not hold what was saved" in out
    assert f"{other}: does not hold what was saved" in out
    hits = _served(copy)
    refused = {lb for lb in labels if _file(copy, lb) in (first, other)}
    assert set(hits) == set(labels) - refused and all(n == 2 for n in hits.values())


def _edit_graph(name: str, data: bytes) -> bytes:
    if name.endswith(("models/model.json", "serialized_exported_program.json")):
        return data.replace(b"aten.relu.default", b"aten.sigmoid.default")
    return data


def _flip_constant(name: str, data: bytes) -> bytes:
    """One bit flipped in the ``shift`` buffer's bytes (its 1.5s are 0x3fc00000)."""
    needle = struct.pack("<f", 1.5)
    if name.endswith(("serialized_state_dict.pt",)) or "/data/weights/" in name:
        at = data.find(needle)
        if at >= 0:
            return data[:at] + bytes([data[at] ^ 1]) + data[at + 1:]
    return data


@pytest.mark.parametrize("change", ["graph", "constant", "torn"])
def test_an_edited_or_torn_file_is_refused_by_name(copy: Path, change: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    label = next(lb for lb in _labels(copy) if lb.startswith("a." if change == "graph" else
                                                         "b." if change == "constant" else ""))
    victim = _file(copy, label)
    before = victim.read_bytes()
    if change == "torn":
        victim.write_bytes(before[:len(before) // 2])
    else:
        rewrite_zip(victim, _edit_graph if change == "graph" else _flip_constant)
    assert victim.read_bytes() != before  # the control: the file did change
    loaded = ctxreplay.load(copy)
    assert isinstance(loaded, ctxreplay.LoadedManifest)
    assert [lb for lb, _ in loaded.refused] == [label]
    assert f"{victim}: does not hold what was saved" in loaded.refused[0][1]
    assert [d.kind for d in loaded.check()][:1] == ["files"]
    code, out = _check(copy, capsys)
    assert code == 1 and f"refused: {label}: {victim}" in out
    code = main(["inspect", str(copy)])
    assert code == 1 and f"refused: {label}: {victim}" in capsys.readouterr().out
    hits = _served(copy)
    assert label not in hits and len(hits) == 3


def test_a_file_changed_after_load_is_refused_when_read(copy: Path) -> None:
    loaded = ctxreplay.load(copy)
    assert isinstance(loaded, ctxreplay.LoadedManifest)
    cap = loaded.captures[0]
    cap.path.write_bytes(cap.path.read_bytes()[:100])
    with pytest.raises(ctxreplay.Error, match=f"{cap.path}: does not hold what was saved"):
        cap.program  # noqa: B018


def test_a_single_saved_capture_checks_its_digest(copy: Path) -> None:
    victim = _file(copy, _labels(copy)[0])
    one = ctxreplay.load(victim)
    assert isinstance(one, ctxreplay.LoadedCapture) and one.verified and one.check() == ()
    victim.write_bytes(victim.read_bytes()[:-10])
    with pytest.raises(ctxreplay.Error, match=f"{victim}: does not hold what was saved"):
        ctxreplay.load(victim)


def test_a_manifest_without_digests_loads_unverified_never_ok(
        copy: Path, capsys: pytest.CaptureFixture[str],
        caplog: pytest.LogCaptureFixture) -> None:
    doc = json.loads((copy / "manifest.json").read_text())
    for e in doc["captures"]:
        e.pop("digests", None)
    (copy / "manifest.json").write_text(json.dumps(doc))
    with caplog.at_level("WARNING", logger="ctxreplay"):
        loaded = ctxreplay.load(copy)
    assert "unverified" in caplog.text
    assert isinstance(loaded, ctxreplay.LoadedManifest) and len(loaded.captures) == 4
    assert not any(c.verified for c in loaded.captures)
    assert {d.kind for d in loaded.check()} == {"files"}
    code, out = _check(copy, capsys)
    assert code == 1 and "unverified" in out
    assert len(_served(copy)) == 4  # it still loads and serves: nothing in it runs


def test_the_manifest_records_a_digest_of_every_file(saved: Path) -> None:
    for e in _entries(saved):
        assert e["digests"] == {e["artifact"]: sha256(saved / e["artifact"]),
                                e["sidecar"]: sha256(saved / e["sidecar"])}


# -- 4. bad input to the command line ----------------------------------------------

@pytest.mark.parametrize("command", ["check", "inspect"])
def test_a_path_of_undecodable_bytes_exits_2_in_one_line(saved: Path, tmp_path: Path,
                                                        command: str) -> None:
    odd = os.fsencode(tmp_path) + b"/caf\xe9"
    shutil.copytree(saved, os.fsdecode(odd))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")]),
        "LC_ALL": "C.UTF-8", "PYTHONIOENCODING": "utf-8"}
    proc = subprocess.run([sys.executable, "-c", "import sys; from ctxreplay.cli import main; "
                           "sys.exit(main())", command, odd],
                          capture_output=True, env=env, timeout=300)
    err = proc.stderr.decode("utf-8", "replace")
    assert proc.returncode == 2, (proc.stdout, err)
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert "not valid UTF-8" in err
