"""What an attacker or an accident does to a saved directory, done by the
tests that check ctxreplay refuses it: a zip archive's members rewritten
(an edited graph or constant, re-zipped), and symlinks planted where
ctxreplay will write, each to a file of the user's own outside."""

from __future__ import annotations

import zipfile
from collections.abc import Callable, Iterable
from pathlib import Path


def rewrite_zip(path: Path, edit: Callable[[str, bytes], bytes]) -> None:
    """Every member of the zip archive ``path`` through ``edit(name, data)``."""
    with zipfile.ZipFile(path) as z:
        entries = [(i, z.read(i.filename)) for i in z.infolist()]
    with zipfile.ZipFile(path, "w") as z:
        for info, data in entries:
            z.writestr(info, edit(info.filename, data))


def plant_symlinks(directory: Path, names: Iterable[str], outside: Path) -> dict[Path, bytes]:
    """A symlink at each of ``names`` in ``directory`` to a file of its own in
    ``outside`` (made here); what each of those files holds."""
    outside.mkdir()
    held = {}
    for name in names:
        victim = outside / name
        victim.write_bytes(b"the user's own file " + name.encode())
        (directory / name).symlink_to(victim)
        held[victim] = victim.read_bytes()
    return held
