"""What keeps a report from being ok although no capture failed (problems),
and what looks suspicious though it is not wrong (notices)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from ..capture.fold import not_folding
from ..capture.options import CaptureOptions, VariantRequest
from ..capture.results import Capture, Notice, Problem
from ..observation.attach import Observation
from ..specs.dims import size_free, varying_dims

__all__ = ["coverage"]


def coverage(obs: Observation, requests: Sequence[VariantRequest],
             captures: Sequence[Capture], options: CaptureOptions, *, whole: bool = True
             ) -> tuple[tuple[Problem, ...], tuple[Notice, ...]]:
    """``whole=False``: one rank of a distributed finalize, which cannot say
    whether the job captured nothing (``no_captures``, ``nothing_observed``)."""
    problems: list[Problem] = []
    notices: list[Notice] = []
    shared = obs.shared
    errors = sum(shared.errors.values())
    if errors:
        names = [f"{w}:{t}" for (w, t) in sorted(shared.errors)]
        names += [f"probe {p}" for p in sorted(shared.failing_probes)]
        problems.append(Problem("observation_error", calls=errors, names=tuple(names)))
    for scope in obs.scopes:
        if scope.dropped_calls:
            problems.append(Problem("variant_limit", scope.name, len(scope.dropped),
                                    scope.dropped_calls, _limit_names(scope, options),
                                    limit=options.max_variants,
                                    exact=not scope.dropped_overflow))
    if obs.dropped_scopes:
        problems.append(Problem("scope_limit", None, obs.dropped_structures, 0,
                                tuple(obs.dropped_scopes), limit=options.max_scopes))
    transformed = obs.transformed_calls()
    if transformed:
        problems.append(Problem("transformed", None, 0, sum(transformed.values()),
                                tuple(transformed)))
    eager, traced = obs.compiled_calls()
    compiled = sum(len(names) for names in traced.values())
    if eager:
        notices.append(Notice("compiled_ran_uncompiled", None, None, sum(eager.values()),
                              tuple(eager)))
    # traced by Dynamo: that they ran is known, not how often
    for operator, names in traced.items():
        if operator is None:
            problems.append(Problem("not_observed", None, 0, 0, tuple(names), exact=False))
        else:
            problems.append(Problem("control_flow", None, 0, 0, (operator, *names),
                                    exact=False))
    for scope_name, reqs in _by_scope(r for r in requests
                                      if not any(m.completed for m in r.members)).items():
        problems.append(Problem("never_completed", scope_name, len(reqs),
                                sum(r.calls for r in reqs)))
    for scope, member_name, attributes in obs.stateful_members():
        problems.append(Problem("stateful_member", scope.name, 0, 0,
                                (member_name, *attributes[:8])))
    if obs.lost:
        problems.append(Problem("observation_lost", None, 0, sum(n for _, n in obs.lost),
                                tuple(dict.fromkeys(name for name, _ in obs.lost)),
                                exact=False))
    for scope, member, change in obs.changed_members():
        problems.append(Problem("member_changed", scope.name, 0, 0,
                                (member.name or scope.name, change)))
    if not whole:
        pass
    elif not requests and not errors and not compiled and not obs.dropped_scopes \
            and not transformed:
        problems.append(Problem("nothing_observed"))
    elif requests and not captures:
        problems.append(Problem("no_captures", None, len(requests),
                                sum(r.calls for r in requests)))
    for scope, member_name, raised in obs.raised_members():
        notices.append(Notice("call_raised", scope.name, None, raised, (member_name,)))
    beneath = obs.beneath
    if beneath:
        notices.append(Notice("step_cache_beneath", None, None, len(beneath), tuple(beneath)))
    if obs.step_cache_inside:
        notices.append(Notice("step_cache_inside", None, None, len(obs.step_cache_inside),
                              obs.step_cache_inside))
    notices += _too_fine(captures, requests, obs)
    return tuple(problems), tuple(notices)


def _limit_names(scope: Any, options: CaptureOptions) -> tuple[str, ...]:
    """What a ``variant_limit`` problem names: whether sizes folded (or why
    not), how many calls each limit dropped, and the dimensions whose sizes
    varied among the variants kept."""
    off = not_folding(options)
    names = ["fold:on" if off is None else f"fold:off:{off}"]
    names += [f"dropped:{why}:{n}" for why, n in sorted(scope.dropped_why.items())]
    groups: dict[Any, list[Any]] = {}
    for view in scope.variants.values():
        groups.setdefault(size_free(view.inputs), []).append(view.inputs)
    paths: list[str] = []
    for sigs in groups.values():
        leaves = [p for p, _ in sigs[0].leaves()]
        for i, dims in varying_dims(sigs).items() if len(sigs) > 1 else ():
            paths += [f"dim:{leaves[i]}[{d}]" for d in dims]
    return (*names, *list(dict.fromkeys(paths))[:8])


def _by_scope(requests: Any) -> dict[str, list[VariantRequest]]:
    out: dict[str, list[VariantRequest]] = defaultdict(list)
    for r in requests:
        out[r.scope].append(r)
    return out


def _too_fine(captures: Sequence[Capture], requests: Sequence[VariantRequest],
              obs: Observation) -> list[Notice]:
    """Captures of one scope with identical graphs and inputs whose snapshots
    differ (a probe's key separates calls that run the same graph), and probes
    whose state differs in every variant of a scope."""
    out: list[Notice] = []
    groups: dict[tuple[Any, ...], list[Capture]] = defaultdict(list)
    for c in captures:
        groups[(c.scope, c.graph_digest or c.ops, c.signature, c.backend)].append(c)
    flagged: set[tuple[str, str]] = set()
    for (scope, *_), caps in groups.items():
        if len(caps) < 2:
            continue
        names = caps[0].snapshot.names
        for i, name in enumerate(names):
            states = {c.snapshot.states[i] for c in caps if c.snapshot.names == names}
            if len(states) > 1 and (scope, name) not in flagged:
                flagged.add((scope, name))
                out.append(Notice("probe_too_fine", scope, name, len(caps)))
    for scope in obs.scopes:
        snaps = [r.snapshot for r in requests if r.scope == scope.name]
        snaps += scope.dropped_first
        if len(snaps) < 3:
            continue
        names = snaps[0].names
        for i, name in enumerate(names):
            if (scope.name, name) in flagged:
                continue
            seen = [s.states[i] for s in snaps if s.names == names]
            if len(set(seen)) == len(seen) == len(snaps):
                out.append(Notice("probe_varies_every_call", scope.name, name, len(snaps)))
    return out
