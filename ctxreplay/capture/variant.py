"""Capturing one variant: isolate, materialise, replay, trace, check, record.

``capture_variant(ask, tracing)`` is the one capture call of a finalize: it
traces the request's first completed member on an isolated view of it
(``capture.isolate``) under the variant's replayed context
(``capture.trace``) -- or takes the artifact the ask brings from the
capture cache -- has a ``checker.Checker`` run the artifact against every
member that ran the variant, and records the result: it returns a
``Capture`` or raises ``CaptureFailed`` carrying a ``CaptureFailure``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from typing import Any

import attrs
from torch import nn

from ..backends import AutoBackend, Backend, ExportBackend
from ..backends.dtensor import holds_dtensors
from ..backends.passes import graph_code, graph_op_args, graph_ops, has_collectives
from ..fidelity.levels import level
from ..fidelity.verify import Fidelity, Mismatch, is_neutral, neutral_replay
from ..specs.baked import Baked
from ..specs.baked import Source as Place
from ..specs.frozen import may_change_in_python
from ..specs.signature import CallSpec, ConstSpec, Spec, TensorSpec, children
from ..specs.specjson import call_to_json
from .asking import Ask, Kin, Source, Tick, Tracing
from .assigned import Assigned
from .baked import baked_of
from .checker import Checker, Program
from .failed import CaptureFailed, failure, with_context
from .isolate import HookedWeights, isolated
from .mutation import ARGUMENT_FIELD, Mutation, with_mutations
from .options import CaptureOptions, MemberCall, VariantRequest
from .reads import Reads
from .restore import restore_state
from .results import Capture, capture_of
from .roles import output_roles
from .trace import TracePlan, trace

__all__ = ["READ_FIELD", "Ask", "CaptureFailed", "Kin", "Source", "Tick", "Tracing",
           "capture_variant", "recapture"]


def capture_variant(ask: Ask, tracing: Tracing) -> Capture:
    """Capture ``ask.request``'s variant (see ``Ask`` and ``Tracing``), from
    the state a fresh process has (inputs made under the caller's
    ``inference_mode`` would be inference tensors), whatever the caller of
    ``finalize()`` has active; or raise ``CaptureFailed``."""
    request = ask.request
    try:
        neutral = neutral_replay(request.snapshot, tracing.neutral_probes, only_neutral=True)
        neutral.__enter__()
    except Exception as exc:  # a probe's replay may raise anything: failure() logs it
        raise failure(request, tracing.options.backend, "replay_failed", exc) from None
    try:
        return _VariantCapture(ask, tracing).run()
    finally:
        neutral.__exit__(None, None, None)


@attrs.define(eq=False)
class _Traced:
    """An artifact, the output spec its graph gives, the backend that made it."""

    artifact: Any
    graph_outputs: Spec | None
    real: Backend


class _VariantCapture:
    """One ``capture_variant``: its steps as methods over the ask, the
    finalize's ``Tracing``, the trace plan and the failure maker."""

    def __init__(self, ask: Ask, tracing: Tracing) -> None:
        self.t0 = time.perf_counter()
        self.ask, self.tracing = ask, tracing
        self.request, self.options = ask.request, tracing.options
        self.fail = functools.partial(failure, ask.request, tracing.options.backend)
        self.plan: TracePlan | None = None

    def run(self) -> Capture:
        request, fail = self.request, self.fail
        module = self.tracing.modules.get(request.traced.name)
        if module is None:
            raise fail("module_released", None)
        layouts = _layouts(request.inputs)
        if layouts:
            raise with_context(fail("unsupported_layout", None), layouts)
        plan = self.plan = self._plan(module)
        served: list[tuple[VariantRequest, Fidelity, float]] = []
        with _view(module, request, fail) as view:
            traced = self._artifact(plan, view)
            baked = _baked(plan, view)
            embedded, carried, ambient_only = _context_split(request, plan, self.options,
                                                             traced.real)
            gm = traced.real.graph_module(traced.artifact)
            plan.watch.constants(traced.artifact, gm)  # a cache's tensor baked in: not ok
            collective = gm is not None and has_collectives(gm)
            program = Program(traced.real, traced.artifact, traced.graph_outputs, plan.binding,
                              plan.flatten_out, carried, ambient_only, plan.covered())
            fidelity, alone = self._verify(program, view, collective)
            kin = self.ask.kin
            if kin is not None and alone and fidelity.ok and _python_export(traced.real,
                                                                             first=False):
                served = self._serve(kin, program, view)
        capture = self._record(traced, fidelity, (embedded, ambient_only), collective, baked)
        if kin is not None:
            kin.served.update((o.variant, _served(capture, o, f, s)) for o, f, s in served)
        return capture

    def _plan(self, module: nn.Module) -> TracePlan:
        """How the variant is traced, recording the attributes the trace
        reads where a fold or kin needs them (a non-strict export only)."""
        ask, options = self.ask, self.options
        trial = ask.fold
        try:
            # torch.export of a tensor-parallel module under a context wrapper
            # fails its own verifier ("dtensor_const_func_spec0 is missing val
            # field"): its contexts are replayed around the trace instead
            plan = TracePlan.make(self.request, options, options.backend,
                                  None if trial is None else trial.dims,
                                  embeds=not holds_dtensors(module.parameters()))
        except Exception as exc:  # a probe's split_replay may raise anything: fail() logs it
            raise self.fail("replay_failed", exc) from None
        # (recorded for every trace: what it read beside its arguments and
        # weights is what its program baked in, which install guards)
        reads = Reads() if trial is None or trial.reads is None else trial.reads
        if reads is not None and ask.source is None and _python_export(options.backend,
                                                                       first=True):
            plan = attrs.evolve(plan, reads=reads)
        if ask.tick is not None:
            plan = attrs.evolve(plan, tick=ask.tick)
        return plan

    def _artifact(self, plan: TracePlan, view: nn.Module) -> _Traced:
        """The variant's artifact: traced from ``view``, or taken from the ask's source."""
        source = self.ask.source
        if source is None:
            return _Traced(*trace(self.request, plan, view, self.options, self.fail,
                                  self.tracing.neutral_probes))
        try:
            return _Traced(*source(view, plan.binding))
        except Exception as exc:  # a given artifact may fail anyhow: fail() logs it
            raise self.fail("bad_artifact", exc) from None

    def _checker(self, request: VariantRequest, program: Program, view: nn.Module,
                 options: CaptureOptions) -> Checker:
        return Checker(request, options, program, view, self.tracing.neutral_probes)

    def _verify(self, program: Program, view: nn.Module, collective: bool
                ) -> tuple[Fidelity, bool]:
        """The artifact checked against the variant's calls, then the fold's
        run at its other sizes; and whether the graph may run on this rank
        alone (one holding collectives waits for the others where they are
        deferred: it is checked at the signature level here, and the
        distributed finalize runs it on every rank together)."""
        options = self.options
        alone = not (collective and self.tracing.defer_collectives)
        check_options = options
        if not alone and level(options.verify).executes:
            check_options = attrs.evolve(options, verify="signature")

        def checker_for(other: VariantRequest) -> Checker:
            return self._checker(other, attrs.evolve(program, graph_outputs=None), view,
                                 check_options)

        together = not alone and level(options.verify).executes
        fidelity = self._checked(self._checker(self.request, program, view, check_options),
                                 runs="here" if alone else "ranks" if together else "nowhere")
        trial = self.ask.fold
        if trial is not None and alone:
            try:
                trial(program.artifact, checker_for, self.tracing.modules)
            except Exception as exc:  # the folded program runs user code: fail() logs it
                raise self.fail("verify_failed", exc) from None
        return fidelity, alone

    def _checked(self, checker: Checker, *, runs: str) -> Fidelity:
        """The artifact checked against ``checker``'s variant's calls (what the
        trace and the reference runs changed in their arguments included).
        ``runs``: where the member may run -- ``"here"``, only with the other
        ranks (``"ranks"``: a graph holding collectives at a level that
        executes) or ``"nowhere"`` (the same at a level that does not)."""
        plan, modules = self.plan, self.tracing.modules
        assert plan is not None
        try:
            fidelity = checker.run(modules if plan.tick is None else
                                   _Ticking(modules, checker.request, plan.tick))
            unwatched = _unwatched(checker, plan, modules, runs)
        except Exception as exc:  # the checks run the user's module: fail() logs it
            raise self.fail("verify_failed", exc) from None
        unwatched += _moved(checker.request, plan.reads)
        if unwatched:
            fidelity = attrs.evolve(fidelity, ok=False, ok_with_needs=None,
                                    mismatches=(*fidelity.mismatches, *unwatched))
        return with_mutations(fidelity, _uncovered([*plan.watch.found, *checker.watch.found],
                                                   plan.covered()))

    def _serve(self, kin: Kin, program: Program, view: nn.Module
               ) -> list[tuple[VariantRequest, Fidelity, float]]:
        """The variants of ``kin`` the traced graph serves: the trace read none
        of the attributes their members differ in, and the graph passes the
        session's check against each of their members (a failing one is left
        to a trace of its own, never reported from another's graph)."""
        out: list[tuple[VariantRequest, Fidelity, float]] = []
        assert self.plan is not None
        reads = self.plan.reads
        if reads is None or not reads.complete:
            return out
        for other, changed in kin.others:
            # another ``forward`` set on a submodule runs other code: never served
            if any(name == "forward" for _, name in changed) or not reads.untouched(changed):
                continue
            t0 = time.perf_counter()
            try:
                fidelity = self._checked(self._checker(other, program, view, self.options),
                                         runs="here")
            except CaptureFailed:
                kin.refused.add(other.variant)
                continue
            if fidelity.ok:
                out.append((other, fidelity, time.perf_counter() - t0))
            else:
                kin.refused.add(other.variant)
        return out

    def _record(self, traced: _Traced, fidelity: Fidelity,
                contexts: tuple[tuple[str, ...], tuple[str, ...]], collective: bool,
                baked: Baked | None) -> Capture:
        """The ``Capture`` of a checked artifact, with its graph's summary."""
        request, options, plan = self.request, self.options, self.plan
        assert plan is not None
        try:
            ops, op_args, digest, fingerprint = _graph_summary(request, traced.real,
                                                               traced.artifact)
        except Exception as exc:  # a backend's artifact may fail anyhow: fail() logs it
            raise self.fail("bad_artifact", exc) from None
        embedded, ambient_only = contexts
        return capture_of(
            request, options.ignore_attributes,
            graph_outputs=traced.graph_outputs, backend=traced.real.name,
            artifact=traced.artifact, fidelity=fidelity, fingerprint=fingerprint,
            embedded=embedded, ambient_only=ambient_only, binding=plan.binding,
            constants=tuple(p for p, _ in _const_paths(request.inputs)),
            attempts=options.backend.last_attempts, seconds=time.perf_counter() - self.t0,
            ops=ops, collective=collective, graph_digest=digest, op_args=op_args,
            from_cache=self.ask.source is not None, assigned=plan.covered(), baked=baked,
            output_roles=output_roles(traced.artifact, request.inputs, request.outputs,
                                      plan.covered(), plan.binding, plan.flatten_out))


