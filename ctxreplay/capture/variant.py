"""Capturing one variant: isolate, materialise, replay, trace, record.

``capture_variant(request, modules, options)`` traces the request's first
completed member on an isolated view of it (``capture.isolate``), under the
variant's replayed context, has a ``checker.Checker`` run the artifact
against every member that ran the variant, and records the result: it
returns a ``Capture`` or raises ``CaptureFailed`` carrying a
``CaptureFailure``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext, suppress
from typing import Any

import attrs
import torch
from torch import nn

from .._base.torchcaps import dynamo_compiling
from ..backends import (
    AutoBackend,
    Backend,
    BackendError,
    ExportBackend,
    classify_exception,
    exception_message,
)
from ..backends.dtensor import holds_dtensors
from ..backends.passes import (
    graph_code,
    graph_op_args,
    graph_ops,
    has_collectives,
    pin_factory_defaults,
)
from ..core.probe import ContextProbe
from ..errors import Error
from ..fidelity.levels import level
from ..fidelity.verify import Fidelity, Mismatch, is_neutral, neutral_replay
from ..specs.dims import concrete
from ..specs.frozen import may_change_in_python
from ..specs.materialize import inputs_for, materialize_leaves
from ..specs.signature import (
    CallSpec,
    ConstSpec,
    SeqSpec,
    Spec,
    TensorSpec,
    call_tensors,
    children,
    is_native,
    tensor_values,
)
from ..specs.specjson import call_to_json
from .assigned import Assigned, assigned_by, collect, joined_result
from .checker import Checker
from .isolate import HookedWeights, forward_alone, forward_wrapped, isolated
from .mutation import (
    ARGUMENT_FIELD,
    Mutation,
    MutationLog,
    arguments_state,
    watched,
    with_mutations,
)
from .options import CaptureOptions, MemberCall, VariantRequest
from .reads import Reads, recorded
from .restore import restore_state
from .results import Capture, CaptureFailure, capture_of
from .rngguard import rng_guard
from .worker import WorkerTimeout, run_in_worker

__all__ = ["CaptureFailed", "Kin", "Source", "Tick", "capture_variant", "recapture"]


#: an artifact from elsewhere than a trace (the capture cache): given the
#: isolated view of the traced member and the binding (``"flattened"``: the
#: view sits under ``inner.``), ``(artifact, graph output spec, backend)``
Source = Callable[[nn.Module, str], tuple[Any, "Spec | None", Backend]]

#: ``(request, member name)``: a member's check of ``request`` starts (progress)
Tick = Callable[[VariantRequest, str], None]

#: called once the artifact is checked, while its isolated view is alive:
#: ``(artifact, checker for another request of the same member identity,
#: modules)`` -- a fold runs its graph at the other variants' sizes
After = Callable[[Any, Callable[[VariantRequest], Checker], Mapping[str, nn.Module]], None]


@attrs.define(eq=False)
class Kin:
    """Variants a capture's graph may serve without a trace of their own:
    of its scope, context, training flags and signature, their members
    differing from the traced one's only in plain attributes -- each
    ``(request, the (submodule path, attribute) pairs that differ)``.  A
    variant is served when the trace never read one of those attributes
    (``capture.reads``: they cannot have shaped the graph) and the graph
    passes its own check against every member that ran it, with each
    member's own weights and attributes; ``served`` then holds its
    capture, by variant.  The others are left to a trace of their own;
    ``refused`` names those whose check the graph did not pass (no other
    graph of their kin is tried on them again)."""

    others: Sequence[tuple[VariantRequest, frozenset[tuple[str, str]]]]
    served: dict[int, Capture] = attrs.Factory(dict)
    refused: set[int] = attrs.Factory(set)


class CaptureFailed(Error):
    """Carries a ``CaptureFailure`` out of ``capture_variant``."""

    def __init__(self, failure: CaptureFailure) -> None:
        super().__init__(failure.reason)
        self.failure = failure


class _ReplayFault(Exception):
    pass


class _ArtifactFault(Exception):
    """The backend returned, but no usable artifact: ``reason`` is the code."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@attrs.frozen(eq=False)
