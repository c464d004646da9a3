"""Answering a capture from the capture cache, and filling it.

``CaptureCache.capture(ask, tracing)`` wraps the one capture call
(``capture_variant``): it looks the ask's key up, and on a hit the stored
program is checked at the session's verify level before it is used -- at
``"signature"`` (and ``"off"``) against the record's graph output metadata,
its program left on disk until ``Capture.artifact`` is first read; at the
levels that run the artifact, loaded with the member's own weights and
checked exactly as a traced artifact is.  A hit that fails its check is
discarded with a warning and the variant is traced again; a traced capture
that passed its check is stored.  A fold (``Ask.fold``) is answered the same
way, its entry also holding the graph's size rules (``cache.folds``).  The
cache never makes a report worse than none would.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Protocol

import attrs

from ..capture.asking import Ask, Tracing
from ..capture.results import Capture
from ..capture.variant import capture_variant
from ..fidelity.levels import checked_by
from .entries import (
    NOT_STORED_REASONS,
    EntryRead,
    deferred_capture,
    fill_record,
    read_entry,
    run_entry,
)
from .folds import FoldEntry
from .keys import cache_key
from .store import CacheDir, CacheWarning, StoredEntry

__all__ = ["NOT_STORED_REASONS", "CaptureCache"]


class _Kind(Protocol):
    """What an entry of one kind (a plain capture, a fold) adds to the flow."""

    noun: str

    def key(self, example_key: str) -> str: ...
    def read(self, entry: StoredEntry) -> None: ...
    def deferred(self, read: EntryRead, tracing: Tracing) -> None: ...
    def agreed(self) -> bool: ...
    def reset(self) -> None: ...
    def record(self) -> dict[str, Any]: ...


class _Plain:
    """A plain capture's entry: the program and its record, nothing more."""

    noun = "a program"

    def key(self, example_key: str) -> str:
        return example_key

    def read(self, entry: StoredEntry) -> None:
        pass

    def deferred(self, read: EntryRead, tracing: Tracing) -> None:
        pass

    def agreed(self) -> bool:
        return True

    def reset(self) -> None:
        pass

    def record(self) -> dict[str, Any]:
        return {}


@attrs.define(eq=False)
class CaptureCache:
    """One finalize's use of a cache directory."""

    store: CacheDir

    @classmethod
    def at(cls, path: str | Path) -> CaptureCache:
        return cls(CacheDir(Path(path)))

    def capture(self, ask: Ask, tracing: Tracing) -> Capture:
        """``ask``'s capture: from the cache where an entry passes its check,
        else ``capture_variant`` (a trace), stored when it passed its own."""
        kind: _Kind = _Plain() if ask.fold is None else FoldEntry(ask.fold)
        key = self._key(ask, tracing, kind)
        if key is None:
            return capture_variant(ask, tracing)
        entry = self.store.read(key)
        if entry is not None:
            hit = self._use(entry, ask, tracing, kind)
            if hit is not None:
                return hit
            kind.reset()
        return self._fill(key, capture_variant(ask, tracing), ask, tracing, kind)

    def _key(self, ask: Ask, tracing: Tracing, kind: _Kind) -> str | None:
        """The entry's key (``None``: what cannot be keyed is captured, never guessed)."""
        module = tracing.modules.get(ask.request.traced.name)
        if module is None:
            return None
        try:
            keyed = cache_key(ask.request, module, tracing.options)
            return None if keyed is None else kind.key(keyed[0])
        except Exception:  # keying reads user objects: not keyed
            return None

    def _use(self, entry: StoredEntry, ask: Ask, tracing: Tracing,
             kind: _Kind) -> Capture | None:
        """The capture ``entry`` holds, checked; ``None`` (the entry
        discarded) where it cannot be read or does not pass."""
        read = read_entry(self.store, entry, ask.request)
        if read is None:
            return None
        try:
            kind.read(entry)
        except Exception as exc:  # a kind's reader may raise anything: discarded
            self.store.discard(entry.key, f"unreadable ({type(exc).__name__})")
            return None
        verify = tracing.options.verify
        capture: Capture | None
        if set(checked_by(verify)) <= {"signature"}:
            capture = deferred_capture(read, ask.request, tracing)
            kind.deferred(read, tracing)
        else:
            capture = run_entry(self.store, read, ask, tracing)
            if capture is None:
                return None
        if not capture.fidelity.ok or not kind.agreed():
            self.store.discard(entry.key, f"{kind.noun} that does not reproduce the live "
                               f"calls at verify={verify!r}")
            return None
        return capture

    def _fill(self, key: str, capture: Capture, ask: Ask, tracing: Tracing,
              kind: _Kind) -> Capture:
        """Store ``capture`` when it passed its check (``fill_record``); returns
        it, with why it was not stored where it could not be."""
        if not capture.fidelity.ok or not kind.agreed():
            return capture
        try:
            extra = kind.record()
        except Exception as exc:  # what cannot be written back faithfully is not kept
            return self.kept(capture, ("not_serialisable", "its size rules cannot be "
                                                           f"written: {type(exc).__name__}"))
        return self.kept(capture, fill_record(self.store, key, capture, ask.request, tracing,
                                              extra))

    def kept(self, capture: Capture, refused: tuple[str, str] | None) -> Capture:
        """``capture``, told why the cache could not keep it (``refused``: a code
        of ``NOT_STORED_REASONS`` and the cause in words), and the user too:
        once, a ``CacheWarning`` naming the capture and the cause."""
        if refused is None:
            return capture
        code, why = refused
        if why:
            warnings.warn(f"capture cache {self.store.root}: {capture.scope}#{capture.variant} "
                          f"is not stored: {why}; later runs trace it again", CacheWarning,
                          stacklevel=2)
        return capture.evolve(not_cached=code)