class _Ticking(Mapping[str, nn.Module]):
    """``modules`` as a checker reads them, telling ``tick`` each member it
    looks up: a checker looks a member's module up as it starts that
    member's check (a progress bar moves per member, not per variant)."""

    def __init__(self, modules: Mapping[str, nn.Module], request: VariantRequest,
                 tick: Tick) -> None:
        self.modules, self.request, self.tick = modules, request, tick

    def __getitem__(self, name: str) -> nn.Module:
        module = self.modules[name]
        with suppress(Exception):  # progress must not cost a check
            self.tick(self.request, name)
        return module

    def __iter__(self) -> Iterator[str]:
        return iter(self.modules)

    def __len__(self) -> int:
        return len(self.modules)


#: ``Mismatch.field`` of a place the trace read whose state changed between
#: the member's live calls: the graph holds one value of it
READ_FIELD = "read_state"


def _moved(request: VariantRequest, reads: Reads | None) -> list[Mismatch]:
    """A mismatch per place a member's code reads (``MemberCall.moved``) that
    held something else on some of its live calls, where the trace read it
    (all of them where the trace's reads are not known)."""
    read = reads.read() if reads is not None and reads.complete else None
    out = []
    for m in request.members:
        for place, times in m.moved:
            if read is not None and not _was_read(place, read):
                continue
            out.append(Mismatch(place.where(), READ_FIELD, f"changed between calls: {times}x",
                                "baked: one value", "values", None, (m.name,)))
    return out