class _Plan:
    """How one variant is traced: the replay split and the binding."""

    inside: Callable[[], AbstractContextManager[Any]] | None
    around: AbstractContextManager[None]
    embedded: tuple[str, ...]
    ambient: tuple[str, ...]
    binding: str
    flatten_out: bool
    faults: list[BaseException]
    #: what the traced forward changed in its arguments
    watch: MutationLog = attrs.field(factory=MutationLog)
    #: leaf index -> dimensions traced as dynamic sizes (a fold); empty: fixed
    dims: Mapping[int, tuple[int, ...]] = attrs.field(factory=dict)
    #: what the trace read of the view's attributes (``None``: not recorded)
    reads: Reads | None = None
    #: told as each member's check of a request starts (progress)
    tick: Tick | None = None
    #: what the traced forward assigned to its argument objects, returned
    #: beside its outputs (set by the last trace of a flattened call)
    assigned: list[Assigned] = attrs.field(factory=list)

    def covered(self) -> Assigned | None:
        return self.assigned[-1] if self.assigned else None

    @classmethod
    def make(cls, request: VariantRequest, options: CaptureOptions,
             backend: Backend, dims: Mapping[int, tuple[int, ...]] | None = None,
             *, embeds: bool = True) -> _Plan:
        snap = request.snapshot
        if options.replay == "off":
            inside = None
            around: AbstractContextManager[None] = nullcontext()
            embedded: tuple[str, ...] = ()
            ambient = snap.names
        else:
            embed = options.replay == "embedded" and backend.records_embedded and embeds
            factory, around, embedded, ambient = snap.replay_parts(embedded=embed)
            inside = factory if embedded else None
        outputs_native = request.outputs is None or is_native(request.outputs)
        binding = "native" if request.inputs.is_pytree_native() and outputs_native \
            else "flattened"
        faults: list[BaseException] = []
        return cls(None if inside is None else _guard_inside(inside, faults), around,
                   embedded, ambient, binding, not outputs_native, faults,
                   watch=MutationLog(ignore=options.ignore_attributes), dims=dims or {})


def capture_variant(request: VariantRequest, modules: Mapping[str, nn.Module],
                    options: CaptureOptions, *,
                    baseline: tuple[ContextProbe[Any], ...] = (),
                    defer_collectives: bool = False, source: Source | None = None,
                    dims: Mapping[int, tuple[int, ...]] | None = None,
                    after: After | None = None, kin: Kin | None = None,
                    tick: Tick | None = None, reads: Reads | None = None) -> Capture:
    """See ``_capture_variant``; it runs from the state a fresh process has
    (inputs made under the caller's ``inference_mode`` would be inference
    tensors), whatever the caller of ``finalize()`` has active."""
    try:
        neutral = neutral_replay(request.snapshot, baseline, only_neutral=True)
        neutral.__enter__()
    except Exception as exc:
        raise _failure(request, options.backend, "replay_failed", exc) from None
    try:
        return _capture_variant(request, modules, options, baseline=baseline,
                                defer_collectives=defer_collectives, source=source, dims=dims,
                                after=after, kin=kin, tick=tick, reads=reads)
    finally:
        neutral.__exit__(None, None, None)


