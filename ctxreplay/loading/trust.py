"""Whether a saved directory's files are the ones its manifest recorded.

``save_all`` records the ``sha256`` digest of every file it writes (the
artifact and its sidecar, per capture; ``ctxreplay compile`` the package's
in its record).  ``load`` checks each capture's files against them
(``changed_files``): one read of each file, and a capture whose file is
missing, a symlink, outside the directory, or not what was recorded is
refused with a reason naming the file -- the other captures still serve.
A program is read from the bytes checked (``verified_bytes``), so a file
changed after ``load`` is refused too.  A manifest written before digests
were recorded loads, its files said to be unverified (``UNVERIFIED``).
"""

from __future__ import annotations

from pathlib import Path

from .._base.safefiles import UnsafeFileError, digest, file_digest, read_inside, regular_inside
from ..errors import Error

__all__ = ["UNVERIFIED", "FileChangedError", "changed_files", "verified_bytes"]

#: what a capture whose manifest records no digests is, in words
UNVERIFIED = ("its manifest records no digests of its files (written by a ctxreplay before "
              "they were recorded): they are unverified; save the captures again to "
              "record them")


class FileChangedError(Error, ValueError):
    """A saved file that does not hold what its manifest (or sidecar) recorded:
    swapped, edited, truncated or replaced since it was written."""


def _changed(path: Path, recorded: str, found: str) -> str:
    return (f"{path}: does not hold what was saved (recorded {recorded[:19]}..., found "
            f"{found[:19]}...): swapped, edited or truncated since it was written")


def changed_files(directory: Path, digests: dict[str, str] | None,
                  names: tuple[str, ...]) -> str | None:
    """Why the files ``names`` of ``directory`` cannot be trusted -- one is
    missing, a symlink, outside the directory, or its digest is not the
    recorded one -- in words naming the file; ``None`` when they hold.
    ``digests`` ``None``: none recorded, only their place is checked."""
    for name in names:
        path = directory / name
        recorded = None if digests is None else digests.get(name)
        try:
            if recorded is None:
                regular_inside(directory, name)
                continue
            found = file_digest(directory, name)
        except FileNotFoundError:
            return f"{path}: is missing"
        except (UnsafeFileError, OSError) as exc:
            return str(exc)
        if found != recorded:
            return _changed(path, recorded, found)
    return None


def verified_bytes(directory: Path, name: str, recorded: str | None) -> bytes:
    """The bytes of ``directory / name`` (read inside it, no symlink
    followed), checked against the ``recorded`` digest where there is one:
    ``FileChangedError`` naming the file when they differ."""
    data = read_inside(directory, name)
    if recorded is not None:
        found = digest(data)
        if found != recorded:
            raise FileChangedError(_changed(directory / name, recorded, found))
    return data