def _was_read(place: Place, read: Mapping[str, set[str] | None]) -> bool:
    """Whether the trace read the attribute ``place`` starts at (a global:
    always, its code loads it; a submodule the trace did not know: assumed)."""
    if place.global_ or place.base not in read:
        return True
    names = read[place.base]
    return names is None or str(place.steps[0][1]) in names


def _baked(plan: TracePlan, view: nn.Module) -> Baked | None:
    """What the trace baked in (``None``: its reads were not noted -- a
    Dynamo trace, a program the capture cache gave)."""
    reads = plan.reads
    if reads is None or not reads.paths:
        return None
    try:
        return baked_of(view, reads)
    except Exception:  # a value that refuses to be looked at: nothing guarded is known
        return Baked((), complete=False)


def _python_export(backend: Backend, *, first: bool) -> bool:
    """Whether ``backend`` traces (``first``: tries first) with a non-strict
    ``torch.export``: the forward's Python runs once, each attribute read
    a real read (Dynamo interprets the bytecode instead)."""
    if first and isinstance(backend, AutoBackend):
        backend = backend.backends[0] if backend.backends else backend
    return isinstance(backend, ExportBackend) and not backend.strict


def _served(capture: Capture, other: VariantRequest, fidelity: Fidelity,
            seconds: float) -> Capture:
    """``capture`` (its graph, weights and summary) as the record of the
    variant ``other`` it serves: the same scope, context and signature, its
    own members, calls, outputs and check."""
    return attrs.evolve(
        capture, members=tuple(m.name for m in other.members), variant=other.variant,
        outputs=other.outputs, calls=other.calls, fidelity=fidelity, seconds=seconds,
        member_calls=tuple((m.name, m.calls) for m in other.members),
        identities=tuple((m.name, other.identity) for m in other.members if other.identity))


