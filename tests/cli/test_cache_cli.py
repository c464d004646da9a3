"""``ctxreplay cache list|size|clear [DIR]``: a directory that is not there is
refused by name (a typo must not read as an empty cache), and sizes are shown
in units a person reads."""

from __future__ import annotations

from pathlib import Path

import pytest

from ctxreplay.cache.store import CacheDir
from ctxreplay.cli import main


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("action", ["list", "size", "clear"])
def test_a_missing_directory_is_refused_by_name(tmp_path: Path, action: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    typo = tmp_path / "capture-cahce"
    code, out, err = _run(capsys, "cache", action, str(typo))
    assert (code, out) == (2, "")
    assert err == f"ctxreplay: error: cache: {typo}: no such directory\n"
    assert not typo.exists()  # and nothing was made there


def test_a_file_is_not_a_cache_directory(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    file = tmp_path / "notes.txt"
    file.write_text("x")
    code, _, err = _run(capsys, "cache", "clear", str(file))
    assert code == 2 and f"{file}: no such directory" in err
    assert file.read_text() == "x"


def test_a_missing_directory_from_the_environment_says_where_it_came_from(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("CTXREPLAY_CACHE", str(tmp_path / "gone"))
    code, _, err = _run(capsys, "cache", "list")
    assert code == 2 and "gone: no such directory (from $CTXREPLAY_CACHE)" in err


def test_sizes_are_in_readable_units(tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(capsys, "cache", "size", str(tmp_path)) == (
        0, f"{tmp_path}: 0 entries, 0 B\n", "")
    store = CacheDir(tmp_path)
    record = {"about": {"class": "Block", "scope": "blocks.0", "variant": 0}}
    assert store.write("ab" + "0" * 62, record, b"\0" * 40_000)
    code, out, _ = _run(capsys, "cache", "list", str(tmp_path))
    ((_, _, entry),) = CacheDir(tmp_path).entries()
    total = CacheDir(tmp_path).size()[1]
    assert 40_000 < entry <= total < 41_000
    assert code == 0 and out.splitlines()[2].endswith(f"  {entry / 1e3:.1f} kB"), out
    assert out.splitlines()[-1] == f"{tmp_path}: 1 entry, {total / 1e3:.1f} kB"
    assert "MB" not in out


@pytest.mark.parametrize(("n", "shown"), [(0, "0 B"), (999, "999 B"), (1000, "1.0 kB"),
                                          (40_300, "40.3 kB"), (1_234_567, "1.2 MB"),
                                          (5_000_000_000, "5.0 GB")])
def test_byte_counts_in_words(n: int, shown: str) -> None:
    from ctxreplay.cli import _bytes

    assert _bytes(n) == shown
