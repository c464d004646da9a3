"""Capturing one rank's variants: one capture call, wrapped and driven.

``RankCapture.capture(ask)`` is the one call every capture of a finalize
goes through: ``capture_variant``, wrapped by the capture cache when the
session has one.  ``RankCapture.run(requests)`` drives it: each family of
size variants is folded first (``capture.fold.FamilyFold`` hands out the
trials, each one ``capture(Ask(example, fold=trial))``), then each variant
not folded is captured on its own (``capture(Ask(request, kin=...))``), its
graph serving the variants of other identities that differ only in
attributes its trace never read.  After each capture the safety net puts
back any ambient state it left changed, and says so.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from ..cache.use import CaptureCache
from ..capture.asking import Ask, Kin, Tracing
from ..capture.failed import CaptureFailed
from ..capture.fold import FamilyFold, Trial, families, folds
from ..capture.options import VariantRequest
from ..capture.reads import Reads
from ..capture.results import Capture, CaptureFailure
from ..capture.variant import capture_variant
from ..observation.targets import changed_attributes
from ..specs.dims import size_free
from .finalizing import Finalizing
from .progress import FinalizeProgress
from .safetynet import SafetyNet

__all__ = ["RankCapture", "Result"]

_log = logging.getLogger("ctxreplay")

Result = Capture | CaptureFailure
#: ``(variant's request, its identity)`` of the variants of one kin
_Group = Sequence[tuple[VariantRequest, Any]]


@attrs.define(eq=False)
class RankCapture:
    """This rank's captures of one finalize.  ``job.done`` holds each
    variant's results as it is captured (kept across an interrupted
    finalize); ``labels`` names variants as the merged report does."""

    job: Finalizing
    tracing: Tracing
    net: SafetyNet
    bar: FinalizeProgress
    cache: CaptureCache | None = None
    labels: Mapping[tuple[str, int], str] = attrs.Factory(dict)
    identities: dict[int, Any] = attrs.Factory(dict)
    #: variants a graph of their kin did not pass the check of
    refused: set[tuple[str, int]] = attrs.Factory(set)

    def capture(self, ask: Ask) -> Capture:
        """The one capture call: through the cache when there is one."""
        if self.cache is None:
            return capture_variant(ask, self.tracing)
        return self.cache.capture(ask, self.tracing)

    def run(self, requests: Sequence[VariantRequest]
            ) -> list[tuple[VariantRequest, Result]]:
        """Each of ``requests``' results (those an interrupted finalize
        already captured are kept): the variants of a family that differ
        in sizes only folded where they can be, the rest one by one."""
        job = self.job
        identity = job.observation.identity_values()
        self.identities = {id(r): identity(r) for r in requests if r.identity_number >= 0}
        groups = families(requests) if folds(job.options) else [[r] for r in requests]
        kin = _kin(requests, self.identities, _same_call)
        # the variants a fold may serve: other identities' variants of its family
        # but for sizes (not through the cache, whose fold entries hold one family)
        sizes = _kin(requests, self.identities, _same_family) if self.cache is None else {}
        out: list[tuple[VariantRequest, Result]] = []
        try:
            for group in groups:
                self._fold(group, sizes.get(id(group[0]), ()))
                for request in group:
                    self._each(request, kin.get(id(request), ()))
                    out += [(request, r) for r in job.done[(request.scope, request.variant)]]
        finally:
            self.bar.close()
        return out

    def _label(self, request: VariantRequest) -> str:
        where = (request.scope, request.variant)
        return self.labels.get(where, f"{request.scope}#{request.variant}")

    def _tick(self, request: VariantRequest, member: str) -> None:
        self.bar.checked((request.scope, request.variant), f"{self._label(request)} {member}")

    # -- one variant at a time ---------------------------------------------------------

    def _each(self, request: VariantRequest, group: _Group) -> None:
        """Capture ``request`` unless done, and record the kin its graph served."""
        job, where = self.job, (request.scope, request.variant)
        if where in job.done:
            return
        others = self._kin_of(request, group)
        job.done[where] = self._one(request, others)
        made = any(isinstance(r, Capture) for r in job.done[where])
        self.bar.finished(where, self._label(request), graph=made, served=False)
        self.refused.update((request.scope, v) for v in others.refused)
        for other, _ in others.others:
            served = others.served.get(other.variant)
            if served is not None:  # checked against its members, no trace
                job.done[(other.scope, other.variant)] = [served]
                self.bar.finished((other.scope, other.variant), self._label(other),
                                  graph=False, served=True)

    def _kin_of(self, request: VariantRequest, group: _Group) -> Kin:
        """The variants of ``request``'s kin not captured yet (nor refused by
        another graph of the kin) whose identity differs from its own in
        plain attributes alone, with those attributes."""
        mine = next((i for r, i in group if r is request), None)
        others: list[tuple[VariantRequest, frozenset[tuple[str, str]]]] = []
        for r, identity in group:
            where = (r.scope, r.variant)
            if r is request or where in self.job.done or where in self.refused \
                    or mine is None or identity is None:
                continue
            changed = _changed(mine, identity)
            if changed is not None:
                others.append((r, changed))
        return Kin(others)

    def _one(self, request: VariantRequest, kin: Kin) -> list[Result]:
        """One variant's capture, or why it failed; and a ``state_leak``
        failure when it left the ambient state changed (the safety net put
        it back).  Its kin is served only where the run leaked nothing."""
        backend = self.job.options.backend.name
        if self.job.interrupted:  # nothing is held any more
            return [CaptureFailure(request.scope, request.variant, backend, "interrupted", "-")]
        failure: CaptureFailure | None = None
        try:
            result: Result = self.capture(Ask(request, kin=kin, tick=self._tick))
        except CaptureFailed as f:
            result = failure = f.failure
        except Exception as exc:  # an engine bug must not cost the other variants
            _log.debug("capture of %s#%d failed: internal_error", request.scope,
                       request.variant, exc_info=True)
            result = failure = CaptureFailure(request.scope, request.variant, backend,
                                              "internal_error", type(exc).__name__)
        finally:
            leaked = self.net.restore()
        # an abandoned capture thread holds its replay until its backend
        # returns: expected after a timeout, not a leak
        if leaked:  # its checks ran in that state: not served
            kin.served.clear()
        if leaked and (failure is None or failure.reason != "timeout"):
            return [result, CaptureFailure(request.scope, request.variant, backend,
                                           "state_leak", "-", (), leaked)]
        return [result]

    # -- folds ----------------------------------------------------------------------------

    def _fold(self, group: list[VariantRequest], sized: _Group) -> None:
        """Fold the variants of ``group`` (one family) not captured yet, and
        those of ``sized`` (other identities' variants of the family) its
        trace may serve.  Tracing with the other identities' variants goes
        first; where every fold tried went to their examples, whose traces
        read what they differ in, this family's own fold is still due."""
        job = self.job
        todo = [r for r in group if (r.scope, r.variant) not in job.done]
        if len(todo) < 2 or job.interrupted:
            return
        mine = {id(r) for r in group}
        extra = [r for r, _ in sized if id(r) not in mine and (r.scope, r.variant) not in job.done]
        examples = self._fold_family(todo + extra, bool(extra))
        rest = [r for r in group if (r.scope, r.variant) not in job.done]
        if extra and len(rest) >= 2 and not any(id(r) in mine for r in examples):
            self._fold_family(rest, False)

    def _fold_family(self, family: list[VariantRequest], mixed: bool) -> list[VariantRequest]:
        """Fold ``family`` (``mixed``: of several identities); each folded
        capture is recorded under its example, the variants it stands for as
        done with nothing of their own.  Returns the examples traced."""
        fold = FamilyFold(family, self.job.options)
        examples: list[VariantRequest] = []
        while (trial := fold.next()) is not None:
            examples.append(trial.example)
            try:
                capture: Capture | None = self._fold_once(trial, mixed)
            except Exception:  # (CaptureFailed) the variants are captured one by one
                capture = None
            fold.took(trial, capture)
        for c in fold.made:
            self._folded_done(c)
        return examples

    def _fold_once(self, trial: Trial, mixed: bool) -> Capture:
        """``trial``'s capture; a fold that leaks state is not used.  With
        other identities in the family, the graph runs at their sizes only
        where the trace read none of the attributes they differ in."""
        if mixed:
            mine = self.identities.get(id(trial.example), ())
            trial.others = {id(r): _changed(mine, self.identities.get(id(r)))
                            for r in trial.pending
                            if r.identity_number != trial.example.identity_number}
            trial.reads = Reads()
        request = trial.example
        try:
            return self.capture(Ask(request, fold=trial))
        finally:
            if self.net.restore():
                raise CaptureFailed(CaptureFailure(request.scope, request.variant,
                                                   self.job.options.backend.name,
                                                   "state_leak", "-"))

    def _folded_done(self, c: Capture) -> None:
        """A folded capture recorded under its example, the variants it
        stands for as done with nothing of their own."""
        self.job.done[(c.scope, c.variant)] = [c]
        for v in c.folded:
            self.job.done[(c.scope, v)] = []
        for v in (c.variant, *c.folded):
            self.bar.finished((c.scope, v), f"{c.scope}#{v}", graph=v == c.variant,
                              served=v != c.variant)


def _changed(mine: Any, other: Any) -> frozenset[tuple[str, str]] | None:
    """The (submodule path, attribute) pairs two identities differ in, where
    they differ in plain attributes alone (``None``: not comparable)."""
    if other is None:
        return None
    try:
        changed = changed_attributes(mine, other)
    except Exception:  # a user value's == may raise anything: not comparable
        return None
    return None if changed is None else frozenset(changed)


def _same_call(r: VariantRequest) -> Any:
    return (r.scope, r.snapshot, r.training, r.inputs, r.outputs)


def _same_family(r: VariantRequest) -> Any:
    return (r.scope, r.snapshot, r.training, size_free(r.inputs), size_free(r.outputs))


def _kin(requests: Sequence[VariantRequest], identities: Mapping[int, Any],
         key: Callable[[VariantRequest], Any]) -> dict[int, _Group]:
    """For each request (by ``id``), the requests of its ``key`` -- of its
    scope, context, training flags, and input and output signature
    (``_same_call``) or the same but for sizes (``_same_family``) -- that
    are of more than one identity, each with its identity: a trace of one
    may serve the others (``capture.asking.Kin``)."""
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
    out: dict[int, _Group] = {}
    for group in groups.values():
        if len({r.identity_number for r, _ in group}) > 1:
            for r, _ in group:
                out[id(r)] = tuple(group)
    return out