def _unwatched(checker: Checker, plan: TracePlan, modules: Mapping[str, nn.Module],
               runs: str) -> list[Mismatch]:
    """Where no run of the forward was watched (Dynamo traced it, and the
    level runs nothing) and its inputs hold what it could change in Python,
    one run of the member with its arguments watched; what it finds lands
    in ``checker.watch``, and a run that could not happen is a mismatch.  A
    graph holding collectives is run only with the other ranks: at a level
    that executes they watch it together, else it stays unwatched."""
    if plan.watch.runs or checker.watch.runs or not may_change_in_python(checker.request.inputs):
        return []
    if runs == "here":
        return checker.watch_arguments(modules)
    if runs == "ranks":
        return []  # the ranks' run together watches it
    return [Mismatch("out", "execution", "the run watching its arguments",
                     "not run: its graph holds collectives (verify='execute' runs it with "
                     "the other ranks)", ARGUMENT_FIELD)]


@contextmanager
def _view(module: nn.Module, request: VariantRequest,
          fail: Callable[..., CaptureFailed]) -> Iterator[nn.Module]:
    """The isolated view of ``module`` every trace and run of the variant
    uses, holding the attribute values its calls ran with."""
    try:
        view_cm = isolated(module, request.training)
        view = view_cm.__enter__()
    except HookedWeights as exc:
        raise fail("hooked_weights", exc) from None
    except Exception as exc:  # copying the user's module may raise anything: fail() logs it
        raise fail("isolation_failed", exc) from None
    placeholders = _meta_weights(view, request)
    if placeholders:
        view_cm.__exit__(None, None, None)
        raise fail("hooked_weights", HookedWeights(
            f"{', '.join(placeholders[:3])} {'is' if len(placeholders) == 1 else 'are'} on the "
            "meta device between calls, and no hook ctxreplay can follow puts the weights in "
            "place (accelerate's and diffusers' offloading hooks are followed)")) from None
    try:
        try:
            restore_state(view, request.state)
        except Exception as exc:  # setting user attributes runs their code: fail() logs it
            raise with_context(fail("state_not_restorable", exc),
                                {"attribute": str(exc)}) from None
        yield view
    finally:
        view_cm.__exit__(None, None, None)


def _meta_weights(view: nn.Module, request: VariantRequest) -> list[str]:
    """The view's parameters and buffers on the ``meta`` device, where the call's
    inputs are not (a forward that only checks shapes runs on ``meta`` throughout)."""
    if any(s.device == "meta" for _, s in request.inputs.leaves()):
        return []
    out = [n for n, p in view.named_parameters() if p.device.type == "meta"]
    return out + [n for n, b in view.named_buffers() if b.device.type == "meta"]


