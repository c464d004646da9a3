"""The cache directory: entries written whole or not at all, read back
checked, listed, sized and cleared.

An entry is a folder ``<root>/<key[:2]>/<key>/`` holding ``record.json``
(metadata only), ``program.bin`` (the program without weights) and
``READY`` (the sha256 of both, written last).  A writer fills a private
folder under ``<root>/.tmp/`` and renames it into place: a reader sees a
complete entry or none, and of two processes (or ranks) writing one key the
first rename wins and the other's equal entry is dropped -- nothing is
overwritten.  A reader checks ``READY`` against both files; an entry that
fails (truncated, corrupted, half-copied) is discarded with one warning and
the variant is captured again.  A directory that cannot be written is still
read; writes are skipped with one warning per directory and process.

The cache marks its directory with a ``CACHEDIR.TAG`` (the Cache Directory
Tagging Specification's file, which backup tools skip too), written on the
first write into a directory that is new, empty or holds only entries; a
directory that holds anything else and no tag is never written into, and
``entries``, ``size`` and ``clear`` refuse it (``NotACacheError``).  Only
folders named as entries are listed or removed, no symlink is followed (a
symlinked ``.tmp``, bucket or entry is removed itself, never what it points
to), and entry files are read with ``O_NOFOLLOW``.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import socket
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import attrs

from .._base.safefiles import read_inside, write_inside
from ..errors import Error
from ..errors import Warning as CtxreplayWarning

__all__ = ["MARKER", "CacheDir", "CacheWarning", "NotACacheError", "StoredEntry"]

RECORD, PROGRAM, READY = "record.json", "program.bin", "READY"

#: the file that marks a capture cache directory, and what it starts with
#: (the Cache Directory Tagging Specification's signature)
MARKER = "CACHEDIR.TAG"
_SIGNATURE = b"Signature: 8a477f597d28d172789f06886806bc55"
_TAG = _SIGNATURE + b"\n# This directory is a ctxreplay capture cache (ctxreplay cache clear " \
    b"empties it).\n# For information about cache directory tags see " \
    b"https://bford.info/cachedir/\n"
_HEX = frozenset("0123456789abcdef")

_warned_lock = threading.Lock()
_warned_readonly: set[str] = set()


class CacheWarning(CtxreplayWarning):
    """A capture cache entry was discarded, or the directory cannot be written."""


class NotACacheError(Error, ValueError):
    """A directory the capture cache did not make (no ``CACHEDIR.TAG`` it
    wrote): never listed or cleared."""


def _is_key(name: str) -> bool:
    return len(name) == 64 and set(name) <= _HEX


def _real_dir(path: Path) -> bool:
    """A directory itself, not a symlink to one."""
    return path.is_dir() and not path.is_symlink()


def _remove(path: Path) -> None:
    """``path`` removed: a symlink or file itself, a directory with what it
    holds (``shutil.rmtree`` follows no symlink inside it)."""
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


@attrs.frozen
class StoredEntry:
    """One entry as read back and checked: its record and program bytes."""

    key: str
    record: dict[str, Any]
    program: bytes
    path: Path


@attrs.define
class CacheDir:
    """A capture cache directory (created on first write)."""

    root: Path

    def entry_path(self, key: str) -> Path:
        return self.root / key[:2] / key

    def read(self, key: str) -> StoredEntry | None:
        """The entry for ``key``; ``None`` when there is none, or when it is
        damaged (then it is discarded, with a warning)."""
        path = self.entry_path(key)
        if not path.is_dir():
            return None
        try:
            if not _real_dir(path) or not _real_dir(path.parent):
                raise ValueError("a symlink, not a folder the cache wrote")
            entry = _read_entry(key, path)
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:  # damaged
            self.discard(key, f"unreadable ({_why(exc)})")
            return None
        return entry

    def write(self, key: str, record: dict[str, Any], program: bytes) -> bool:
        """Store an entry: ``False`` when the directory cannot be written
        (warned once) or another writer stored this key first."""
        body = json.dumps(record, sort_keys=True, allow_nan=False).encode()
        ready = json.dumps({"record": _sha(body), "program": _sha(program),
                            "program_bytes": len(program)}).encode()
        if not self._claim():
            return False
        try:
            tmp = self._tmp() / f"{key}.{socket.gethostname()}.{os.getpid()}." \
                                f"{secrets.token_hex(4)}"
        except OSError as exc:
            self._readonly(exc)
            return False
        try:
            tmp.mkdir()
            for name, data in ((PROGRAM, program), (RECORD, body), (READY, ready)):
                _write_synced(tmp / name, data)
            final = self.entry_path(key)
            if final.parent.is_symlink():  # planted: removed itself, made again
                final.parent.unlink()
            final.parent.mkdir(exist_ok=True)
        except OSError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            self._readonly(exc)
            return False
        try:
            os.rename(tmp, final)  # atomic; refused when ``final`` exists
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            return False
        return True

    def discard(self, key: str, why: str) -> None:
        """Warn that ``key``'s entry is ``why`` and remove it (renamed away
        first, so a concurrent reader never sees it half deleted)."""
        path = self.entry_path(key)
        warnings.warn(f"capture cache entry {key[:16]} in {self.root} is {why}: discarded, "
                      "the variant is captured again", CacheWarning, stacklevel=2)
        try:
            if path.is_symlink() or path.parent.is_symlink():
                (path if path.is_symlink() else path.parent).unlink()
                return
            trash = self._tmp() / f"discarded-{key}.{secrets.token_hex(4)}"
            os.rename(path, trash)
        except OSError:
            return  # read-only, or another process discarded it first
        _remove(trash)

    # -- the directory's own places -------------------------------------------
    def marked(self) -> bool:
        """Whether the directory holds the ``CACHEDIR.TAG`` the cache writes
        (a regular file, not a symlink, starting with the tag's signature)."""
        try:
            return read_inside(self.root, MARKER).startswith(_SIGNATURE)
        except (OSError, ValueError):
            return False

    def _claim(self) -> bool:
        """Whether entries may be written here, marking the directory first
        where it is new, empty or holds only entries; a directory holding
        other files and no tag is never written into (one warning)."""
        if self.marked():
            return True
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            foreign = self._foreign()
            if foreign is None:
                write_inside(self.root / MARKER, _TAG)
                return True
        except OSError as exc:
            self._readonly(exc)
            return False
        self._readonly(OSError(f"it holds {foreign!r} and no {MARKER}: not a directory the "
                               "capture cache made"))
        return False

    def _foreign(self) -> str | None:
        """The first name in the directory the cache never writes (anything
        but ``.tmp``, its tag and two-hex-digit buckets), or ``None``."""
        for p in self.root.iterdir():
            if not (p.name in (".tmp", MARKER) or (len(p.name) == 2 and set(p.name) <= _HEX)):
                return p.name
        return None

    def _tmp(self) -> Path:
        """``<root>/.tmp``, a folder of the cache's own (a symlink or file in
        its place is removed itself first)."""
        tmp = self.root / ".tmp"
        if tmp.is_symlink() or (tmp.exists() and not tmp.is_dir()):
            tmp.unlink()
        tmp.mkdir(exist_ok=True)
        return tmp

    def _require_marked(self, what: str) -> None:
        """Refuse a directory that holds no tag and something the cache never
        writes (a cache an older ctxreplay wrote, untagged, holds only entries)."""
        if self.marked() or not self.root.is_dir():
            return
        foreign = self._foreign()
        if foreign is not None:
            raise NotACacheError(
                f"cache {what}: {self.root} is not a ctxreplay capture cache: it holds "
                f"{foreign!r} and no {MARKER} the cache wrote; refusing to {what} it")

    def _readonly(self, exc: OSError) -> None:
        where = str(self.root.resolve())
        with _warned_lock:
            if where in _warned_readonly:
                return
            _warned_readonly.add(where)
        warnings.warn(f"capture cache {self.root} cannot be written ({_why(exc)}): its "
                      "entries are read, new captures are not stored", CacheWarning,
                      stacklevel=3)

    # -- the ``ctxreplay cache`` command --------------------------------------
    def entries(self) -> list[tuple[str, dict[str, Any] | None, int]]:
        """``(key, record or None when unreadable, bytes on disk)`` of every
        entry, oldest first: folders ``<key[:2]>/<key>`` (a key: 64 hex digits)
        that are no symlinks.  ``NotACacheError``: the directory is not marked."""
        self._require_marked("list")
        out = []
        for path in sorted(self._entry_dirs()):
            size = sum(f.lstat().st_size for f in path.iterdir())
            try:
                record = json.loads(read_inside(path, RECORD))
            except (OSError, ValueError, RecursionError):  # unreadable or not JSON
                record = None
            out.append((path.name, record if isinstance(record, dict) else None, size))
        out.sort(key=lambda e: (e[1] or {}).get("created", 0.0))
        return out

    def size(self) -> tuple[int, int]:
        """``(entries, bytes)``, partial writes in progress included in bytes
        (no symlink followed).  ``NotACacheError``: the directory is not marked."""
        entries = self.entries()
        total = 0
        for top, _dirs, files in os.walk(self.root):  # os.walk follows no symlinked folder
            total += sum(os.lstat(os.path.join(top, f)).st_size for f in files)
        return len(entries), total

    def clear(self) -> int:
        """Remove every entry (and abandoned partial writes); the number removed.
        ``NotACacheError``: the directory is not marked."""
        n = 0
        for key, _, _ in self.entries():
            trash = self._tmp() / f"cleared-{key}.{secrets.token_hex(4)}"
            os.rename(self.entry_path(key), trash)
            n += 1
        tmp = self._tmp()
        for stale in tmp.iterdir():  # a writer crashed, or the trash of the above
            if stale.name.startswith(("cleared-", "discarded-")) or stale.is_symlink() or \
                    time.time() - stale.lstat().st_mtime > 3600:
                _remove(stale)
        return n

    def _entry_dirs(self) -> list[Path]:
        """Every ``<key[:2]>/<key>`` folder, neither a symlink."""
        out: list[Path] = []
        if not _real_dir(self.root):
            return out
        for bucket in self.root.iterdir():
            if len(bucket.name) != 2 or not _real_dir(bucket):
                continue
            out += [p for p in bucket.iterdir()
                    if _is_key(p.name) and p.name[:2] == bucket.name and _real_dir(p)]
        return out


def _read_entry(key: str, path: Path) -> StoredEntry:
    ready = json.loads(read_inside(path, READY))
    body = read_inside(path, RECORD)
    program = read_inside(path, PROGRAM)
    if len(program) != ready["program_bytes"]:
        raise ValueError(f"program.bin holds {len(program)} of {ready['program_bytes']} bytes")
    if _sha(program) != ready["program"] or _sha(body) != ready["record"]:
        raise ValueError("its content does not match its READY checksums")
    record = json.loads(body)
    if not isinstance(record, dict) or record.get("key") != key:
        raise ValueError("its record names another key")
    return StoredEntry(key, record, program, path)


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _why(exc: BaseException) -> str:
    text = str(exc).splitlines()[0][:160] if str(exc) else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
