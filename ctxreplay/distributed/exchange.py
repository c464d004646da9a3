"""``finalize()`` as a collective over a ``torch.distributed`` group.

Every rank observed its own calls.  At finalize the ranks

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
5. *capture* their own assignments, and *exchange* the results (captures
   without their artifacts, failures, problems), so every rank builds the
   same merged report;
6. run each graph that holds collectives *together*: the owner sends the
   program (``torch.export.save`` bytes), every rank runs it and the block it
   stands for in the same order, and their verdicts are merged.

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
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch import nn

from ..capture.options import VariantRequest
from ..capture.results import Capture, CaptureFailure, Problem
from ..core.probe import ContextProbe
from ..core.snapshots import ContextSnapshot
from ..errors import Error
from ..observation.targets import ADDRESS
from ..specs.signature import CallSpec, ConstSpec, Spec
from ..specs.specjson import call_to_json
from .lockstep import run_collective_checks
from .wire import from_wire, portable, to_wire

__all__ = ["Collective", "DistributedError", "active_group"]

_sequence: dict[tuple[int, ...], itertools.count[int]] = {}
_DEVICE_INDEX = re.compile(r"\b(cuda|xpu|mps|hpu|mtia|privateuseone):\d+\b")
_POLL = 0.02


class DistributedError(Error, RuntimeError):
    """A distributed ``finalize()`` cannot proceed: ranks missing, or ranks
    that disagree (``ranks`` names them)."""

    def __init__(self, message: str, ranks: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.ranks = tuple(ranks)
        """The ranks that are missing or disagree (empty when not known)."""


def active_group(group: Any) -> Any:
    """The process group a finalize is a collective over, or ``None`` for a
    single process (nothing initialised, or a group of one rank)."""
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise DistributedError("capture_with(group=...): torch.distributed is not "
                                   "initialised in this process")
        return None
    pg = group if group is not None else dist.group.WORLD
    if dist.get_world_size(pg) <= 1:
        return None
    return pg


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


def variant_key(request: VariantRequest, identity: Any) -> str:
    """The same on every rank for the same call: scope, member identity,
    signature and context, without device indices or addresses."""
    return _digest({"scope": request.scope, "identity": ADDRESS.sub("", repr(identity)),
                    "inputs": call_to_json(request.inputs),
                    "constants": _const_keys(request.inputs),
                    "snapshot": _snapshot_key(request.snapshot)})


@attrs.frozen
class Observed:
    """What one rank says it observed of one variant (metadata only)."""

    key: str
    scope: str
    index: int  # the rank's own variant number
    calls: int
    members: tuple[tuple[str, int], ...]


@attrs.frozen
class Plan:
    """Who captures what: the same on every rank."""

    owner: dict[str, int]
    observed_on: dict[str, tuple[int, ...]]
    rank_calls: dict[str, tuple[tuple[int, int], ...]]
    members: dict[str, tuple[tuple[str, int], ...]]
    variant: dict[str, int]  # key -> the merged report's variant number


def make_plan(gathered: Sequence[Sequence[Observed]]) -> Plan:
    by_key: dict[str, list[tuple[int, Observed]]] = {}
    for rank, items in enumerate(gathered):
        for o in items:
            by_key.setdefault(o.key, []).append((rank, o))
    load = [0] * len(gathered)
    owner, observed_on, rank_calls, members, variant = {}, {}, {}, {}, {}
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
        variant[key] = per_scope.get(scope, 0)
        per_scope[scope] = variant[key] + 1
    return Plan(owner, observed_on, rank_calls, members, variant)


class Collective:
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


def group_timeout(group: Any, fallback: float = 1800.0) -> float:
    """The group's own collective timeout in seconds (``fallback`` when torch
    does not say)."""
    for device in ("cpu", "cuda"):
        try:
            return float(group._get_backend(torch.device(device)).options._timeout
                         .total_seconds())
        except Exception:
            continue
    return fallback


@attrs.frozen(eq=False)
class GroupOutcome:
    """What a distributed finalize produced: the same on every rank."""

    captures: tuple[Capture, ...]
    failures: tuple[CaptureFailure, ...]
    problems: tuple[Problem, ...]
    notices: tuple[Any, ...]
    errors: tuple[tuple[str, str, int], ...]
    dropped: dict[str, int]
    retained: dict[str, int] | None
    seconds: tuple[float, ...]
    info: dict[str, Any]
    explanations: tuple[Any, ...] = ()


def _relabel(result: Capture | CaptureFailure, key: str, plan: Plan,
             coll: Collective) -> Capture | CaptureFailure:
    variant = plan.variant[key]
    if isinstance(result, CaptureFailure):
        return attrs.evolve(result, variant=variant)
    members = plan.members[key]
    return attrs.evolve(
        result, variant=variant, rank=coll.ranks[coll.rank],
        observed_on=tuple(coll.ranks[r] for r in plan.observed_on[key]),
        rank_calls=tuple((coll.ranks[r], n) for r, n in plan.rank_calls[key]),
        members=tuple(n for n, _ in members), member_calls=members,
        calls=sum(n for _, n in members))


def finalize_group(coll: Collective, requests: Sequence[VariantRequest],
                   identities: Sequence[Any], options: Any,
                   capture: Callable[[VariantRequest], list[Capture | CaptureFailure]],
                   local_coverage: Callable[[], tuple[tuple[Problem, ...], tuple[Any, ...]]],
                   local_counts: Callable[[], dict[str, Any]],
                   modules: Mapping[str, nn.Module],
                   baseline: tuple[ContextProbe[Any], ...],
                   explain: Callable[[list[Capture]], Any] | None,
                   progress: Callable[[str], None]) -> GroupOutcome:
    """Steps 1-6 of the module docstring."""
    t0 = time.perf_counter()
    timeout = options.capture_timeout or group_timeout(coll.group)
    coll.join(timeout)
    coll.agree_on_probes(options.probe_names)
    keys = [variant_key(r, ident) for r, ident in zip(requests, identities)]
    observed = [Observed(k, r.scope, r.variant, r.calls,
                         tuple((m.name, m.calls) for m in r.members))
                for k, r in zip(keys, requests)]
    plan = make_plan(coll.gather(observed))
    mine: dict[str, Capture] = {}
    failures: list[CaptureFailure] = []
    for key, request in zip(keys, requests):
        if plan.owner[key] != coll.rank:
            continue
        for result in capture(request):
            result = _relabel(result, key, plan, coll)
            if isinstance(result, Capture):
                mine[f"{result.scope}#{result.variant}"] = result
            else:
                failures.append(result)
        progress(f"{request.scope}#{plan.variant[key]}")
    problems, notices = local_coverage()
    counts = local_counts()
    explained = explain(list(mine.values())) if explain is not None else None
    every = coll.gather({
        "captures": [portable(to_wire(c)) for c in mine.values()],
        "failures": failures, "problems": problems, "notices": notices, "counts": counts,
        "seconds": time.perf_counter() - t0,
        "explained": None if explained is None else explained.captures})
    probes = {p.name: p for p in options.probes}
    captures: list[Capture] = []
    for doc in every:
        for wire in doc["captures"]:
            key = f"{wire['scope']}#{wire['variant']}"
            captures.append(mine[key] if key in mine else from_wire(wire, probes))
    captures.sort(key=lambda c: (c.scope, c.variant))
    if options.verify in ("execute", "values"):
        checked = run_collective_checks(coll, captures, mine, modules, baseline,
                                        options.verify)
        captures = [attrs.evolve(c, fidelity=checked[(c.scope, c.variant)])
                    if (c.scope, c.variant) in checked else c for c in captures]
    all_failures = sorted((f for doc in every for f in doc["failures"]),
                          key=lambda f: (f.scope, f.variant))
    ranks = coll.ranks
    all_problems = tuple(attrs.evolve(p, rank=ranks[r])
                         for r, doc in enumerate(every) for p in doc["problems"])
    if not plan.owner and not all_problems:
        all_problems = (Problem("nothing_observed"),)
    elif plan.owner and not captures:
        all_problems += (Problem("no_captures", None, len(plan.owner),
                                 sum(n for rc in plan.rank_calls.values() for _, n in rc)),)
    seen_notices: list[Any] = []
    for doc in every:
        seen_notices += [n for n in doc["notices"] if n not in seen_notices]
    errors: dict[tuple[str, str], int] = {}
    dropped = {"variants": 0, "variant_calls": 0, "scopes": 0}
    retained: dict[str, int] | None = None
    for doc in every:
        c = doc["counts"]
        for (w, t), n in c["errors"].items():
            errors[(w, t)] = errors.get((w, t), 0) + n
        for k in dropped:
            dropped[k] += c["dropped"][k]
        if c["retained"] is not None:
            retained = retained or {k: 0 for k in c["retained"]}
            for k, v in c["retained"].items():
                retained[k] = max(retained[k], v) if k == "retain_bytes" else retained[k] + v
    explanations = tuple(e for doc in every for e in (doc["explained"] or ()))
    seconds = tuple(float(doc["seconds"]) for doc in every)
    info = {"world_size": dist.get_world_size(), "group_ranks": list(ranks),
            "backend": str(dist.get_backend(coll.group)),
            "rank_seconds": [round(s, 6) for s in seconds],
            "assigned": [sum(1 for o in plan.owner.values() if o == r)
                         for r in range(coll.size)]}
    return GroupOutcome(tuple(captures), tuple(all_failures), all_problems,
                        tuple(seen_notices),
                        tuple((w, t, n) for (w, t), n in sorted(errors.items())), dropped,
                        retained, seconds, info, explanations)
