"""The one finalize pipeline: plan, capture, merge, share, build the report.

A single process is the one-rank case of a distributed job: ``finalize()``
runs these steps over an exchange -- ``Alone`` for one process, the group's
``RankGroup`` otherwise -- so every report, distributed or not, is built by
``build_report`` here, once.  Only a job with a group imports
``ctxreplay.distributed``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
from torch import nn

from ..cache.use import CaptureCache
from ..capture.asking import Tracing
from ..capture.merge import merge_identical
from ..capture.options import CaptureOptions, VariantRequest
from ..capture.results import Capture, CaptureFailure, Notice, Problem
from ..core.probe import ContextProbe
from ..core.registry import resolve_probes
from ..report.capture_report import CaptureReport
from ..report.explain import explain_captures
from ..report.ranks import Exchange, Observed, Plan, RankResults
from .capturing import RankCapture, Result
from .coverage import coverage
from .finalizing import Finalizing
from .progress import FinalizeProgress
from .safetynet import SafetyNet

__all__ = ["Finalizing", "ProgressCallback", "build_report", "run_finalize"]

ProgressCallback = Callable[[int, int, str], None]


def run_finalize(job: Finalizing, exchange: Exchange, net: SafetyNet, *, explain: bool,
                 progress: ProgressCallback | None) -> CaptureReport:
    """Every step of ``finalize()`` once observation has stopped, on this rank."""
    t0 = time.perf_counter()
    obs, options = job.observation, job.options
    everything = obs.requests()
    # a variant none of whose calls had returned (one still running) has
    # nothing to capture: a problem of the report (never_completed), not a
    # capture failure
    requests = [r for r in everything if any(m.completed for m in r.members)]
    exchange.open(options)
    identity = obs.identity_values()
    keys = [exchange.key(r, identity(r)) for r in requests]
    plan = exchange.plan([Observed(k, r.scope, r.variant, r.calls,
                                   tuple((m.name, m.calls) for m in r.members))
                          for k, r in zip(keys, requests)])
    mine = [(k, r) for k, r in zip(keys, requests) if plan.owner[k] == exchange.rank]
    modules = obs.member_modules()
    neutral = _neutral_probes()
    todo = {(r.scope, r.variant) for _, r in mine} - job.done.keys()
    bar = FinalizeProgress(_steps(everything, options),
                           {(r.scope, r.variant) for r in everything} - todo, progress)
    def work() -> tuple[list[Result], tuple[Any, ...] | None]:
        # explaining recaptures: it gathers FSDP parameters as capture does
        tracing = Tracing(modules, options, neutral, defer_collectives=len(exchange.ranks) > 1)
        results = _capture_mine(job, mine, plan, exchange, RankCapture(job, tracing, net, bar))
        if not explain or job.interrupted:
            return results, None
        made = [c for c in results if isinstance(c, Capture)]
        return results, tuple(explain_captures(made, modules, options).captures)

    root = obs.root.module if obs.root is not None else nn.Module()
    results, explained = exchange.captures_in_turns(work, modules, root)
    captures = list(merge_identical([c for c in results if isinstance(c, Capture)]))
    failures = [f for f in results if isinstance(f, CaptureFailure)]
    bar.summary(len(captures), len(failures), time.perf_counter() - t0)
    local = _rank_results(job, everything, captures, failures, explained,
                          time.perf_counter() - t0)
    every = exchange.share(local, options)
    order = _plan_order(plan)
    shared = sorted((c for r in every for c in r.captures), key=order)
    shared = exchange.check_collectives(shared, {f"{c.scope}#{c.variant}": c for c in captures},
                                        modules, neutral, options.verify)
    job.release()  # before the counts: what a probe's clear() raises is counted
    errors = exchange.gather(dict(obs.shared.errors))
    every = [attrs.evolve(r, errors=e) for r, e in zip(every, errors)]
    job.done.clear()  # the report holds them now
    return build_report(every, shared, options, order, exchange.info(plan, every))


def _steps(requests: Sequence[VariantRequest], options: CaptureOptions
           ) -> dict[tuple[str, int], int]:
    """Each variant's share of the progress bar: its capture, and a check
    per member that ran it (none at ``verify="off"``)."""
    checks = options.verify != "off"
    return {(r.scope, r.variant): 1 + checks * sum(m.completed for m in r.members)
            for r in requests}


def _capture_mine(job: Finalizing, mine: list[tuple[str, VariantRequest]], plan: Plan,
                  exchange: Exchange, rank: RankCapture) -> list[Result]:
    """This rank's variants captured by ``rank`` (through the session's
    cache, if any), each relabelled as the merged report names it."""
    keys = {id(r): k for k, r in mine}
    local = {(r.scope, r.variant): k for k, r in mine}
    rank.labels = {(r.scope, r.variant): f"{r.scope}#{plan.variant[k]}" for k, r in mine}
    if job.options.cache is not None:
        rank.cache = CaptureCache.at(job.options.cache)
    return [exchange.relabel(r, keys[id(request)], plan, _folded_keys(r, local))
            for request, r in rank.run([r for _, r in mine])]


def _folded_keys(result: Result, local: Mapping[tuple[str, int], str]) -> tuple[str, ...]:
    """The keys of the variants a folded capture stands for besides its own
    (this rank numbers them as it observed them)."""
    if not isinstance(result, Capture):
        return ()
    return tuple(local[(result.scope, v)] for v in result.folded)


def _rank_results(job: Finalizing, everything: Sequence[VariantRequest],
                  captures: list[Capture], failures: list[CaptureFailure],
                  explained: tuple[Any, ...] | None, seconds: float) -> RankResults:
    obs = job.observation
    problems, notices = coverage(obs, everything, captures, job.options, whole=False)
    # what ``nothing_observed`` needs to know of each rank: any variant,
    # observation error, call in a compiled region, a control-flow branch or under a torch.func
    # transform, or structure past the limit
    seen = bool(everything) or any(p.reason in ("observation_error", "not_observed", "control_flow",
                                                "transformed", "scope_limit")
                                   for p in problems)
    return RankResults(
        captures=tuple(captures), failures=tuple(failures), problems=problems,
        notices=notices, errors=dict(obs.shared.errors), dropped=obs.dropped(),
        retained=obs.shared.retention.summary(), requests=len(everything),
        calls=sum(r.calls for r in everything), observed=seen, seconds=seconds,
        explained=explained)


def _plan_order(plan: Plan) -> Callable[[Result], tuple[int, int]]:
    """Report order: the plan's, scope by scope."""
    scopes: dict[str, int] = {}
    for key in plan.variant:
        scopes.setdefault(plan.scope[key], len(scopes))
    return lambda r: (scopes.get(r.scope, len(scopes)), r.variant)


