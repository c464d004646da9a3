"""What ``finalize()`` needs of the other ranks: the exchange.

``finalize()`` runs one pipeline (``ctxreplay.engine.pipeline``) over an
``Exchange``: ``Alone`` for a single process -- the one-rank case, where
nothing crosses a wire -- or ``RankGroup`` over a ``torch.distributed``
group, where every rank observed its own calls and the ranks

1. *join*: each writes an arrival key to the group's store and waits, with a
   deadline, for the others' -- a rank that never comes is named, never
   waited on forever;
2. *agree* on the probes (names, in order) -- a different set is an error
   naming the ranks;
3. *exchange* a portable key per observed variant (structure, member
   identity, input signature, snapshot; device indices left out) with its
   per-rank calls, metadata only, through ``all_gather_object``;
4. *assign* each distinct variant to one rank that observed it, balanced
   (fewest assigned so far, lowest rank on a tie) -- the same plan on every
   rank, made from the same gathered lists;
5. *share* what each captured (captures without their artifacts, failures,
   problems, counts), so every rank builds the same merged report;
6. run each graph that holds collectives *together* (``lockstep``).

Where members hold FSDP2 parameters, step 5's captures are made *in turns*
(``turns``): gathering them is an all-gather every rank must join.

Only ``torch.distributed`` carries anything (its store and object
collectives on the session's group); no ctxreplay transport exists.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import attrs
import torch
import torch.distributed as dist
from torch import nn

from .._base.environment import ACCELERATORS
from ..capture.options import CaptureOptions, VariantRequest
from ..capture.results import Capture, CaptureFailure
from ..capture.sharded import holds_fsdp
from ..core.probe import ContextProbe
from ..core.snapshots import ContextSnapshot
from ..fidelity.levels import level
from ..observation.targets import ADDRESS
from ..report.ranks import (
    Alone,
    DistributedError,
    Exchange,
    Observed,
    Plan,
    RankResults,
    active_group,
)
from ..specs.signature import CallSpec, ConstSpec, Spec
from ..specs.specjson import call_to_json
from .lockstep import run_collective_checks
from .turns import in_turns
from .wire import from_wire, portable, to_wire

__all__ = ["Alone", "RankGroup", "DistributedError", "Exchange", "Observed", "Plan",
           "RankResults", "active_group", "rank_variant_key"]

_sequence: dict[tuple[int, ...], itertools.count[int]] = {}
# a device index differs between ranks for the same call (cuda:0 on rank 0, cuda:1 on rank 1)
_DEVICE_INDEX = re.compile(rf"\b({'|'.join(ACCELERATORS)}):\d+\b")
_POLL = 0.02
T = TypeVar("T")


def _digest(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, default=repr)
    text = ADDRESS.sub("", _DEVICE_INDEX.sub(r"\1", text))
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _const_keys(call: CallSpec) -> list[str]:
    """Equality keys of a call's constants as digests (strings stay out)."""
    from ..specs.signature import children

    out: list[str] = []

    def walk(spec: Spec) -> None:
        if isinstance(spec, ConstSpec):
            out.append(hashlib.sha256(repr(spec.key).encode()).hexdigest()[:16])
            return
        for _, child in children(spec) or ():
            walk(child)

    for _, spec in call.items():
        walk(spec)
    return out


def _snapshot_key(snap: ContextSnapshot) -> Any:
    doc = snap.to_json()
    # a live-only state (a forward context) is compared by its probe key
    live = {n: repr(getattr(s, "key", s)) for n, p, s in zip(snap.names, snap.probes,
                                                            snap.states) if not p.portable}
    return {"portable": doc, "live": live}


def rank_variant_key(request: VariantRequest, identity: Any) -> str:
    """The same on every rank for the same call: scope, member identity,
    signature and context, without device indices or addresses."""
    return _digest({"scope": request.scope, "identity": ADDRESS.sub("", repr(identity)),
                    "inputs": call_to_json(request.inputs),
                    "constants": _const_keys(request.inputs),
                    "snapshot": _snapshot_key(request.snapshot)})


