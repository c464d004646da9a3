"""Captures of one scope whose graphs turn out identical become one record.

Members whose identities differ (a plain attribute the forward never reads,
a name) are traced separately; when their graphs, lifted constants, inputs
and contexts agree and every one of them was verified, the captures are one
record listing every member it stands for.  Only ``torch.export`` programs
are compared: there the constants a graph holds are separate from the
weights, so equal code and equal constants mean the same computation for
any member's weights.  Other artifacts keep a record per identity.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..backends.passes import graph_code
from ..fidelity.verify import Fidelity, merge_mismatches
from ..specs.storage import same_data
from .results import Capture

__all__ = ["merge_identical"]


def _program_key(c: Capture) -> Any:
    if not c.artifact_loaded:  # a cached program stays on disk until it is used
        return None
    ep = c.artifact
    if not isinstance(ep, torch.export.ExportedProgram) or not c.fidelity.ok:
        return None
    try:
        # a folded graph's code does not show its sizes: its folding must agree
        return (c.scope, c.signature, c.folding, c.snapshot, c.binding, c.embedded,
                c.ambient_only, graph_code(ep.graph_module), str(ep.graph_signature))
    except Exception:  # a program whose code cannot be read is not merged
        return None


def _same_constants(a: Capture, b: Capture) -> bool:
    ca, cb = a.artifact.constants, b.artifact.constants
    if ca.keys() != cb.keys():
        return False
    for k, va in ca.items():
        vb = cb[k]
        if isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor):
            if not same_data(va, vb):  # a wrapper subclass compares its inner tensors
                return False
        elif va is not vb:  # script objects, generators: the same object only
            return False
    return True


def _merged(group: list[Capture]) -> Capture:
    first = group[0]
    if len(group) == 1:
        return first
    members = tuple(m for c in group for m in c.members)
    fid = Fidelity(first.fidelity.level, True,
                   merge_mismatches(m for c in group for m in c.fidelity.mismatches),
                   first.fidelity.checked, sum(c.fidelity.members for c in group),
                   by_value=sum(c.fidelity.by_value for c in group),
                   calls=sum(c.fidelity.calls for c in group),
                   not_retained=sum(c.fidelity.not_retained for c in group))
    return first.evolve(members=members,
                        member_calls=tuple(mc for c in group for mc in c.member_calls),
                        calls=sum(c.calls for c in group), fidelity=fid,
                        merged=tuple(c.variant for c in group[1:]),
                        folded=tuple(v for c in group for v in c.folded),
                        identities=tuple(i for c in group for i in c.identities),
                        seconds=sum(c.seconds for c in group))


def merge_identical(captures: Sequence[Capture]) -> tuple[Capture, ...]:
    """``captures`` with each set of identical exported programs of one scope
    replaced by one record (in the order of its first capture)."""
    groups: list[list[Capture]] = []
    by_key: dict[Any, list[list[Capture]]] = {}
    for c in captures:
        key = _program_key(c)
        if key is not None:
            for g in by_key.get(key, []):
                if _same_constants(g[0], c):
                    g.append(c)
                    break
            else:
                groups.append([c])
                by_key.setdefault(key, []).append(groups[-1])
            continue
        groups.append([c])
    return tuple(_merged(g) for g in groups)
