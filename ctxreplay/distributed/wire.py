"""Captures on the wire between ranks: everything but the artifact (which
stays with the rank that made it) -- its program's graph without weights
goes along, so that every rank can dispatch every capture with its own
members' weights -- and the snapshot as names and states so the receiving
rank pairs them with its own probe instances."""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from typing import Any

import attrs

from ..artifacts.formats import format_for
from ..artifacts.saving import collector_paused
from ..capture.results import Capture
from ..core.probe import ContextProbe
from ..core.snapshots import ContextSnapshot
from ..specs.signature import CallSpec, ConstSpec

__all__ = ["from_wire", "portable", "shared_program", "to_wire"]


def to_wire(c: Capture) -> dict[str, Any]:
    """A capture without its artifact, but with its program's graph
    (``shared``: no weights, which every rank has); its snapshot as names
    and states."""
    fields = {f.alias or f.name: getattr(c, f.name) for f in attrs.fields(Capture)}
    fields["artifact"] = None
    fields["distributed"] = attrs.evolve(
        c.distributed, shared=c.shared if c.artifact is None else shared_program(c.artifact))
    snap = fields.pop("snapshot")
    fields["snapshot_names"], fields["snapshot_states"] = snap.names, snap.states
    return fields


def shared_program(artifact: Any) -> tuple[str, bytes] | None:
    """``(format name, artifact without its weights)`` for the other ranks to
    rebuild with their own members' weights (``dispatch.programs``), or
    ``None`` where no format can leave the weights out (a Dynamo graph
    module) or the serialiser refused it: that capture then dispatches
    only on the rank that made it.  The graph only: a few kB for a
    transformer block, whose weights are the larger part."""
    if artifact is None:
        return None
    fmt, _why = format_for(artifact)
    if fmt is None:
        return None
    try:
        with collector_paused():
            data = fmt.program_bytes(artifact)
    except Exception:  # torch's serialiser may raise anything: not sent
        return None
    return None if data is None else (fmt.name, data)


def from_wire(doc: dict[str, Any], probes: Mapping[str, ContextProbe[Any]]) -> Capture:
    doc = dict(doc)
    names = doc.pop("snapshot_names")
    states = doc.pop("snapshot_states")
    snap = ContextSnapshot(names, states, tuple(probes[n] for n in names))
    return Capture(snapshot=snap, **doc)


def portable(obj: Any) -> Any:
    """``obj`` if it pickles; a signature whose constants do not is sent with
    those constants as their type names."""
    try:
        pickle.dumps(obj)
        return obj
    except Exception:  # pickling user objects may raise anything
        pass
    if isinstance(obj, dict) and "signature" in obj:
        out = dict(obj)
        out["signature"] = _strip(obj["signature"])
        out["outputs"] = None if obj.get("outputs") is None else _strip_spec(obj["outputs"])
        return out
    return obj


def _strip(call: CallSpec) -> CallSpec:
    return CallSpec(tuple(_strip_spec(a) for a in call.args),
                    tuple((k, _strip_spec(v)) for k, v in call.kwargs))


def _strip_spec(spec: Any) -> Any:
    if isinstance(spec, ConstSpec):
        try:
            pickle.dumps(spec)
            return spec
        except Exception:  # pickling user objects may raise anything
            return ConstSpec(None, spec.type_name, (spec.type_name, repr(spec.key)[:64]))
    kids = getattr(spec, "items", None) if hasattr(spec, "kind") else None
    if kids is not None:
        return attrs.evolve(spec, items=tuple(_strip_spec(s) for s in kids))
    for name in ("values", "children"):
        if hasattr(spec, name):
            return attrs.evolve(spec, **{name: tuple(_strip_spec(s)
                                                      for s in getattr(spec, name))})
    return spec


