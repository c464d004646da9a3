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

from ..errors import Warning as CtxreplayWarning

__all__ = ["CacheDir", "CacheWarning", "StoredEntry"]

RECORD, PROGRAM, READY = "record.json", "program.bin", "READY"

_warned_lock = threading.Lock()
_warned_readonly: set[str] = set()


class CacheWarning(CtxreplayWarning):
    """A capture cache entry was discarded, or the directory cannot be written."""


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
            entry = _read_entry(key, path)
        except Exception as exc:
            self.discard(key, f"unreadable ({_why(exc)})")
            return None
        return entry

    def write(self, key: str, record: dict[str, Any], program: bytes) -> bool:
        """Store an entry: ``False`` when the directory cannot be written
        (warned once) or another writer stored this key first."""
        body = json.dumps(record, sort_keys=True, allow_nan=False).encode()
        ready = json.dumps({"record": _sha(body), "program": _sha(program),
                            "program_bytes": len(program)}).encode()
        tmp = self.root / ".tmp" / f"{key}.{socket.gethostname()}.{os.getpid()}." \
                                   f"{secrets.token_hex(4)}"
        try:
            tmp.mkdir(parents=True)
            for name, data in ((PROGRAM, program), (RECORD, body), (READY, ready)):
                _write_synced(tmp / name, data)
            final = self.entry_path(key)
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
        trash = self.root / ".tmp" / f"discarded-{key}.{secrets.token_hex(4)}"
        try:
            trash.parent.mkdir(parents=True, exist_ok=True)
            os.rename(path, trash)
        except OSError:
            return  # read-only, or another process discarded it first
        shutil.rmtree(trash, ignore_errors=True)

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
        entry, oldest first."""
        out = []
        for path in sorted(self.root.glob("??/*")):
            if not path.is_dir():
                continue
            size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
            try:
                record = json.loads((path / RECORD).read_bytes())
            except Exception:
                record = None
            out.append((path.name, record if isinstance(record, dict) else None, size))
        out.sort(key=lambda e: (e[1] or {}).get("created", 0.0))
        return out

    def size(self) -> tuple[int, int]:
        """``(entries, bytes)``, partial writes in progress included in bytes."""
        files = [f for f in self.root.rglob("*") if f.is_file()] if self.root.is_dir() else []
        return len(self.entries()), sum(f.stat().st_size for f in files)

    def clear(self) -> int:
        """Remove every entry (and abandoned partial writes); the number removed."""
        n = 0
        for key, _, _ in self.entries():
            trash = self.root / ".tmp" / f"cleared-{key}.{secrets.token_hex(4)}"
            trash.parent.mkdir(parents=True, exist_ok=True)
            os.rename(self.entry_path(key), trash)
            n += 1
        tmp = self.root / ".tmp"
        if tmp.is_dir():
            for stale in tmp.iterdir():  # a writer crashed, or the trash of the above
                if stale.name.startswith(("cleared-", "discarded-")) or \
                        time.time() - stale.stat().st_mtime > 3600:
                    shutil.rmtree(stale, ignore_errors=True)
        return n


def _read_entry(key: str, path: Path) -> StoredEntry:
    ready = json.loads((path / READY).read_bytes())
    body = (path / RECORD).read_bytes()
    program = (path / PROGRAM).read_bytes()
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
