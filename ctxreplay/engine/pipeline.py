"""The one finalize pipeline: plan, capture, merge, share, build the report.

A single process is the one-rank case of a distributed job: ``finalize()``
runs these steps over an exchange -- ``Alone`` for one process, the group's
``RankGroup`` otherwise -- so every report, distributed or not, is built by
``build_report`` here, once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
from torch import nn

from ..cache.folds import cached_fold
from ..cache.use import CaptureCache
from ..capture.fold import Trial, families, fold_family, folds
from ..capture.merge import merge_identical
from ..capture.options import CaptureOptions, VariantRequest
from ..capture.reads import Reads
from ..capture.results import Capture, CaptureFailure, Notice, Problem
from ..capture.variant import CaptureFailed, Kin, Source, Tick, capture_variant
from ..core.observer import Observer
from ..core.probe import ContextProbe
from ..core.registry import resolve_probes
from ..distributed.exchange import Exchange, Observed, Plan, RankResults
from ..observation.attach import Observation
from ..observation.targets import changed_attributes
from ..report.capture_report import CaptureReport
from ..report.explain import explain_captures
from ..specs.dims import size_free
from .baseline import Baseline
from .coverage import coverage
from .progress import FinalizeProgress

__all__ = ["Finalizing", "build_report", "run_finalize"]

ProgressCallback = Callable[[int, int, str], None]
Result = Capture | CaptureFailure


@attrs.define(eq=False)
class Finalizing:
    """One session's finalize: what it works on, and what it captured so
    far -- kept across an interrupted (Ctrl-C) finalize, so that calling it
    again captures only the rest."""

    observation: Observation
    observer: Observer
    options: CaptureOptions
    done: dict[tuple[str, int], list[Result]] = attrs.Factory(dict)
    interrupted: bool = False
    released: bool = False

    def release(self) -> None:
        """Let go of every module and live state: each probe's ``clear()``
        (what one raises is an observation error of the report), the
        observation's references, the observer's cached snapshot.  A Ctrl-C
        inside a ``clear()`` lets the others run first, then goes on."""
        if self.released:
            return
        self.released = True
        interrupt: BaseException | None = None
        for p in self.options.probes:
            try:
                p.clear()
            except Exception as exc:
                self.observation.shared.error("clear", exc)
            except BaseException as exc:
                interrupt = interrupt or exc
        self.observation.release()
        self.observer.invalidate()
        if interrupt is not None:
            raise interrupt


def run_finalize(job: Finalizing, exchange: Exchange, net: Baseline, *, explain: bool,
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
    keys = [exchange.key(r, obs.identity_value(r)) for r in requests]
    plan = exchange.plan([Observed(k, r.scope, r.variant, r.calls,
                                   tuple((m.name, m.calls) for m in r.members))
                          for k, r in zip(keys, requests)])
    mine = [(k, r) for k, r in zip(keys, requests) if plan.owner[k] == exchange.rank]
    modules = obs.member_modules()
    baseline = _baseline_probes()
    todo = {(r.scope, r.variant) for _, r in mine} - job.done.keys()
    bar = FinalizeProgress(_steps(everything, options),
                           {(r.scope, r.variant) for r in everything} - todo, progress)
    def work() -> tuple[list[Result], tuple[Any, ...] | None]:
        # explaining recaptures: it gathers FSDP parameters as capture does
        results = _capture_mine(job, mine, plan, exchange, modules, baseline, net, bar)
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
                                        modules, baseline, options.verify)
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
                  exchange: Exchange, modules: dict[str, nn.Module],
                  baseline: tuple[ContextProbe[Any], ...], net: Baseline,
                  bar: FinalizeProgress) -> list[Result]:
    """Capture this rank's variants (those an interrupted finalize already
    captured are kept), each as the merged report names it: the variants
    of a family that differ in sizes only folded where they can be."""
    out: list[Result] = []
    cache = None if job.options.cache is None else CaptureCache.at(job.options.cache)
    distributed = len(exchange.ranks) > 1
    keys = {id(r): k for k, r in mine}
    requests = [r for _, r in mine]
    local = {(r.scope, r.variant): k for k, r in mine}
    groups = families(requests) if folds(job.options) else [[r] for r in requests]
    identities = {id(r): job.observation.identity_value(r) for r in requests
                  if r.identity_number >= 0}
    kin = _kin(requests, identities, _same_call)
    # the variants a fold may serve: other identities' variants of its family
    # but for sizes (not through the cache, whose fold entries hold one family)
    sizes = _kin(requests, identities, _same_family) if cache is None else {}
    refused: set[tuple[str, int]] = set()  # a graph of their kin did not pass their check

    def label(request: VariantRequest) -> str:
        key = keys.get(id(request))
        return f"{request.scope}#{request.variant if key is None else plan.variant[key]}"

    def tick(request: VariantRequest, member: str) -> None:
        bar.checked((request.scope, request.variant), f"{label(request)} {member}")

    try:
        for group in groups:
            _fold(job, group, modules, baseline, net, bar, cache, distributed,
                  _FoldKin(sizes.get(id(group[0]), ()), identities))
            for request in group:
                where = (request.scope, request.variant)
                if where not in job.done:
                    others = _kin_of(job, request, kin.get(id(request), ()), refused)
                    job.done[where] = _one(job, request, modules, baseline, net,
                                           distributed, cache, others, tick)
                    made = any(isinstance(r, Capture) for r in job.done[where])
                    bar.finished(where, label(request), graph=made, served=False)
                    refused.update((request.scope, v) for v in others.refused)
                    for other, _ in others.others:
                        served = others.served.get(other.variant)
                        if served is not None:  # checked against its members, no trace
                            job.done[(other.scope, other.variant)] = [served]
                            bar.finished((other.scope, other.variant), label(other),
                                         graph=False, served=True)
                out += [exchange.relabel(r, keys[id(request)], plan, _folded_keys(r, local))
                        for r in job.done[where]]
    finally:
        bar.close()
    return out


def _folded_keys(result: Result, local: Mapping[tuple[str, int], str]) -> tuple[str, ...]:
    """The keys of the variants a folded capture stands for besides its own
    (this rank numbers them as it observed them)."""
    if not isinstance(result, Capture):
        return ()
    return tuple(local[(result.scope, v)] for v in result.folded)


def _same_call(r: VariantRequest) -> Any:
    return (r.scope, r.snapshot, r.training, r.inputs, r.outputs)


def _same_family(r: VariantRequest) -> Any:
    return (r.scope, r.snapshot, r.training, size_free(r.inputs), size_free(r.outputs))


def _kin(requests: Sequence[VariantRequest], identities: Mapping[int, Any],
         key: Callable[[VariantRequest], Any]
         ) -> dict[int, tuple[tuple[VariantRequest, Any], ...]]:
    """For each request (by ``id``), the requests of its ``key`` -- of its
    scope, context, training flags, and input and output signature
    (``_same_call``) or the same but for sizes (``_same_family``) -- that
    are of more than one identity, each with its identity: a trace of one
    may serve the others (``capture.variant.Kin``)."""
    groups: dict[Any, list[tuple[VariantRequest, Any]]] = {}
    for r in requests:
        if id(r) not in identities:
            continue
        try:
            k = key(r)
            hash(k)
        except Exception:  # a constant that cannot be hashed: on its own
            continue
        groups.setdefault(k, []).append((r, identities[id(r)]))
    out: dict[int, tuple[tuple[VariantRequest, Any], ...]] = {}
    for group in groups.values():
        if len({r.identity_number for r, _ in group}) > 1:
            for r, _ in group:
                out[id(r)] = tuple(group)
    return out


def _kin_of(job: Finalizing, request: VariantRequest,
            group: Sequence[tuple[VariantRequest, Any]],
            refused: set[tuple[str, int]]) -> Kin:
    """The variants of ``request``'s kin not captured yet (nor ``refused``
    by another graph of the kin) whose identity differs from its own in
    plain attributes alone, with those attributes."""
    mine = next((i for r, i in group if r is request), None)
    others: list[tuple[VariantRequest, frozenset[tuple[str, str]]]] = []
    for r, identity in group:
        where = (r.scope, r.variant)
        if r is request or where in job.done or where in refused or mine is None \
                or identity is None:
            continue
        try:
            changed = changed_attributes(mine, identity)
        except Exception:
            changed = None
        if changed is not None:
            others.append((r, frozenset(changed)))
    return Kin(others)


def _one(job: Finalizing, request: VariantRequest, modules: dict[str, nn.Module],
         baseline: tuple[ContextProbe[Any], ...], net: Baseline, distributed: bool,
         cache: CaptureCache | None, kin: Kin | None = None,
         tick: Tick | None = None) -> list[Result]:
    if job.interrupted:  # nothing is held any more
        return [CaptureFailure(request.scope, request.variant, job.options.backend.name,
                               "interrupted", "-")]
    return capture_one(request, modules, job.options, baseline, net,
                       distributed=distributed, cache=cache, kin=kin, tick=tick)


@attrs.define(eq=False)
class _FoldKin:
    """The variants of other identities a fold of a family may serve (its
    family but for the identity), and every request's identity.  Tried in
    the fold only where its trace read none of the attributes they differ
    in (``after``); the fold's own checks then run each at its sizes,
    against each of its members with their own weights."""

    others: Sequence[tuple[VariantRequest, Any]]
    identities: Mapping[int, Any]

    def after(self, trial: Trial, reads: Reads) -> Any:
        """``trial`` run only on the variants the traced graph may serve."""
        def run(artifact: Any, checker_for: Any, modules: Any) -> None:
            example = trial.example
            mine = self.identities.get(id(example), ())
            keep = []
            for r in trial.pending:
                if r.identity_number == example.identity_number:
                    keep.append(r)
                    continue
                try:
                    changed = changed_attributes(mine, self.identities[id(r)])
                except Exception:
                    changed = None
                if changed is not None and all(n != "forward" for _, n in changed) \
                        and reads.untouched(changed):
                    keep.append(r)
            trial.pending = keep  # (a list of its own: the fold's stays whole)
            trial(artifact, checker_for, modules)
        return run


def _fold(job: Finalizing, group: list[VariantRequest], modules: dict[str, nn.Module],
          baseline: tuple[ContextProbe[Any], ...], net: Baseline, bar: FinalizeProgress,
          cache: CaptureCache | None, distributed: bool, kin: _FoldKin) -> None:
    """Fold the variants of ``group`` (one family) not captured yet, and
    those of ``kin`` its trace may serve: each folded capture is recorded
    under its example, the variants it stands for as done with nothing of
    their own.  ``distributed``: a graph that holds collectives is not run
    here (it would wait for the other ranks), so it folds nothing."""
    todo = [r for r in group if (r.scope, r.variant) not in job.done]
    if len(todo) < 2 or job.interrupted:
        return
    mine = {id(r) for r in group}
    extra = [r for r, _ in kin.others
             if id(r) not in mine and (r.scope, r.variant) not in job.done]
    examples: list[VariantRequest] = []

    def trace(request: VariantRequest, dims: Any, after: Any, source: Any) -> Capture:
        reads = Reads()
        if extra and source is None:
            after = kin.after(after, reads)
        try:
            return capture_variant(request, modules, job.options, baseline=baseline,
                                   dims=dims, after=after, source=source,
                                   defer_collectives=distributed, reads=reads)
        finally:
            if net.restore():  # a fold that leaks state is not used
                raise CaptureFailed(CaptureFailure(request.scope, request.variant,
                                                   job.options.backend.name, "state_leak",
                                                   "-"))

    def run(request: VariantRequest, dims: Any, trial: Trial) -> Capture:
        examples.append(request)
        if cache is None:
            return trace(request, dims, trial, None)
        return cached_fold(cache, request, trial.pending, dims, trial, modules, job.options,
                           baseline, lambda source: trace(request, dims, trial, source))

    _folded_done(job, bar, fold_family(todo + extra, job.options, run)[0])
    rest = [r for r in group if (r.scope, r.variant) not in job.done]
    if extra and len(rest) >= 2 and not any(id(r) in mine for r in examples):
        # the folds tried went to other identities' examples whose traces
        # read what they differ in: this family's own fold is still due
        extra = []
        _folded_done(job, bar, fold_family(rest, job.options, run)[0])


def _folded_done(job: Finalizing, bar: FinalizeProgress, made: Sequence[Capture]) -> None:
    """Each folded capture recorded under its example, the variants it
    stands for as done with nothing of their own."""
    for c in made:
        job.done[(c.scope, c.variant)] = [c]
        for v in c.folded:
            job.done[(c.scope, v)] = []
        for v in (c.variant, *c.folded):
            bar.finished((c.scope, v), f"{c.scope}#{v}", graph=v == c.variant,
                         served=v != c.variant)


def capture_one(request: VariantRequest, modules: dict[str, nn.Module],
                options: CaptureOptions, baseline: tuple[ContextProbe[Any], ...],
                net: Baseline, *, distributed: bool,
                cache: CaptureCache | None = None, kin: Kin | None = None,
                tick: Tick | None = None) -> list[Result]:
    """One variant's capture (through ``cache`` when given), or why it
    failed; and a ``state_leak`` failure when it left the ambient state
    changed (the safety net put it back).  ``kin``: variants its graph may
    serve (``kin.served``; none where the run leaked state).  ``tick``: told
    as each member's check starts (progress)."""
    failure: CaptureFailure | None = None

    def run(source: Source | None) -> Capture:
        return capture_variant(request, modules, options, baseline=baseline,
                               defer_collectives=distributed, source=source, kin=kin,
                               tick=tick)

    try:
        result: Result = run(None) if cache is None else \
            cache.capture(request, modules, options, baseline, run)
    except CaptureFailed as f:
        result = failure = f.failure
    except Exception as exc:  # an engine bug must not cost the other variants
        result = failure = CaptureFailure(request.scope, request.variant, options.backend.name,
                                          "internal_error", type(exc).__name__)
    finally:
        leaked = net.restore()
    # an abandoned capture thread holds its replay until its backend
    # returns: expected after a timeout, not a leak
    if leaked and kin is not None:  # its checks ran in that state: not served
        kin.served.clear()
    if leaked and (failure is None or failure.reason != "timeout"):
        return [result, CaptureFailure(request.scope, request.variant, options.backend.name,
                                       "state_leak", "-", (), leaked)]
    return [result]


def _rank_results(job: Finalizing, everything: Sequence[VariantRequest],
                  captures: list[Capture], failures: list[CaptureFailure],
                  explained: tuple[Any, ...] | None, seconds: float) -> RankResults:
    obs = job.observation
    problems, notices = coverage(obs, everything, captures, job.options, whole=False)
    # what ``nothing_observed`` needs to know of each rank: any variant,
    # observation error, call in a compiled region or under a torch.func
    # transform, or structure past the limit
    seen = bool(everything) or any(p.reason in ("observation_error", "not_observed",
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


def _baseline_probes() -> tuple[ContextProbe[Any], ...]:
    try:
        return resolve_probes(None)
    except Exception:  # a broken registry must not break finalize
        return ()