def _capture_variant(request: VariantRequest, modules: Mapping[str, nn.Module],
                     options: CaptureOptions, *,
                     baseline: tuple[ContextProbe[Any], ...] = (),
                     defer_collectives: bool = False, source: Source | None = None,
                     dims: Mapping[int, tuple[int, ...]] | None = None,
                     after: After | None = None, kin: Kin | None = None,
                     tick: Tick | None = None, reads: Reads | None = None) -> Capture:
    """Capture ``request``; ``modules`` maps member names to the live modules
    (never changed: every trace and run uses an isolated view).
    ``source``: where the artifact comes from instead of a trace (the
    capture cache); it is checked exactly as a traced one.
    ``baseline``: probes whose neutral state execution checks start from,
    beside the snapshot's own.  ``defer_collectives``: a graph holding
    collectives is only checked at the signature level here (running it
    alone would wait for the other ranks); ``Capture.collective`` says so,
    and the distributed finalize runs it on every rank together.
    ``dims``: leaf index -> dimensions to trace as dynamic sizes (a fold;
    the backend must fold).  ``kin``: other variants the graph may serve
    (see ``Kin``; fills ``kin.served``).  ``tick``: told as each member's
    check starts.  ``reads``: where the trace notes the attributes it read
    (one is made for ``kin``), for ``after`` to consult (a fold's kin)."""
    t0 = time.perf_counter()
    backend = options.backend
    fail = functools.partial(_failure, request, backend)
    traced = request.traced
    module = modules.get(traced.name)
    if module is None:
        raise fail("module_released", None)
    layouts = _layouts(request.inputs)
    if layouts:
        raise _with_context(fail("unsupported_layout", None), layouts)
    try:
        # torch.export of a tensor-parallel module under a context wrapper
        # fails its own verifier ("dtensor_const_func_spec0 is missing val
        # field"): its contexts are replayed around the trace instead
        plan = _Plan.make(request, options, backend, dims,
                          embeds=not holds_dtensors(module.parameters()))
    except Exception as exc:
        raise fail("replay_failed", exc) from None
    if reads is None and kin is not None and kin.others and not dims:
        reads = Reads()
    if reads is not None and source is None and _python_export(backend, first=True):
        plan = attrs.evolve(plan, reads=reads)
    if tick is not None:
        plan = attrs.evolve(plan, tick=tick)
    served: list[tuple[VariantRequest, Fidelity, float]] = []
    with _view(module, request, fail) as view:
        artifact, graph_outputs, real = _artifact(request, plan, view, options, fail,
                                                  baseline, source)
        embedded, carried, ambient_only = _context_split(request, plan, options, real)
        gm = real.graph_module(artifact)
        plan.watch.constants(artifact, gm)  # a cache's tensor baked in: not ok
        collective = gm is not None and has_collectives(gm)
        alone = not (collective and defer_collectives)  # it may run on this rank alone
        check_options = options
        if not alone and level(options.verify).executes:
            check_options = attrs.evolve(options, verify="signature")

        def checker_for(other: VariantRequest, outputs: Spec | None = None) -> Checker:
            return Checker(other, check_options, real, artifact, view, outputs,
                           binding=plan.binding, flatten_out=plan.flatten_out,
                           carried=carried, baseline=baseline, ambient_only=ambient_only,
                           assigned=plan.covered())

        together = not alone and level(options.verify).executes
        fidelity = _checked(checker_for(request, graph_outputs), plan, modules, fail,
                            after if alone else None, artifact, checker_for,
                            runs="here" if alone else "ranks" if together else "nowhere")
        if kin is not None and alone and fidelity.ok and _python_export(real, first=False):
            served = _serve(kin, plan, modules, options, graph_outputs, checker_for)
    capture = _record(request, options, plan, real, artifact, graph_outputs, fidelity,
                      (embedded, ambient_only), collective, source is not None, t0, fail)
    if kin is not None:
        kin.served.update((o.variant, _served(capture, o, f, s)) for o, f, s in served)
    return capture


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


def _python_export(backend: Backend, *, first: bool) -> bool:
    """Whether ``backend`` traces (``first``: tries first) with a non-strict
    ``torch.export``: the forward's Python runs once, each attribute read
    a real read (Dynamo interprets the bytecode instead)."""
    if first and isinstance(backend, AutoBackend):
        backend = backend.backends[0] if backend.backends else backend
    return isinstance(backend, ExportBackend) and not backend.strict


def _serve(kin: Kin, plan: _Plan, modules: Mapping[str, nn.Module], options: CaptureOptions,
           graph_outputs: Spec | None,
           checker_for: Callable[[VariantRequest, Spec | None], Checker]
           ) -> list[tuple[VariantRequest, Fidelity, float]]:
    """The variants of ``kin`` the traced graph serves: the trace read none
    of the attributes their members differ in, and the graph passes the
    session's check against each of their members (a failing one is left
    to a trace of its own, never reported from another's graph)."""
    out: list[tuple[VariantRequest, Fidelity, float]] = []
    reads = plan.reads
    if reads is None or not reads.complete:
        return out
    for other, changed in kin.others:
        # another ``forward`` set on a submodule runs other code: never served
        if any(name == "forward" for _, name in changed) or not reads.untouched(changed):
            continue
        t0 = time.perf_counter()
        fail = functools.partial(_failure, other, options.backend)
        try:
            fidelity = _checked(checker_for(other, graph_outputs), plan, modules, fail, None,
                                None, lambda r: checker_for(r, None), runs="here")
        except CaptureFailed:
            kin.refused.add(other.variant)
            continue
        if fidelity.ok:
            out.append((other, fidelity, time.perf_counter() - t0))
        else:
            kin.refused.add(other.variant)
    return out


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


