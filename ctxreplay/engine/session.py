"""The engine: ``capture_with`` observes cheaply during the live forward,
``finalize()`` captures every variant afterwards.

The engine never names a concrete probe: it only calls the probe contract.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from torch import nn

from ..backends import Backend, get_backend
from ..capture.merge import merge_identical
from ..capture.options import CaptureOptions, VariantRequest
from ..capture.results import Capture, CaptureFailure, Notice, Problem
from ..capture.variant import CaptureFailed, capture_variant
from ..core.observer import Observer
from ..core.probe import ContextProbe
from ..core.registry import resolve_probes
from ..distributed.exchange import Collective, active_group, finalize_group
from ..errors import Error
from ..observation.attach import Observation
from ..observation.targets import resolve_targets
from ..observation.variants import Scope, VariantView
from ..report.capture_report import CaptureReport, FidelityError
from .baseline import Baseline
from .coverage import coverage
from .progress import Progress

__all__ = ["CaptureSession", "SessionError", "capture_with"]

Targets = str | Sequence[str] | Callable[[str, nn.Module], bool] | None
ProgressCallback = Callable[[int, int, str], None]


class SessionError(Error, RuntimeError):
    """A session used out of order (e.g. ``finalize()`` after it completed)."""


class CaptureSession:
    """Observes a module's calls, then captures each variant on ``finalize()``.

    Created by :func:`capture_with`; observation starts at once.  Use it as a
    context manager (the wrappers are removed at exit) or call ``close()``;
    ``finalize()`` closes first if needed.
    """

    def __init__(self, module: nn.Module, options: CaptureOptions, targets: Targets) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"capture_with: expected an nn.Module, got {type(module).__name__}")
        self.options = options
        """Every setting of the session, validated (``capture_with``'s arguments)."""
        self._observer = Observer(options.probes, per_call=options.watch == "call")
        self._observation = Observation(
            module, resolve_targets(module, targets), observer=self._observer,
            max_variants=options.max_variants, max_scopes=options.max_scopes,
            profile=options.profile_ranges,
            retain_bytes=options.retain_bytes if options.verify == "values" else None,
            ignore=options.ignore_attributes)
        self._state = "open"
        self._done: dict[tuple[str, int], Capture | CaptureFailure] = {}
        self._leaks: list[CaptureFailure] = []
        self._report: CaptureReport | None = None

    # -- attributes kept from the first release -----------------------------
    @property
    def probes(self) -> tuple[ContextProbe[Any], ...]:
        """The probes observed, sorted by name."""
        return self.options.probes

    @property
    def backend(self) -> Backend:
        """The backend ``finalize()`` captures with."""
        return self.options.backend

    @property
    def scopes(self) -> tuple[Scope, ...]:
        """The structures observed, each with its members and variants."""
        return tuple(self._observation.scopes)

    @property
    def variants(self) -> list[tuple[Scope, VariantView]]:
        """Every ``(scope, variant)`` observed so far."""
        return [(s, v) for s in self._observation.scopes for v in s.variants.values()]

    @property
    def closed(self) -> bool:
        """Whether observation has stopped (``close()``, the ``with`` exit or ``finalize()``)."""
        return self._state != "open"

    @property
    def report(self) -> CaptureReport | None:
        """The report of the completed ``finalize()`` (``None`` before)."""
        return self._report

    def close(self) -> None:
        """Stop observing and restore every wrapped module's ``forward``."""
        if self._state == "open":
            self._state = "closed"
            self._observation.detach()

    def __enter__(self) -> CaptureSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- finalize -----------------------------------------------------------
    def finalize(self, *, strict: bool = False, explain: bool = False,
                 progress: ProgressCallback | None = None) -> CaptureReport:
        """Capture every variant under its replayed context; return the report.

        Detaches first: calls after it are never observed.  Afterwards the
        session holds no example arguments, no observed live objects (each
        probe's ``clear()`` runs) and no module.  ``strict=True`` raises
        :class:`FidelityError` listing every mismatch, failure and problem
        instead of returning a report that is not ok.  ``explain=True``
        works out which probes changed each graph (``report.explain``) while
        the live states it needs are still held.  ``progress(done, total,
        variant)`` is called after each variant (a terminal also gets a
        ``tqdm`` bar when tqdm is installed; otherwise one ``logging`` line
        per variant on logger ``"ctxreplay"`` at INFO).

        An interrupted finalize (Ctrl-C) keeps what it captured: calling it
        again captures the rest.  Once it completed, calling it again raises
        :class:`SessionError` (the report is ``session.report``).

        Args:
            strict: raise instead of returning a report that is not ok.
            explain: work out which probes changed each graph while the live
                states are held.
            progress: ``progress(done, total, variant)`` after each variant.

        Raises:
            FidelityError: with ``strict=True``, when the report is not ok.
            SessionError: ``finalize()`` already completed.
        """
        if self._report is not None:
            raise SessionError("finalize() already completed for this session: it detached "
                               "then, so no call since was observed; its report is "
                               "session.report. Open a new session with "
                               "ctxreplay.capture_with(...) to capture more")
        group = active_group(self.options.group)
        if group is not None:
            return self._finalize_group(Collective(group), strict, explain, progress)
        self.close()
        t0 = time.perf_counter()
        requests = self._observation.requests()
        modules = self._observation.member_modules()
        baseline_probes = _baseline_probes()
        # a variant none of whose calls returned has nothing to capture: it
        # is a problem of the report (never_completed), not a capture failure
        todo = [r for r in requests if (r.scope, r.variant) not in self._done
                and any(m.completed for m in r.members)]
        bar = Progress(len(requests), len(requests) - len(todo), progress)
        # The safety net: whatever a probe's replay, a backend or a capture
        # thread abandoned after ``capture_timeout`` did to the ambient state,
        # each variant starts from -- and the caller gets back -- the state
        # finalize() began with.  It also runs when a KeyboardInterrupt passes.
        net = Baseline()
        explanation = None
        with self._finalizing(bar, net):
            for request in todo:
                if self._state == "interrupted":  # nothing is held any more
                    self._done[(request.scope, request.variant)] = CaptureFailure(
                        request.scope, request.variant, self.backend.name, "interrupted", "-")
                    continue
                self._capture(request, modules, baseline_probes, net)
                bar.step(f"{request.scope}#{request.variant}")
            if explain and self._state != "interrupted":
                from ..report.explain import explain_captures

                explanation = explain_captures(self._captures(requests), modules,
                                               self.options)
        captures = list(merge_identical(self._captures(requests)))
        coverage_ = coverage(self._observation, requests, captures, self.options)
        if self._state != "interrupted":
            self._release()  # before the report: a probe's clear() may fail, and counts
        report = self._build(requests, captures, time.perf_counter() - t0, explanation,
                             coverage_)
        self._done.clear()  # the report holds them now
        self._state = "finalized"
        self._report = report
        if strict and not report.ok:
            raise FidelityError(report)
        return report

    def _finalize_group(self, coll: Collective, strict: bool, explain: bool,
                        progress: ProgressCallback | None) -> CaptureReport:
        """``finalize()`` as a collective: see ``_collective``."""
        self.close()
        obs = self._observation
        everything = obs.requests()
        requests = [r for r in everything if any(m.completed for m in r.members)]
        modules = obs.member_modules()
        baseline_probes = _baseline_probes()
        bar = Progress(len(requests), 0, progress)
        net = Baseline()

        def capture(request: VariantRequest) -> list[Capture | CaptureFailure]:
            self._leaks.clear()
            self._capture(request, modules, baseline_probes, net)
            return [self._done.pop((request.scope, request.variant)), *self._leaks]

        def explain_mine(captures: list[Capture]) -> Any:
            from ..report.explain import explain_captures

            return explain_captures(captures, modules, self.options)

        with self._finalizing(bar, net):
            outcome = finalize_group(
                coll, requests, [obs.identity_value(r) for r in requests], self.options,
                capture, lambda: coverage(obs, everything, [], self.options, whole=False),
                lambda: self._counts(), modules, baseline_probes,
                explain_mine if explain else None, bar.step)
        self._release()
        report = CaptureReport(outcome.captures, outcome.failures, self.options.probe_names,
                               self.options.to_json(), outcome.dropped, outcome.errors,
                               max(outcome.seconds), problems=outcome.problems,
                               notices=outcome.notices, options=self.options,
                               retained=outcome.retained, distributed=outcome.info)
        from ..report.explain import Explanation

        if outcome.explanations:
            report._keep(Explanation(outcome.explanations))
        self._state = "finalized"
        self._report = report
        if strict and not report.ok:
            raise FidelityError(report)
        return report

    @contextmanager
    def _finalizing(self, bar: Progress, net: Baseline) -> Iterator[None]:
        try:
            yield
        except BaseException:
            # a Ctrl-C: let go of every module and live state now; what was
            # captured stays, and a second finalize() reports the rest
            self._state = "interrupted"
            self._release()
            raise
        finally:
            bar.close()
            net.restore()

    def _counts(self) -> dict[str, Any]:
        obs = self._observation
        return {"errors": dict(obs.shared.errors),
                "dropped": obs.dropped(),
                "retained": obs.shared.retention.summary()}

    def _capture(self, request: VariantRequest, modules: dict[str, nn.Module],
                 baseline_probes: tuple[ContextProbe[Any], ...], net: Baseline) -> None:
        failure: CaptureFailure | None = None
        try:
            result: Capture | CaptureFailure = capture_variant(
                request, modules, self.options, baseline=baseline_probes,
                defer_collectives=active_group(self.options.group) is not None)
        except CaptureFailed as f:
            result = failure = f.failure
        except Exception as exc:  # an engine bug must not cost the other variants
            result = failure = CaptureFailure(request.scope, request.variant,
                                              self.backend.name, "internal_error",
                                              type(exc).__name__)
        finally:
            leaked = net.restore()
        self._done[(request.scope, request.variant)] = result
        # an abandoned capture thread holds its replay until its backend
        # returns: expected after a timeout, not a leak
        if leaked and (failure is None or failure.reason != "timeout"):
            self._leaks.append(CaptureFailure(request.scope, request.variant,
                                              self.backend.name, "state_leak", "-", (),
                                              leaked))

    def _captures(self, requests: list[VariantRequest]) -> list[Capture]:
        out = []
        for r in requests:
            done = self._done.get((r.scope, r.variant))
            if isinstance(done, Capture):
                out.append(done)
        return out

    def _build(self, requests: list[VariantRequest], captures: list[Capture], seconds: float,
               explanation: Any,
               coverage_: tuple[tuple[Problem, ...], tuple[Notice, ...]]) -> CaptureReport:
        failures: list[CaptureFailure] = []
        for r in requests:
            done = self._done.get((r.scope, r.variant))
            if isinstance(done, CaptureFailure):
                failures.append(done)
        failures += self._leaks
        obs = self._observation
        problems, notices = coverage_
        dropped = obs.dropped()
        errors = tuple((w, t, n) for (w, t), n in sorted(obs.shared.errors.items()))
        report = CaptureReport(tuple(captures), tuple(failures), self.options.probe_names,
                               self.options.to_json(), dropped, errors, seconds,
                               problems=problems, notices=notices, options=self.options,
                               retained=obs.shared.retention.summary())
        if explanation is not None:
            report._keep(explanation)
        return report

    def _release(self) -> None:
        interrupt: BaseException | None = None
        for p in self.probes:
            try:
                p.clear()
            except Exception as exc:
                self._observation.shared.error("clear", exc)
            except BaseException as exc:  # a Ctrl-C: the rest still let go, then it goes on
                interrupt = interrupt or exc
        self._observation.release()
        self._observer.invalidate()
        if self._state != "interrupted":
            self._state = "finalized"
        if interrupt is not None:
            raise interrupt


def _baseline_probes() -> tuple[ContextProbe[Any], ...]:
    try:
        return resolve_probes(None)
    except Exception:  # a broken registry must not break finalize
        return ()


def _describe_targets(targets: object) -> str:
    if targets is None or isinstance(targets, str):
        return str(targets)
    if callable(targets):
        return "predicate"
    return "names"


def capture_with(module: nn.Module, *, probes: Sequence[str | ContextProbe[Any]] | None = None,
                 targets: str | Sequence[str] | Callable[[str, nn.Module], bool] | None = None,
                 backend: str | Backend = "auto",
                 replay: str = "embedded", verify: str = "signature", max_variants: int = 8,
                 max_scopes: int = 64, profile_ranges: bool = False,
                 capture_timeout: float | None = None, pin_factories: bool = True,
                 watch: str = "forward", retain_bytes: int = 256 << 20,
                 ignore_attributes: Sequence[str] = (), group: Any = None) -> CaptureSession:
    """Observe ``module`` (or the chosen ``targets`` inside it) from now on,
    and capture each observed variant on ``finalize()``.

    Args:
        module: the model whose forward is profiled live.
        probes: names or probe instances (``None``: the default set); an
            unknown name fails here, listing the known ones.
        targets: ``None`` (the module itself), ``"repeated"`` (the members of
            every homogeneous ``nn.ModuleList``, and of every
            ``nn.Sequential`` of two or more blocks of one class), qualified
            names, or a predicate ``(name, module) -> bool``.  Members share a
            capture only when class, shapes, ``training`` and plain
            attributes agree.
        backend: ``"auto"`` (export, then dynamo, then symbolic),
            ``"export"``, ``"dynamo"``, ``"symbolic"`` or a backend object.
        replay: ``"embedded"`` (traceable probe contexts inside the captured
            callable, the rest around it), ``"ambient"`` (everything around
            it) or ``"off"`` (no replay: the unfaithful baseline).
        verify: ``"signature"`` (graph metadata against each member's live
            outputs), ``"execute"`` (also run the artifact with each member's
            weights, from a neutral state, and compare with the member), or
            ``"values"`` (also compare with retained copies of each member's
            first live call, by value), or ``"off"``.
        max_variants: variants kept per structure; calls of more are counted
            and make the report not ok (``variant_limit``).
        max_scopes: structures observed; more are counted (``scope_limit``).
        profile_ranges: wrap each observed call in a
            ``torch.profiler.record_function`` range named after its variant
            (``"ctxreplay:blocks.0#1"``), so a profiler trace shows which
            variant every block call was; off by default (it costs a range
            per call).
        capture_timeout: seconds one variant's capture may take (``None``: no
            limit; must be > 0).  A capture that takes longer is a
            ``CaptureFailure`` with reason ``timeout`` and the next variant is
            captured; its thread is abandoned, not killed.
        pin_factories: write the replayed default dtype and device into
            factory calls of the graph, so the artifact carries them.
        watch: ``"forward"`` checks numerics-only flags (cuDNN, TF32,
            per-backend float32 precision) once per call of ``module``;
            ``"call"`` checks them on every block call (slower).
        retain_bytes: memory cap for ``verify="values"`` copies.
        ignore_attributes: attribute names left out of a member's identity
            (e.g. a step counter the forward increments).
        group: a ``torch.distributed`` process group.  When one is given, or
            the default group is initialised with more than one rank,
            ``finalize()`` is a collective over it: every distinct variant is
            captured once across the ranks, and every rank gets the same
            merged report.  ``capture_timeout`` (else the group's timeout)
            also bounds how long it waits for the other ranks.

    Returns:
        The open :class:`CaptureSession`: use it as a context manager, then
        call ``finalize()``.

    Raises:
        ValueError: an unknown option value, probe or target name.
        TypeError: ``module`` is not an ``nn.Module``.

    Calls that run inside a ``torch.compile``d region are not observed: they
    are counted, and the report is not ok (problem ``not_observed``).  Pass
    the uncompiled module and compile afterwards.

    Example:
        ```python
        with ctxreplay.capture_with(model, targets="repeated") as session:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                model(x)                  # live: observed, cheaply
        report = session.finalize()       # captured now, under the replayed context
        ```
    """
    options = CaptureOptions(
        probes=resolve_probes(probes), backend=get_backend(backend),
        targets=_describe_targets(targets), replay=replay, verify=verify,
        max_variants=max_variants, max_scopes=max_scopes, profile_ranges=profile_ranges,
        capture_timeout=capture_timeout, pin_factories=pin_factories, watch=watch,
        retain_bytes=retain_bytes, ignore_attributes=tuple(ignore_attributes), group=group)
    return CaptureSession(module, options, targets)