def make_plan(gathered: Sequence[Sequence[Observed]]) -> Plan:
    by_key: dict[str, list[tuple[int, Observed]]] = {}
    for rank, items in enumerate(gathered):
        for o in items:
            by_key.setdefault(o.key, []).append((rank, o))
    load = [0] * len(gathered)
    owner, observed_on, rank_calls, members, variant, scopes = {}, {}, {}, {}, {}, {}
    per_scope: dict[str, int] = {}
    # numbered in the order the ranks first saw them, so a one-rank job reads
    # like a single process
    order = sorted(by_key, key=lambda k: (by_key[k][0][1].scope,
                                          min(o.index for _, o in by_key[k]), k))
    # the most constrained first: a variant only one rank saw goes to it, and
    # the shared ones then fill the ranks with the fewest
    for key in sorted(order, key=lambda k: len(by_key[k])):
        ranks = tuple(r for r, _ in by_key[key])
        chosen = min(ranks, key=lambda r: (load[r], r))
        load[chosen] += 1
        owner[key] = chosen
    for key in order:
        seen = by_key[key]
        ranks = tuple(r for r, _ in seen)
        observed_on[key] = ranks
        rank_calls[key] = tuple((r, o.calls) for r, o in seen)
        calls: dict[str, int] = {}
        for _, o in seen:
            for name, n in o.members:
                calls[name] = calls.get(name, 0) + n
        members[key] = tuple(calls.items())
        scope = seen[0][1].scope
        scopes[key] = scope
        variant[key] = per_scope.get(scope, 0)
        per_scope[scope] = variant[key] + 1
    return Plan(owner, observed_on, rank_calls, members, variant, scopes)


