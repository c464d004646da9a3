"""The engine: ``capture_with`` observes cheaply during the live forward,
``finalize()`` captures every variant afterwards.

The engine never names a concrete probe: it only calls the probe contract.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import attrs
from torch import nn

from ..backends import Backend, get_backend
from ..capture.options import RETAIN_BYTES, CaptureOptions
from ..core.observer import Observer
from ..core.probe import ContextProbe
from ..core.registry import resolve_probes
from ..errors import Error
from ..fidelity.levels import DEFAULT as DEFAULT_LEVEL
from ..observation.attach import Observation
from ..observation.targets import beneath_step_caches, resolve_targets
from ..observation.variants import Scope, VariantView
from ..report.capture_report import CaptureReport, FidelityError
from ..report.ranks import Alone, Exchange, active_group
from .pipeline import Finalizing, ProgressCallback, run_finalize
from .safetynet import SafetyNet

__all__ = ["CaptureSession", "SessionError", "capture_with"]

Targets = str | Sequence[str] | Callable[[str, nn.Module], bool] | None


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
        # a probe of per-model state reads this model's (``ContextProbe.bind``)
        options = attrs.evolve(options, probes=tuple(p.bind(module) for p in options.probes))
        self.options = options
        """Every setting of the session, validated (``capture_with``'s arguments)."""
        self._observer = Observer(options.probes, per_call=options.watch == "call")
        members, inside = beneath_step_caches(resolve_targets(module, targets))
        self._observation = Observation(module, members, observer=self._observer,
                                        options=options, step_cache_inside=inside)
        self._state = "open"
        self._job = Finalizing(self._observation, self._observer, options)
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

        In a ``torch.distributed`` job (see ``capture_with(group=...)``) it is
        a collective: every rank must call it, and every rank gets the same
        merged report.  A single process runs the same steps as a group of
        one.

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
            DistributedError: ranks missing or disagreeing (a distributed job).
        """
        if self._report is not None:
            raise SessionError("finalize() already completed for this session: it detached "
                               "then, so no call since was observed; its report is "
                               "session.report. Open a new session with "
                               "ctxreplay.capture_with(...) to capture more")
        group = active_group(self.options.group)
        exchange: Exchange = Alone() if group is None else _rank_group(group)
        self.close()
        # The safety net: whatever a probe's replay, a backend or a capture
        # thread abandoned after ``capture_timeout`` did to the ambient state,
        # each variant starts from -- and the caller gets back -- the state
        # finalize() began with.  It also runs when a KeyboardInterrupt passes.
        net = SafetyNet()
        try:
            report = run_finalize(self._job, exchange, net, explain=explain, progress=progress)
        except BaseException:  # a Ctrl-C: everything released, then re-raised
            # a Ctrl-C: let go of every module and live state now; what was
            # captured stays, and a second finalize() reports the rest
            self._job.interrupted = True
            self._job.release()
            raise
        finally:
            net.restore()
        self._state = "finalized"
        self._report = report
        if report.cache_summary:
            logging.getLogger("ctxreplay").info("finalize: %s", report.cache_summary)
        if strict and not report.ok:
            raise FidelityError(report)
        return report


#: the environment variable a job sets to use a capture cache without code changes
CACHE_ENV = "CTXREPLAY_CACHE"


def _cache_dir(cache: object) -> str | None:
    """``capture_with(cache=...)`` as a directory, or ``None``."""
    if cache is None:
        cache = os.environ.get(CACHE_ENV) or None
        if cache is None:
            return None
    if cache is False:
        return None
    if isinstance(cache, (str, os.PathLike)) and os.fspath(cache):
        path = os.fspath(cache)
        if os.path.exists(path) and not os.path.isdir(path):
            raise ValueError(f"cache: {path!r} exists and is not a directory; expected a "
                             "directory path, None (the CTXREPLAY_CACHE variable) or False")
        return str(path)
    raise ValueError(f"cache: expected a directory path, None (the {CACHE_ENV} variable) or "
                     f"False, got {cache!r}")


def _flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name}: expected True or False, got {value!r}")
    return value


def _describe_targets(targets: object) -> str:
    if targets is None or isinstance(targets, str):
        return str(targets)
    if callable(targets):
        return "predicate"
    return "names"


def capture_with(module: nn.Module, *, probes: Sequence[str | ContextProbe[Any]] | None = None,
                 targets: str | Sequence[str] | Callable[[str, nn.Module], bool] | None = None,
                 backend: str | Backend = "auto",
                 replay: str = "embedded", verify: str = DEFAULT_LEVEL, max_variants: int = 8,
                 max_scopes: int = 64, profile_ranges: bool = False,
                 capture_timeout: float | None = None, pin_factories: bool = True,
                 watch: str = "forward", retain_bytes: int = RETAIN_BYTES,
                 ignore_attributes: Sequence[str] = (), group: Any = None,
                 cache: str | os.PathLike[str] | bool | None = None,
                 fold: bool = True) -> CaptureSession:
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
        verify: ``"sampled"`` (the default: everything ``"execute"`` checks,
            and the artifact run on copies of a sample of live calls -- each
            member's first five calls of each variant and a reservoir of
            four later ones per variant, shared by its members, chosen
            before the call runs -- compared with
            what the live call returned, by value; the calls not sampled
            stay on the fast path), ``"values"`` (the same, with a copy
            taken of every call, so the last call is among those compared),
            ``"execute"`` (run the artifact with each member's weights on
            fresh inputs, from a neutral state, and compare with the
            member), ``"signature"`` (graph metadata against each member's
            live outputs) or ``"off"``.  Only a value check catches state
            no probe observes; a capture whose calls could not be compared
            by value is not ok, and its mismatch says why.
        max_variants: distinct graphs kept per structure: variants that
            differ in tensor sizes only count once (``fold``), and so do
            members that differ in plain attributes only; calls of more are
            counted and make the report not ok (``variant_limit``).
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
        retain_bytes: memory cap for the copies ``"sampled"`` and
            ``"values"`` keep (CPU memory; default 1 GiB, enough for the
            first call of each of 30 blocks of width 1536 at about 2,900
            tokens in float32, inputs and outputs; later samples are given
            up first to make room for a first call).
        ignore_attributes: attribute names left out of a member's identity
            (e.g. a step counter the forward increments).
        group: a ``torch.distributed`` process group.  When one is given, or
            the default group is initialised with more than one rank,
            ``finalize()`` is a collective over it: every distinct variant is
            captured once across the ranks, and every rank gets the same
            merged report.  ``capture_timeout`` (else the group's timeout)
            also bounds how long it waits for the other ranks.
        cache: a directory for the capture cache: ``finalize()`` loads each
            variant whose key matches an entry (checked at ``verify``'s
            level before use) instead of tracing it, and stores each new
            capture that passed its check -- the program only, never
            weights.  ``None``: the directory in the environment variable
            ``CTXREPLAY_CACHE``, if set; ``False``: no cache either way.
        fold: capture the variants of a member that differ in tensor sizes
            only as one graph with dynamic sizes (``torch.export`` dynamic
            shapes; the export backend, in one process): run by value at
            every observed size and kept only where each agrees, claimed
            for the range of sizes observed (``Capture.folding``); sizes it
            does not reproduce are captured one by one.  Not with
            ``verify="off"`` (a fold is only kept once run), nor on torch
            before 2.9, whose exported programs do not check the size guards
            of their trace (a size inside the range that the trace sent down
            another path would run the traced path silently).

    Returns:
        The open :class:`CaptureSession`: use it as a context manager, then
        call ``finalize()``.

    Raises:
        ValueError: an unknown option value, probe or target name.
        TypeError: ``module`` is not an ``nn.Module``.

    A ``torch.compile``d model or block that exists when the session
    attaches (``capture_with(torch.compile(model))``, ``block.compile()``)
    runs uncompiled while observed, so its blocks are observed and captured
    (notice ``compiled_ran_uncompiled``), and compiled again once the session
    closes.  Blocks that run inside a region compiled while the session is
    open are not observed, and the report is not ok (problem
    ``not_observed``).

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
        retain_bytes=retain_bytes, ignore_attributes=tuple(ignore_attributes), group=group,
        cache=_cache_dir(cache), fold=_flag("fold", fold))
    return CaptureSession(module, options, targets)


def _rank_group(group: Any) -> Exchange:
    """The exchange over a ``torch.distributed`` group (imported only for a
    job that has one: a single process never loads the distributed machinery)."""
    from ..distributed.exchange import RankGroup

    return RankGroup(group)
