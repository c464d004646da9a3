"""Files read and written only inside their directory: no symlink is followed
out of it, nothing is written through one, and a file is replaced whole.

A name is resolved against its directory (``inside``): the directory's own
path may hold symlinks (``captures -> /data/captures`` is the user's
choice), but the file itself must not be one, and its real path must lie in
the directory's real path.  Reads open the file with ``O_NOFOLLOW`` as well,
so a symlink planted between the check and the open is refused by the
kernel (``ELOOP``).  Writes go to a fresh temporary name in the directory,
created with ``O_CREAT | O_EXCL | O_NOFOLLOW`` (it cannot exist, nor be a
link), and are renamed over the target: ``rename`` replaces a symlink
itself, never the file it points to.  ``sha256`` digests name what a file
holds (``sha256:<hex>``).
"""

from __future__ import annotations

import errno
import hashlib
import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path

from ..errors import Error

__all__ = ["DIGEST_PREFIX", "UnsafeFileError", "digest", "file_digest", "inside", "read_digest",
           "read_inside", "regular_inside", "temp_name", "write_inside", "written_inside"]

#: how a digest is written: the algorithm, then the hex digest
DIGEST_PREFIX = "sha256:"
_CHUNK = 1 << 22


class UnsafeFileError(Error, ValueError):
    """A file that would be read or written outside its directory (a symlink,
    or a name that leaves it), or that is not a regular file."""


def inside(directory: Path, name: str) -> Path:
    """``directory / name``, checked: not a symlink, not anything but a
    regular file where it exists, and inside ``directory``'s real path."""
    path = directory / name
    if path.is_symlink():
        raise _symlink(path)
    real, root = os.path.realpath(path), os.path.realpath(directory)
    if os.path.commonpath([real, root]) != root or real == root:
        raise UnsafeFileError(f"{path}: lies outside {directory}")
    if path.exists() and not path.is_file():
        raise UnsafeFileError(f"{path}: not a regular file")
    return path


def _bare(name: str) -> bool:
    return Path(name).name == name and name not in ("", ".", "..")


def _symlink(path: Path) -> UnsafeFileError:
    try:
        to = f" (to {os.readlink(path)})"
    except OSError:
        to = ""
    return UnsafeFileError(f"{path}: a symlink{to}; a saved file must be a regular file in its "
                           "directory")


def regular_inside(directory: Path, name: str) -> Path:
    """``directory / name``, checked with one ``lstat`` where ``name`` is a
    bare file name (then the file itself not being a symlink keeps it
    inside ``directory``): a regular file, not a symlink; ``inside`` for any
    other name.  ``FileNotFoundError`` where it is missing."""
    if not _bare(name):
        path = inside(directory, name)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: is missing")
        return path
    path = directory / name
    mode = os.lstat(path).st_mode
    if stat.S_ISLNK(mode):
        raise _symlink(path)
    if not stat.S_ISREG(mode):
        raise UnsafeFileError(f"{path}: not a regular file")
    return path


def _open_read(directory: Path, name: str) -> int:
    """An open descriptor of ``directory / name``: ``O_NOFOLLOW``, so for a bare
    name (the file directly in ``directory``) the kernel refuses a symlink
    and nothing outside can be reached; other names are checked by ``inside``
    first."""
    path = directory / name if _bare(name) else inside(directory, name)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _symlink(path) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UnsafeFileError(f"{path}: not a regular file")
    return fd


def read_inside(directory: Path, name: str) -> bytes:
    """The bytes of ``directory / name`` (``inside``; opened with ``O_NOFOLLOW``)."""
    fd = _open_read(directory, name)
    with os.fdopen(fd, "rb") as f:
        return f.read()


def file_digest(directory: Path, name: str) -> str:
    """The digest of ``directory / name``, read once in chunks (``inside``)."""
    fd = _open_read(directory, name)
    h = hashlib.sha256()
    with os.fdopen(fd, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return DIGEST_PREFIX + h.hexdigest()


_HEX = frozenset("0123456789abcdef")


def read_digest(value: object, path: str) -> str:
    """``value`` checked to be a digest as ``digest`` writes it; ``ValueError``
    naming ``path`` otherwise."""
    if not isinstance(value, str) or not value.startswith(DIGEST_PREFIX) or \
            len(value) != len(DIGEST_PREFIX) + 64 or not set(value[len(DIGEST_PREFIX):]) <= _HEX:
        raise ValueError(f"{path}: expected a digest 'sha256:<64 hex digits>', got "
                         f"{str(value)[:80]!r}")
    return value


def digest(data: bytes) -> str:
    """The digest of ``data``: ``sha256:<hex>``."""
    return DIGEST_PREFIX + hashlib.sha256(data).hexdigest()


def temp_name(target: Path) -> Path:
    """A fresh temporary file beside ``target``, created empty with
    ``O_EXCL | O_NOFOLLOW`` (so it is no link and was no file before): a
    writer fills it by path and ``written_inside`` renames it over ``target``."""
    # the target's suffix kept last: a writer may insist on it (AOTInductor's
    # packager refuses a package path that does not end ".pt2")
    tmp = target.with_name(f".tmp-{secrets.token_hex(6)}-{target.name}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0),
                 0o644)
    os.close(fd)
    return tmp


def written_inside(target: Path, write: Callable[[Path], object]) -> None:
    """Run ``write(tmp)`` on a fresh temporary name beside ``target``
    (``temp_name``), then rename it over ``target``; on failure the temporary
    file is removed and ``target`` is left as it was."""
    tmp = temp_name(target)
    try:
        write(tmp)
        if tmp.is_symlink() or not tmp.is_file():
            raise UnsafeFileError(f"{tmp}: replaced by something else while it was written")
        os.replace(tmp, target)
    except BaseException:  # the temporary file removed, then re-raised
        tmp.unlink(missing_ok=True)
        raise


def write_inside(target: Path, data: bytes) -> None:
    """Write ``data`` to ``target`` whole: a temporary name beside it, renamed
    over it (a symlink at ``target`` is replaced, its target left alone)."""
    def put(tmp: Path) -> None:
        fd = os.open(tmp, os.O_WRONLY | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0))
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    written_inside(target, put)
