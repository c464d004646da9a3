"""A compiled package is native code: it runs only where its digest, recorded
by ``ctxreplay compile`` in the manifest, holds; ``save_all`` and ``compile``
never write through a symlink planted at a name they write.

The directory is made once in a fresh process (``compiled_dirs``, one size:
one capture on every torch release) into a folder where a symlink to a file
outside already sits at every name the save and the compile write.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from compiled_dirs import build_model, make_compiled
from digests import sha256
from tampering import plant_symlinks

import ctxreplay
from ctxreplay.cli import main

NAMES = ("000-blocks.0-v0.pt2", "000-blocks.0-v0.pt2.json", "manifest.json",
         "000-blocks.0-v0.aoti.pt2")


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[Path, bytes]]:
    root = tmp_path_factory.mktemp("aot_trust")
    directory, outside = root / "captures", root / "outside"
    directory.mkdir()
    held = plant_symlinks(directory, NAMES, outside)
    make_compiled(directory, sizes="7")  # one fixed-size capture on every torch
    return directory, held


@pytest.fixture()
def copy(planted: tuple[Path, dict[Path, bytes]], tmp_path: Path) -> Path:
    return Path(shutil.copytree(planted[0], tmp_path / "captures"))


def _packaged(directory: Path) -> bool:
    """Whether this torch compiled the capture.  torch 2.7's AOTInductor loader
    takes other arguments than ctxreplay's, so ``ctxreplay compile`` leaves
    the capture uncompiled there with its reason: then no package exists
    and none can be loaded, changed or not -- what these tests assert."""
    (entry,) = json.loads((directory / "manifest.json").read_text())["captures"]
    if "compiled" not in entry:
        assert _stats(directory).compiled == ()  # nothing compiled runs
        return False
    return True


def _stats(directory: Path) -> ctxreplay.DispatchStats:
    model = build_model()
    with ctxreplay.install(model, ctxreplay.load(directory)) as handle, \
            torch.autocast("cpu", dtype=torch.bfloat16), torch.inference_mode():
        model(torch.rand(4, 7, 32))
        return handle.stats()


def test_save_and_compile_never_write_through_a_planted_symlink(
        planted: tuple[Path, dict[Path, bytes]]) -> None:
    directory, held = planted
    assert {p: p.read_bytes() for p in held} == held  # nothing outside written
    for name in NAMES:
        assert (directory / name).is_file() and not (directory / name).is_symlink(), name


def test_the_package_digest_is_recorded_and_the_compiled_program_runs(
        planted: tuple[Path, dict[Path, bytes]]) -> None:
    directory = planted[0]
    if not _packaged(directory):
        return
    (entry,) = json.loads((directory / "manifest.json").read_text())["captures"]
    package = directory / entry["compiled"]["package"]
    assert entry["compiled"]["digest"] == sha256(package)
    stats = _stats(directory)
    assert stats.uncompiled == {} and len(stats.compiled) == 2


def test_a_changed_package_never_loads(copy: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    if not _packaged(copy):
        return
    package = copy / NAMES[3]
    data = bytearray(package.read_bytes())
    data[len(data) // 2] ^= 1  # one bit, deep inside the package's native code
    package.write_bytes(bytes(data))
    stats = _stats(copy)
    assert list(stats.uncompiled.values()) == ["compiled_changed"] and stats.compiled == ()
    assert sum(stats.hits.values()) == 2  # the uncompiled capture still serves
    assert main(["check", str(copy)]) == 1
    out = capsys.readouterr().out
    assert f"{package}: does not hold what was saved" in out


def test_a_package_swapped_in_after_load_never_loads(copy: Path) -> None:
    if not _packaged(copy):
        return
    loaded = ctxreplay.load(copy)
    package = copy / NAMES[3]
    package.write_bytes((copy / NAMES[0]).read_bytes())  # another archive in its place
    model = build_model()
    with ctxreplay.install(model, loaded) as handle, \
            torch.autocast("cpu", dtype=torch.bfloat16), torch.inference_mode():
        model(torch.rand(4, 7, 32))
        assert list(handle.stats().uncompiled.values()) == ["compiled_changed"]


def test_a_record_without_a_digest_never_loads_its_package(copy: Path) -> None:
    if not _packaged(copy):
        return
    path = copy / "manifest.json"
    doc = json.loads(path.read_text())
    doc["captures"][0]["compiled"].pop("digest")
    path.write_text(json.dumps(doc))
    stats = _stats(copy)
    assert list(stats.uncompiled.values()) == ["compiled_unverified"]
