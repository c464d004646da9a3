"""What one capture is asked to do, and what every capture of a finalize shares.

``capture_variant(ask, tracing)`` is the one capture call: ``Tracing`` holds
what a whole finalize captures with (the live modules, the options, the
probes a neutral state is made of), ``Ask`` what one call of it captures --
a variant, and where a caller wraps the call (the capture cache, a fold) the
artifact it brings or the sizes it folds.  Wrappers build an ``Ask`` and
call ``capture_variant``; nothing is called back from inside it but the
fold's run at the other sizes, which needs the isolated view alive.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
from torch import nn

from ..backends import Backend
from ..core.probe import ContextProbe
from ..specs.signature import Spec
from .fold import Trial
from .options import CaptureOptions, VariantRequest
from .results import Capture
from .trace import Tick

__all__ = ["Ask", "Kin", "Source", "Tick", "Tracing"]

#: an artifact from elsewhere than a trace (the capture cache): given the
#: isolated view of the traced member and the binding (``"flattened"``: the
#: view sits under ``inner.``), ``(artifact, graph output spec, backend)``
Source = Callable[[nn.Module, str], tuple[Any, "Spec | None", Backend]]

@attrs.frozen(eq=False)
class Tracing:
    """What every capture of one finalize works with.

    ``modules`` maps member names to the live modules (never changed: every
    trace and run uses an isolated view).  ``neutral_probes``: probes whose
    neutral state a run starts from, beside the snapshot's own.
    ``defer_collectives``: a graph holding collectives is only checked at
    the signature level here (running it alone would wait for the other
    ranks); ``Capture.collective`` says so, and the distributed finalize
    runs it on every rank together."""

    modules: Mapping[str, nn.Module]
    options: CaptureOptions
    neutral_probes: tuple[ContextProbe[Any], ...] = ()
    defer_collectives: bool = False


@attrs.define(eq=False)
class Kin:
    """Variants a capture's graph may serve without a trace of their own:
    of its scope, context, training flags and signature, their members
    differing from the traced one's only in plain attributes -- each
    ``(request, the (submodule path, attribute) pairs that differ)``.  A
    variant is served when the trace never read one of those attributes
    (``capture.reads``: they cannot have shaped the graph) and the graph
    passes its own check against every member that ran it, with each
    member's own weights and attributes; ``served`` then holds its
    capture, by variant.  The others are left to a trace of their own;
    ``refused`` names those whose check the graph did not pass (no other
    graph of their kin is tried on them again)."""

    others: Sequence[tuple[VariantRequest, frozenset[tuple[str, str]]]]
    served: dict[int, Capture] = attrs.Factory(dict)
    refused: set[int] = attrs.Factory(set)


@attrs.frozen(eq=False)
class Ask:
    """One capture asked for: ``request``'s variant, traced -- or, given a
    ``source``, taken from it and checked exactly as a traced artifact is.
    ``fold``: trace with the trial's dimensions dynamic and run the graph at
    its other variants' sizes (the backend must fold).  ``kin``: other
    variants the graph may serve (fills ``kin.served``).  ``tick``: told as
    each member's check starts."""

    request: VariantRequest
    source: Source | None = None
    fold: Trial | None = None
    kin: Kin | None = None
    tick: Tick | None = None
