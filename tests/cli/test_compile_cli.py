"""``ctxreplay compile DIR``: its lines, its exit codes, and what ``inspect``
then shows of a compiled directory (one tiny folded capture, compiled in a
fresh process by ``compiled_dirs.make_compiled``, which runs the command)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from compiled_dirs import FOLDS, make_compiled, set_compiled_field

import ctxreplay
from ctxreplay.cli import main


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    directory = tmp_path_factory.mktemp("aot") / "captures"
    return directory, make_compiled(directory)


def test_compile_prints_a_line_per_capture_and_a_summary(compiled: tuple[Path, str]) -> None:
    directory, printed = compiled
    (cap,) = ctxreplay.load(directory).captures
    assert cap.compiled is not None
    line = next(x for x in printed.splitlines() if x.startswith(cap.label))
    assert line.startswith(f"{cap.label}: {cap.compiled.package}: ok, error ")
    if FOLDS:
        assert line.endswith(f" at 3 sizes; dynamic {cap.compiled.dynamic[0]}")
    else:  # one fixed-size capture where ctxreplay does not fold
        assert line.endswith(" at 1 size")
    assert f"ctxreplay compile: {directory}: 1 compiled, 0 failed their check, " \
        "0 not compiled (" in printed


def test_compiling_again_keeps_it_and_exits_0(compiled: tuple[Path, str],
                                             capsys: pytest.CaptureFixture[str]) -> None:
    directory, _ = compiled
    assert main(["compile", str(directory)]) == 0
    assert "1 compiled, 0 failed their check" in capsys.readouterr().out


def test_inspect_shows_each_compiled_program(compiled: tuple[Path, str],
                                             capsys: pytest.CaptureFixture[str]) -> None:
    directory, _ = compiled
    (cap,) = ctxreplay.load(directory).captures
    assert cap.compiled is not None
    assert main(["inspect", str(directory)]) == 0
    out = capsys.readouterr().out
    assert f"compiled: {cap.label} -> {cap.compiled.package} (ok, error " in out
    assert f"cpu_isa {cap.compiled.environment['cpu_isa']})" in out


def test_a_directory_without_a_manifest_exits_2(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compile", str(tmp_path)]) == 2
    assert f"{tmp_path} holds no manifest.json" in capsys.readouterr().err


def test_check_says_whether_each_compiled_program_runs_here(
        compiled: tuple[Path, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    directory, _ = compiled
    (cap,) = ctxreplay.load(directory).captures
    assert cap.compiled is not None
    main(["check", str(directory)])
    assert f"compiled: {cap.label} runs its compiled program ({cap.compiled.package})" in \
        capsys.readouterr().out
    moved = Path(shutil.copytree(directory, tmp_path / "captures"))
    set_compiled_field(moved, "environment.torch_git", "0" * 40)
    code = main(["check", str(moved)])
    out = capsys.readouterr().out
    assert f"compiled: {cap.label} runs uncompiled here: compiled for torch_git '{'0' * 40}'" \
        in out and "(compiled_environment)" in out
    assert code == main(["check", str(directory)])  # the captures themselves still hold