class RankGroup:
    """The group, this rank's place in it, and the collectives finalize uses."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.ranks = tuple(dist.get_process_group_ranks(group))
        self.rank = self.ranks.index(dist.get_rank())
        self.size = len(self.ranks)
        counter = _sequence.setdefault(self.ranks, itertools.count())
        self.prefix = f"ctxreplay/finalize/{'-'.join(map(str, self.ranks))}/{next(counter)}"

    # -- joining ------------------------------------------------------------
    def join(self, timeout: float) -> None:
        """Wait, at most ``timeout`` seconds, until every rank of the group
        is in ``finalize()``; name the ranks that are not."""
        # Any: the stubs of torch 2.7 give Store no check()
        store: Any = dist.distributed_c10d._get_default_store()
        store.set(f"{self.prefix}/arrived/{self.rank}", "1")
        keys = [f"{self.prefix}/arrived/{r}" for r in range(self.size)]
        deadline = time.monotonic() + timeout
        while not store.check(keys):
            if time.monotonic() > deadline:
                missing = [self.ranks[r] for r, k in enumerate(keys) if not store.check([k])]
                raise DistributedError(
                    f"ctxreplay finalize(): rank(s) {missing} of the group did not reach "
                    f"finalize() within {timeout:g} s; every rank that observed must call "
                    "it (or pass a group without them)", missing)
            time.sleep(_POLL)

    def gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast(self, obj: Any, src: int) -> Any:
        box = [obj if self.rank == src else None]
        dist.broadcast_object_list(box, src=self.ranks[src], group=self.group)
        return box[0]

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def agree_on_probes(self, names: tuple[str, ...]) -> None:
        every = self.gather(names)
        if any(n != every[0] for n in every):
            groups: dict[tuple[str, ...], list[int]] = {}
            for r, n in enumerate(every):
                groups.setdefault(n, []).append(self.ranks[r])
            detail = "; ".join(f"rank(s) {rs}: {list(n)}" for n, rs in groups.items())
            raise DistributedError(f"ctxreplay finalize(): ranks observed different probe "
                                   f"sets ({detail}); pass the same probes= on every rank",
                                   [r for rs in list(groups.values())[1:] for r in rs])

    # -- the exchange finalize runs over ------------------------------------
    def open(self, options: CaptureOptions) -> None:
        self.join(options.capture_timeout or group_timeout(self.group))
        self.agree_on_probes(options.probe_names)

    def key(self, request: VariantRequest, identity: Any) -> str:
        return rank_variant_key(request, identity)

    def plan(self, observed: list[Observed]) -> Plan:
        return make_plan(self.gather(observed))

    def relabel(self, result: Capture | CaptureFailure, key: str, plan: Plan,
                folded: Sequence[str] = ()) -> Capture | CaptureFailure:
        variant = plan.variant[key]
        if isinstance(result, CaptureFailure):
            return attrs.evolve(result, variant=variant)
        calls: dict[str, int] = {}
        per_rank: dict[int, int] = {}
        for k in (key, *folded):  # a fold's calls are those of every variant it takes
            for name, n in plan.members[k]:
                calls[name] = calls.get(name, 0) + n
            for r, n in plan.rank_calls[k]:
                per_rank[r] = per_rank.get(r, 0) + n
        members = tuple(calls.items())
        return result.evolve(
            variant=variant, rank=self.ranks[self.rank],
            folded=tuple(plan.variant[k] for k in folded),
            observed_on=tuple(self.ranks[r] for r in sorted(per_rank)),
            rank_calls=tuple((self.ranks[r], n) for r, n in sorted(per_rank.items())),
            members=tuple(n for n, _ in members), member_calls=members,
            calls=sum(n for _, n in members))

    def share(self, mine: RankResults, options: CaptureOptions) -> list[RankResults]:
        """Captures cross the wire without their artifacts (they stay with the
        rank that made them); each rank's problems name it."""
        own = {f"{c.scope}#{c.variant}": c for c in mine.captures}
        docs = self.gather({"results": attrs.evolve(mine, captures=()),
                            "captures": [portable(to_wire(c)) for c in mine.captures]})
        probes = {p.name: p for p in options.probes}
        every = []
        for r, doc in enumerate(docs):
            wired = [own.get(f"{w['scope']}#{w['variant']}") or from_wire(w, probes)
                     for w in doc["captures"]]
            results: RankResults = doc["results"]
            every.append(attrs.evolve(
                results, captures=tuple(wired),
                problems=tuple(attrs.evolve(p, rank=self.ranks[r]) for p in results.problems)))
        return every

    def check_collectives(self, captures: list[Capture], mine: Mapping[str, Capture],
                          modules: Mapping[str, nn.Module],
                          neutral_probes: tuple[ContextProbe[Any], ...],
                          verify: str) -> list[Capture]:
        if not level(verify).executes:
            return captures
        checked = run_collective_checks(self, captures, mine, modules, neutral_probes, verify)
        return [attrs.evolve(c, fidelity=checked[(c.scope, c.variant)])
                if (c.scope, c.variant) in checked else c for c in captures]

    def captures_in_turns(self, work: Callable[[], T], modules: Mapping[str, nn.Module],
                          root: nn.Module) -> T:
        """``work()`` (this rank's captures), the ranks taking turns where
        any rank's members hold FSDP parameters (``turns``)."""
        if not any(self.gather(holds_fsdp(modules.values()))):
            return work()
        return in_turns(self, work, root)

    def info(self, plan: Plan, every: list[RankResults]) -> dict[str, Any] | None:
        return {"world_size": dist.get_world_size(), "group_ranks": list(self.ranks),
                "backend": str(dist.get_backend(self.group)),
                "rank_seconds": [round(r.seconds, 6) for r in every],
                "assigned": [sum(1 for o in plan.owner.values() if o == r)
                             for r in range(self.size)]}


def group_timeout(group: Any, fallback: float = 1800.0) -> float:
    """The group's own collective timeout in seconds (``fallback`` when torch
    does not say)."""
    for device in ("cpu", "cuda"):
        try:
            return float(group._get_backend(torch.device(device)).options._timeout
                         .total_seconds())
        except Exception:  # torch's private API may fail: the fallback
            continue
    return fallback