def _record(request: VariantRequest, options: CaptureOptions, plan: _Plan, real: Backend,
            artifact: Any, graph_outputs: Spec | None, fidelity: Fidelity,
            contexts: tuple[tuple[str, ...], tuple[str, ...]], collective: bool,
            from_cache: bool, t0: float, fail: Callable[..., CaptureFailed]) -> Capture:
    """The ``Capture`` of a checked artifact, with its graph's summary."""
    try:
        ops, op_args, digest, fingerprint = _graph_summary(request, real, artifact)
    except Exception as exc:
        raise fail("bad_artifact", exc) from None
    embedded, ambient_only = contexts
    return capture_of(
        request, options.ignore_attributes,
        graph_outputs=graph_outputs, backend=real.name, artifact=artifact, fidelity=fidelity,
        fingerprint=fingerprint, embedded=embedded, ambient_only=ambient_only,
        binding=plan.binding, constants=tuple(p for p, _ in _const_paths(request.inputs)),
        attempts=options.backend.last_attempts, seconds=time.perf_counter() - t0, ops=ops,
        collective=collective, graph_digest=digest, op_args=op_args, from_cache=from_cache,
        assigned=plan.covered())


def _checked(checker: Checker, plan: _Plan, modules: Mapping[str, nn.Module],
             fail: Callable[..., CaptureFailed], after: After | None, artifact: Any,
             checker_for: Callable[[VariantRequest], Checker], *, runs: str) -> Fidelity:
    """The artifact checked against the variant's calls (what the trace and
    the reference runs changed in their arguments included), then handed
    to ``after`` with a checker for other requests of the same view.
    ``runs``: where the member may run -- ``"here"``, only with the other
    ranks (``"ranks"``: a graph holding collectives at a level that
    executes) or ``"nowhere"`` (the same at a level that does not)."""
    try:
        fidelity = checker.run(modules if plan.tick is None else
                               _Ticking(modules, checker.request, plan.tick))
        unwatched = _unwatched(checker, plan, modules, runs)
    except Exception as exc:
        raise fail("verify_failed", exc) from None
    if unwatched:
        fidelity = attrs.evolve(fidelity, ok=False, ok_with_needs=None,
                                mismatches=(*fidelity.mismatches, *unwatched))
    fidelity = with_mutations(fidelity, _uncovered([*plan.watch.found, *checker.watch.found],
                                                   plan.covered()))
    if after is not None:
        try:
            after(artifact, checker_for, modules)
        except Exception as exc:
            raise fail("verify_failed", exc) from None
    return fidelity