def _context_split(request: VariantRequest, plan: TracePlan, options: CaptureOptions,
                   real: Backend) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """Where each probe's state lives for the artifact ``real`` produced:
    ``(embedded, carried, ambient_only)`` -- the probes replayed inside the
    graph (none when ``real`` records no embedded context), those the
    artifact carries itself (embedded and not also ambient, plus the pinned
    factory defaults and the baked probes' states), and the non-neutral ones
    that must be re-established around it wherever it runs."""
    embedded, ambient = plan.embedded, plan.ambient
    if embedded and not real.records_embedded:  # the artifact carries none of them
        embedded, ambient = (), request.snapshot.names
    pinned = tuple(p.name for p in request.snapshot.probes
                   if (options.pin_factories and p.pinnable)
                   or getattr(p, "baked", False))
    carried = tuple(n for n in embedded if n not in ambient) + pinned
    ambient_only = tuple(
        n for n, p, s in zip(request.snapshot.names, request.snapshot.probes,
                             request.snapshot.states)
        if (n in ambient or n not in embedded) and n not in pinned
        and not is_neutral(p, s))
    return embedded, carried, ambient_only


def _graph_summary(request: VariantRequest, real: Backend, artifact: Any
                   ) -> tuple[tuple[tuple[str, str | None], ...], Any, str, str]:
    """``(ops, op_args, digest, fingerprint)`` of the artifact's graph (empty
    when the backend exposes no graph module)."""
    gm = real.graph_module(artifact)
    ops = graph_ops(gm) if gm is not None else ()
    op_args = graph_op_args(gm) if gm is not None else ()
    digest = hashlib.sha256(graph_code(gm).encode()).hexdigest()[:32] \
        if gm is not None else ""
    fingerprint = _fingerprint(ops, request.inputs, request.snapshot.to_json(), real.name,
                               digest)
    return ops, op_args, digest, fingerprint


def recapture(capture: Capture, module: nn.Module, options: CaptureOptions, *,
              snapshot: Any = None) -> Capture:
    """Capture ``capture``'s variant again from its recorded specs, on
    ``module``, under ``snapshot`` (default: its own; e.g.
    ``capture.snapshot.without(name)``), without verification."""
    member = capture.weights_from or (capture.members[0] if capture.members else "")
    request = VariantRequest(capture.scope, capture.variant,
                             capture.snapshot if snapshot is None else snapshot,
                             capture.signature,
                             (MemberCall(member, capture.calls, capture.outputs, True),))
    return capture_variant(Ask(request),
                           Tracing({member: module}, attrs.evolve(options, verify="off")))


def _layouts(inputs: CallSpec) -> dict[str, str]:
    """Input tensors that are not plain strided ones, by path: a graph traced
    from dense stand-ins would run the dense branch of the forward (sparse
    and nested tensors are neither materialised nor keyed as dense ones)."""
    return {path: spec.layout for path, spec in inputs.leaves() if spec.layout != "strided"}


def _const_paths(inputs: CallSpec) -> Iterator[tuple[str, Spec]]:
    def walk(spec: Spec, path: str) -> Iterator[tuple[str, Spec]]:
        if isinstance(spec, ConstSpec):
            if spec.value is not None:
                yield path, spec
            return
        if isinstance(spec, TensorSpec):
            return
        for sub, child in children(spec) or []:
            yield from walk(child, path + sub)

    for path, spec in inputs.items():
        yield from walk(spec, path)


def _fingerprint(ops: tuple[tuple[str, str | None], ...], inputs: CallSpec,
                 snapshot_json: Any, backend: str, graph: str = "") -> str:
    doc = {"ops": [list(o) for o in ops], "inputs": call_to_json(inputs),
           "snapshot": snapshot_json, "backend": backend, "graph": graph}
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _uncovered(found: list[Mutation], assigned: Assigned | None) -> list[Mutation]:
    """The argument changes the program does not make: those at the paths
    it assigns are its outputs (the checks compared their values with the
    member's own assignments)."""
    if assigned is None:
        return found
    paths = assigned.paths()
    return [m for m in found if m.field != ARGUMENT_FIELD or m.path not in paths]
