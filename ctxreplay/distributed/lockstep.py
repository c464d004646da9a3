"""Running graphs that hold collectives on every rank at once.

A graph that calls ``all_reduce`` can only run when every rank of its group
runs it too.  So after the captures, for each such capture in report order,
the rank that made it sends the program (``torch.export.save`` bytes), and
every rank runs it -- with its own copy of the block it stands for, or the
program's own weights where it has none -- and then the block itself on the
same inputs, issuing the same collectives in the same order; their findings
are merged into the capture's fidelity.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch
from torch import nn

from ..artifacts.formats import artifact_bytes, artifact_from_bytes
from ..capture.isolate import isolated
from ..capture.mutation import MutationLog, mutation_mismatches
from ..capture.results import Capture
from ..capture.rngguard import rng_guard
from ..core.probe import ContextProbe
from ..fidelity.levels import checked_by
from ..fidelity.verify import Fidelity, Mismatch, compare_values, merge_mismatches, neutral_replay
from ..specs.materialize import bind_call, inputs_for, materialize_leaves
from ..specs.signature import tensor_values
from ..specs.storage import member_tensors

__all__ = ["run_collective_checks"]


class LockstepGroup(Protocol):
    """What running together needs of the group (``exchange.RankGroup`` is one)."""

    rank: int

    def broadcast(self, obj: Any, src: int) -> Any: ...

    def gather(self, obj: Any) -> list[Any]: ...


def run_collective_checks(coll: LockstepGroup, captures: list[Capture],
                          local: Mapping[str, Capture], modules: Mapping[str, nn.Module],
                          neutral_probes: tuple[ContextProbe[Any], ...], level: str
                          ) -> dict[tuple[str, int], Fidelity]:
    """For every capture whose graph holds collectives (in report order), run
    it on every rank at once: the owner sends the program, each rank runs it
    with its own copy of the member (or the program's weights where it has
    none) and then the member itself, and the ranks' findings are merged."""
    out: dict[tuple[str, int], Fidelity] = {}
    for c in captures:
        if not c.collective or c.rank is None:
            continue
        mine = local.get(f"{c.scope}#{c.variant}")
        payload = None
        if coll.rank == c.rank and mine is not None:
            try:
                payload = artifact_bytes(mine.artifact)
            except Exception:  # torch's serialiser may raise anything: not sent
                payload = None
        payload = coll.broadcast(payload, c.rank)
        found = _run_here(c, payload, modules, neutral_probes)
        every = coll.gather(found)
        merged = merge_mismatches(m for ms in every for m in ms)
        checked = checked_by(level)
        base = c.fidelity.mismatches
        out[(c.scope, c.variant)] = Fidelity(level, not (merged or base),
                                             merge_mismatches((*base, *merged)), checked,
                                             c.fidelity.members,
                                             by_value=c.fidelity.by_value,
                                             calls=c.fidelity.calls,
                                             not_retained=c.fidelity.not_retained)
    return out


def _run_here(c: Capture, payload: bytes | None, modules: Mapping[str, nn.Module],
              neutral_probes: tuple[ContextProbe[Any], ...]) -> list[Mismatch]:
    if payload is None:
        return [Mismatch("out", "execution", "ran on every rank", "program not sent",
                         "execute")]
    program = artifact_from_bytes(payload)
    name = next((m for m in (c.weights_from, *c.members) if m in modules), None)
    leaves = materialize_leaves(c.signature)
    runs: list[Any] = []
    watch = MutationLog()
    try:
        gm = program.module()
        if name is not None:
            with isolated(modules[name]) as view:
                # this rank's own tensors, under the names the program gives
                # them: a program re-traced through DTensor parameters takes
                # each one's local shard (``member_tensors``)
                state = member_tensors(view, "inner." if c.binding == "flattened" else "")
                sig = program.graph_signature
                missing = [k for k in (*sig.parameters, *sig.buffers) if k not in state]
                gm.load_state_dict(state, strict=False, assign=True)
                if missing:  # it would run with the capturing rank's tensors
                    raise _Unbound(f"{name} has no tensor {missing[0]!r} the program takes")
                runs.append(_call(gm, c, leaves, neutral_probes, full=False))
                runs.append(_eager(view, c, leaves, neutral_probes, watch))
        else:  # the same collectives, in the same order, as the other ranks
            runs.append(_call(gm, c, leaves, neutral_probes, full=False))
            runs.append(_call(gm, c, leaves, neutral_probes, full=False))
    except _Unbound as exc:
        return [Mismatch("out", "execution", "member weights", f"not bound: {exc}", "execute")]
    except Exception as exc:  # the program may raise anything: a mismatch
        return [Mismatch("out", "execution", "ran", type(exc).__name__, "execute")]
    if name is None:
        return []
    return [*compare_values(runs[1], runs[0], "execute",
                            member=None if len(c.members) == 1 else name),
            *mutation_mismatches(watch.found)]


class _Unbound(Exception):
    """The program names a tensor this rank's member does not have."""


def _call(gm: Callable[..., Any], c: Capture, leaves: tuple[torch.Tensor, ...],
          neutral_probes: tuple[ContextProbe[Any], ...], *, full: bool) -> Any:
    args, kwargs = inputs_for(c.signature, c.binding,
                              leaves=tuple(t.clone() for t in leaves))
    # the random state, the generators it reaches and the live weights it
    # writes in place are put back, as in a check on one rank
    with rng_guard(weights=gm), neutral_replay(c.snapshot, neutral_probes, full=full):
        return gm(*args, **kwargs)


def _eager(view: nn.Module, c: Capture, leaves: tuple[torch.Tensor, ...],
           neutral_probes: tuple[ContextProbe[Any], ...], watch: MutationLog) -> Any:
    it = iter(tuple(t.clone() for t in leaves))
    args, kwargs = bind_call(c.signature, lambda _s: next(it))
    try:
        replay = neutral_replay(c.snapshot, neutral_probes, full=True)
        replay.__enter__()
    except Exception:  # a live state this rank never held: its neutral state
        replay = neutral_replay(c.snapshot, neutral_probes)
        replay.__enter__()
    try:
        # forward alone, as the live call was observed: the member's own
        # hooks ran around the observation wrapper, not inside the graph;
        # what it changes in its arguments is what no graph op does
        with rng_guard(weights=view):
            out = watch.call(view.forward, args, kwargs)
    finally:
        replay.__exit__(None, None, None)
    return tuple(tensor_values(out)) if c.binding == "flattened" else out