def build_report(every: list[RankResults], captures: list[Capture], options: CaptureOptions,
                 order: Callable[[Result], tuple[int, int]],
                 distributed: dict[str, Any] | None) -> CaptureReport:
    """The report of a finalize, from what every rank produced (one rank
    in a single process)."""
    failures = sorted((f for r in every for f in r.failures), key=order)
    problems = [p for r in every for p in r.problems]
    problems += _job_problems(every, captures)
    notices: list[Notice] = []
    for r in every:
        notices += [n for n in r.notices if n not in notices]
    errors: dict[tuple[str, str], int] = {}
    for r in every:
        for where, n in r.errors.items():
            errors[where] = errors.get(where, 0) + n
    explanations = {(e.scope, e.variant): e for r in every for e in (r.explained or ())}
    return CaptureReport(
        tuple(captures), tuple(failures), options.probe_names, options.to_json(),
        _summed_dropped(every), tuple((w, t, n) for (w, t), n in sorted(errors.items())),
        max(r.seconds for r in every), problems=tuple(problems), notices=tuple(notices),
        options=options, retained=_merged_retained(every), distributed=distributed,
        explanations=explanations)


def _job_problems(every: list[RankResults], captures: list[Capture]) -> list[Problem]:
    """What only the whole job can say: nothing was observed anywhere, or
    variants were and nothing was captured."""
    if not any(r.observed for r in every):
        return [Problem("nothing_observed")]
    requests = sum(r.requests for r in every)
    if requests and not captures:
        return [Problem("no_captures", None, requests, sum(r.calls for r in every))]
    return []


def _summed_dropped(every: list[RankResults]) -> dict[str, int]:
    dropped = {"variants": 0, "variant_calls": 0, "scopes": 0}
    for r in every:
        for k in dropped:
            dropped[k] += r.dropped[k]
    return dropped


def _merged_retained(every: list[RankResults]) -> dict[str, int] | None:
    retained: dict[str, int] | None = None
    for r in every:
        if r.retained is None:
            continue
        retained = retained or {k: 0 for k in r.retained}
        for k, v in r.retained.items():
            retained[k] = max(retained[k], v) if k == "retain_bytes" else retained[k] + v
    return retained


def _neutral_probes() -> tuple[ContextProbe[Any], ...]:
    """The default probes: every run of a check starts from their neutral
    states, beside the snapshot's own."""
    try:
        return resolve_probes(None)
    except Exception:  # a broken registry must not break finalize
        return ()