def _unwatched(checker: Checker, plan: _Plan, modules: Mapping[str, nn.Module],
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
    except Exception as exc:
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
        except Exception as exc:
            raise _with_context(fail("state_not_restorable", exc),
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


def _artifact(request: VariantRequest, plan: _Plan, view: nn.Module, options: CaptureOptions,
              fail: Callable[..., CaptureFailed],
              baseline: tuple[ContextProbe[Any], ...], source: Source | None
              ) -> tuple[Any, Spec | None, Backend]:
    """The variant's artifact: traced from ``view``, or taken from ``source``."""
    if source is None:
        return _trace(request, plan, view, options, fail, baseline)
    try:
        return source(view, plan.binding)
    except Exception as exc:
        raise fail("bad_artifact", exc) from None


def _context_split(request: VariantRequest, plan: _Plan, options: CaptureOptions,
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
    return capture_variant(request, {member: module}, attrs.evolve(options, verify="off"))


def _layouts(inputs: CallSpec) -> dict[str, str]:
    """Input tensors that are not plain strided ones, by path: a graph traced
    from dense stand-ins would run the dense branch of the forward (sparse
    and nested tensors are neither materialised nor keyed as dense ones)."""
    return {path: spec.layout for path, spec in inputs.leaves() if spec.layout != "strided"}


def _with_context(failed: CaptureFailed, context: dict[str, str]) -> CaptureFailed:
    return CaptureFailed(attrs.evolve(failed.failure,
                                      context={**failed.failure.context, **context}))


def _failure(request: VariantRequest, backend: Backend, reason: str,
             exc: BaseException | None,
             attempts: tuple[tuple[str, str, str], ...] = ()) -> CaptureFailed:
    exc_type, message = ("-", "") if exc is None else exception_message(exc)
    try:
        context = request.snapshot.describe()
    except Exception:
        context = {}
    if exc is not None:
        import logging

        logging.getLogger("ctxreplay").debug(
            "capture of %s#%d failed: %s", request.scope, request.variant, reason,
            exc_info=(type(exc), exc, exc.__traceback__))
    return CaptureFailed(CaptureFailure(request.scope, request.variant, backend.name, reason,
                                        exc_type, attempts, context, message))


# -- tracing ----------------------------------------------------------------------

def _trace(request: VariantRequest, plan: _Plan, view: nn.Module, options: CaptureOptions,
           fail: Callable[..., CaptureFailed],
           baseline: tuple[ContextProbe[Any], ...] = ()) -> tuple[Any, Spec | None, Backend]:
    """Trace ``view`` under the plan's replay: ``(artifact, output spec, the
    backend that produced it)``, or raise ``fail``'s ``CaptureFailed``."""
    try:
        target, args, kwargs = _bind(request, plan, view)
    except Exception as exc:
        raise fail("materialize_failed", exc) from None
    job = functools.partial(_trace_once, request, plan, options, baseline, view, target,
                            args, kwargs)
    return _run_reported(job, plan, options, fail)


def _bind(request: VariantRequest, plan: _Plan, view: nn.Module
          ) -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    """What the backend traces and the inputs it is called with: the view
    itself with the native call, or ``_Flattened`` around it with the tensor
    leaves."""
    if plan.binding == "native":
        args, kwargs = inputs_for(request.inputs, "native")
        return view, args, kwargs
    target = _Flattened(view, request.inputs, plan.inside, plan.flatten_out, plan.assigned)
    return target, materialize_leaves(request.inputs), {}


def _dynamic_shapes(plan: _Plan, target: nn.Module, args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> Any:
    """``torch.export``'s ``dynamic_shapes`` for the plan's dynamic dims: each
    ``Dim.AUTO``, so the trace itself finds how they relate and where the
    forward needs a fixed size (it then specialises, and the fold's checks
    say which sizes the graph takes)."""
    # (Any: torch 2.7's stubs neither export ShapesCollection nor know Dim.AUTO)
    export: Any = torch.export
    collection = export.ShapesCollection()
    leaves = call_tensors(args, kwargs)
    for i, dims in plan.dims.items():
        collection[leaves[i]] = {d: export.Dim.AUTO for d in dims}
    return collection.dynamic_shapes(target, args, kwargs)


def _trace_once(request: VariantRequest, plan: _Plan, options: CaptureOptions,
                baseline: tuple[ContextProbe[Any], ...], view: nn.Module, target: nn.Module,
                args: tuple[Any, ...], kwargs: dict[str, Any]
                ) -> tuple[Any, Spec | None, Backend]:
    """One trace of ``target`` (``view`` or ``_Flattened`` around it) inside
    the replay (in the worker thread ``run_in_worker`` starts), ``view`` called as its
    ``forward`` alone, as observation saw the live call; a replay that fails
    entering or restoring raises ``_ReplayFault``, an unusable result
    ``_ArtifactFault``."""
    with ExitStack() as stack:
        try:
            # from a fresh process's state, whatever the caller of
            # finalize() has active (an autocast already on would make
            # the embedded replay a no-op the tracer never records)
            stack.enter_context(neutral_replay(request.snapshot, baseline,
                                               only_neutral=True))
            stack.enter_context(plan.around)
        except Exception as exc:
            raise _ReplayFault() from exc
        inside = plan.inside if plan.binding == "native" else None
        with rng_guard(watch_generators=False), forward_alone(view), \
                watched(view, plan.watch), _swapped_forward(target, inside), \
                recorded(view, plan.reads) if plan.reads is not None else nullcontext():
            if plan.dims:
                raw = options.backend.capture_dynamic(
                    target, args, kwargs, _dynamic_shapes(plan, target, args, kwargs))
            else:
                raw = options.backend.capture(target, args, kwargs)
            traced = _resolve(raw, plan, options, args, kwargs)
        try:  # a replay that fails while restoring is a replay fault too
            stack.close()
        except Exception as exc:
            raise _ReplayFault() from exc
        return traced


def _resolve(raw: Any, plan: _Plan, options: CaptureOptions, args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> tuple[Any, Spec | None, Backend]:
    """The artifact in what the backend returned, factory defaults pinned
    when asked, and its output spec; any failure is an ``_ArtifactFault``."""
    try:  # what the backend returned must hold up, or it is no artifact
        real, artifact = options.backend.resolve(raw)
        if artifact is None:
            raise _ArtifactFault("no_artifact")
        gm = real.graph_module(artifact)
        if options.pin_factories and gm is not None:
            pin_factory_defaults(gm)
        # a fallback backend that records no embedded context
        # (symbolic, under auto) reads its outputs inside them
        unrecorded = plan.inside is not None and not real.records_embedded
        # a backend may run the module here (symbolic): random state, the
        # generators it reaches and the live weights it writes are put back
        with rng_guard(weights=gm if gm is not None else artifact), \
                plan.inside() if plan.inside and unrecorded else nullcontext():
            spec = real.output_spec(artifact, args, kwargs)
        if plan.dims and spec is not None:  # at the sizes it was traced at
            spec = concrete(spec)
        spec = _without_assigned(spec, plan.covered())
    except _ArtifactFault:
        raise
    except Exception as exc:
        code = classify_exception(exc)
        raise _ArtifactFault("bad_artifact" if code == "trace_error" else code) \
            from exc
    return artifact, spec, real


def _run_reported(job: Callable[[], tuple[Any, Spec | None, Backend]], plan: _Plan,
                  options: CaptureOptions, fail: Callable[..., CaptureFailed]
                  ) -> tuple[Any, Spec | None, Backend]:
    """Run ``job`` under the capture timeout and turn what went wrong into
    ``fail``'s ``CaptureFailed``: a replay fault the traced callable
    remembered wins over what the tracer made of it."""
    backend = options.backend
    try:
        # in a worker thread (see ``worker``): the replay is entered inside
        # ``job``, so thread-local state (grad mode, autocast) is
        # established in the thread that traces.  A timed-out worker cannot
        # be killed; it is abandoned as a daemon and its replay unwinds when
        # the backend eventually returns.  Until then its process-global
        # replays (default dtype, determinism, matmul precision) are in
        # force, so finalize()'s safety net (``engine.baseline.Baseline``)
        # puts back the state finalize began with before the next variant
        # and before it returns.
        artifact, spec, real = run_in_worker(job, options.capture_timeout)
    except WorkerTimeout:
        raise fail("timeout", None, backend.last_attempts) from None
    except _ReplayFault as exc:
        raise fail("replay_failed", exc.__cause__) from None
    except _ArtifactFault as exc:
        raise fail(exc.reason, exc.__cause__, backend.last_attempts) from None
    except BackendError as exc:
        if plan.faults:
            raise fail("replay_failed", plan.faults[0], exc.attempts) from None
        raise fail(exc.reason, exc.__cause__ or exc.__context__ or exc, exc.attempts) from None
    except Exception as exc:
        if plan.faults:
            raise fail("replay_failed", plan.faults[0], backend.last_attempts) from None
        raise fail(classify_exception(exc), exc, backend.last_attempts) from None
    if plan.faults:
        # a tracer that swallowed a replay error (autocast.__exit__ under
        # export on torch 2.7-2.8) still leaves it here
        raise fail("replay_failed", plan.faults[0], backend.last_attempts)
    return artifact, spec, real


def _guard_inside(inside: Callable[[], AbstractContextManager[Any]],
                  faults: list[BaseException]) -> Callable[[], AbstractContextManager[Any]]:
    """Remember a replay fault raised inside the traced callable, so it is
    reported as ``replay_failed`` whatever the tracer wraps it in."""

    @contextmanager
    def guarded() -> Iterator[None]:
        try:
            cm = inside()
            cm.__enter__()
        except Exception as exc:
            faults.append(exc)
            raise
        body_failed = False
        try:
            yield
        except BaseException:
            body_failed = True
            try:
                cm.__exit__(None, None, None)
            except Exception as exc:
                faults.append(exc)
            raise
        finally:
            if not body_failed:
                try:
                    cm.__exit__(None, None, None)
                except Exception as exc:
                    faults.append(exc)
                    raise

    return guarded


@contextmanager
def _swapped_forward(module: nn.Module,
                     inside: Callable[[], AbstractContextManager[Any]] | None
                     ) -> Iterator[None]:
    """Enter ``inside`` within the (isolated) module's own forward while it is
    traced: swapping the instance's forward, rather than wrapping the
    module, keeps parameter names and the forward's signature."""
    if inside is None:
        yield
        return
    # not named ``forward``: the graph's stack traces start at the first
    # frame of that name, the module's own (see ``mutation.watched``)
    def wrap(orig: Callable[..., Any]) -> Callable[..., Any]:
        def replayed_forward(*args: Any, **kwargs: Any) -> Any:
            with inside():
                return orig(*args, **kwargs)
        return replayed_forward

    with forward_wrapped(module, wrap):
        yield


class _Flattened(nn.Module):
    """Takes the tensor leaves of a call whose arguments torch's pytree does
    not know (dataclasses, a framework's metadata objects), rebuilds the
    call around them -- the rest bound as constants -- and optionally
    returns the tensor leaves of an output pytree cannot carry."""

    def __init__(self, inner: nn.Module, inputs: CallSpec,
                 inside: Callable[[], AbstractContextManager[Any]] | None,
                 flatten_out: bool, assigned: list[Assigned] | None = None) -> None:
        super().__init__()
        self.inner = inner
        self._inputs = inputs
        self._inside = inside
        self._flatten_out = flatten_out
        self._assigned = assigned

    def forward(self, *leaves: torch.Tensor) -> Any:
        args, kwargs = inputs_for(self._inputs, "native", leaves=leaves)
        # a non-strict trace runs this Python: the walk sees what the
        # forward assigns to the rebuilt argument objects (Dynamo would
        # graph-break on it, and then the watch reports the changes)
        walk = self._assigned is not None and not dynamo_compiling()
        before, held = arguments_state(args, kwargs) if walk else ({}, [])
        if self._inside is None:  # no context object at all: any Dynamo traces this
            out = self.inner(*args, **kwargs)
        else:
            with self._inside():
                out = self.inner(*args, **kwargs)
        if self._flatten_out:
            out = tuple(tensor_values(out))
        if not walk or self._assigned is None:
            return out
        found = assigned_by(args, kwargs, before)
        del held
        tensors = () if found is None else collect(found, args, kwargs)
        # a tensor assigned that is also an output or an input (``state.last
        # = y; return y``) is one object eagerly, two once the program returns
        # it twice: left to the watch, which reports it
        shared = {id(t) for t in (*leaves, *tensor_values(out))}
        if found is None or any(id(t) in shared for t in tensors):
            self._assigned[:] = []
            return out
        self._assigned[:] = [found]
        return joined_result(out, tensors, self._flatten_out)


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


def _without_assigned(spec: Spec | None, assigned: Assigned | None) -> Spec | None:
    """The graph's output spec less the assigned tensors it returns last."""
    n = 0 if assigned is None else len(assigned.tensors)
    if not n or not isinstance(spec, SeqSpec):
        return spec
    return SeqSpec(spec.kind, spec.items[:-n])


def _uncovered(found: list[Mutation], assigned: Assigned | None) -> list[Mutation]:
    """The argument changes the program does not make: those at the paths
    it assigns are its outputs (the checks compared their values with the
    member's own assignments)."""
    if assigned is None:
        return found
    paths = assigned.paths()
    return [m for m in found if m.field != ARGUMENT_FIELD or m.path not in paths]
