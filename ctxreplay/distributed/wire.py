"""Captures on the wire between ranks: everything but the artifact (which
stays with the rank that made it), the snapshot as names and states so the
receiving rank pairs them with its own probe instances."""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from typing import Any

import attrs

from ..capture.results import Capture
from ..core.probe import ContextProbe
from ..core.snapshots import ContextSnapshot
from ..specs.signature import CallSpec, ConstSpec

__all__ = ["from_wire", "portable", "to_wire"]


def to_wire(c: Capture) -> dict[str, Any]:
    """A capture without its artifact; its snapshot as names and states."""
    fields = {f.alias or f.name: getattr(c, f.name) for f in attrs.fields(Capture)}
    fields["artifact"] = None
    snap = fields.pop("snapshot")
    fields["snapshot_names"], fields["snapshot_states"] = snap.names, snap.states
    return fields


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
    except Exception:
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
        except Exception:
            return ConstSpec(None, spec.type_name, (spec.type_name, repr(spec.key)[:64]))
    kids = getattr(spec, "items", None) if hasattr(spec, "kind") else None
    if kids is not None:
        return attrs.evolve(spec, items=tuple(_strip_spec(s) for s in kids))
    for name in ("values", "children"):
        if hasattr(spec, name):
            return attrs.evolve(spec, **{name: tuple(_strip_spec(s)
                                                      for s in getattr(spec, name))})
    return spec


