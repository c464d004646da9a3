"""The parts of a capture's record that only some captures have: where it ran
in a distributed finalize, what the capture cache did with it, and the sizes
it was folded over (``Capture.distributed``, ``Capture.caching``,
``Capture.fold``; ``Capture`` also reads each field under its own name).
"""

from __future__ import annotations

import attrs

from ..specs.dims import Folding

__all__ = ["CacheDetails", "DistributedDetails", "FoldDetails"]


@attrs.frozen(eq=False)
class DistributedDetails:
    """A capture's ranks in a distributed finalize (all empty in a single
    process)."""

    rank: int | None = None
    """In a distributed finalize: the rank that captured it (and holds the
    artifact); ``None`` in a single process."""
    observed_on: tuple[int, ...] = ()
    """In a distributed finalize: the ranks that observed it."""
    rank_calls: tuple[tuple[int, int], ...] = ()
    """In a distributed finalize: ``(rank, calls)`` for each observing rank."""
    collective: bool = False
    """Its graph holds collectives: executing it waits for the other ranks."""
    shared: tuple[str, bytes] | None = attrs.field(default=None, repr=False)
    """On a rank that did not capture it (``artifact`` is ``None``): its
    program's graph without weights, as the capturing rank sent it --
    ``(format name, bytes)`` as ``ArtifactFormat.program_bytes`` wrote them,
    which ``install`` rebuilds with each member's own weights; ``None``
    where the program could not be sent (not a ``torch.export`` program) or
    this rank holds the artifact itself.  Never in JSON."""


@attrs.frozen
class CacheDetails:
    """What the capture cache (``capture_with(..., cache=...)``) did with a
    capture."""

    from_cache: bool = False
    """It came from the capture cache: loaded instead of traced, and checked
    at the session's verify level."""
    not_cached: str = ""
    """Why the capture cache could not keep it, a code of
    ``cache.use.NOT_STORED_REASONS`` (its program could not be serialised:
    ``not_serialisable``), warned once as a ``CacheWarning``; ``""``: kept,
    or no cache."""


@attrs.frozen
class FoldDetails:
    """The size variants a capture's graph was folded over."""

    folding: Folding | None = None
    """For a graph traced with dynamic sizes (size variants folded into one
    capture): its dynamic dimensions, the rule each follows and the range
    every symbol was verified over; ``None`` for a graph of fixed sizes."""
    folded: tuple[int, ...] = ()
    """Variants of the same member identity and context that differ from
    this one in sizes only, folded into this capture (verified by value at
    each of their sizes)."""
