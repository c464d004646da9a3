"""Tracing one isolated view under a variant's replayed context.

``TracePlan.make(request, options, backend)`` says how the variant is traced
-- which probes are replayed inside the traced forward and which around
it, and how its call is bound (``"native"``, or ``"flattened"``: the tensor
leaves of a call torch's pytree does not know, through ``_Flattened``);
``trace(request, plan, view, options, fail)`` runs the backend in a worker
thread under the capture timeout and turns what went wrong into a
``CaptureFailed``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from typing import Any

import attrs
import torch
from torch import nn

from .._base.torchcaps import dynamo_compiling
from ..backends import Backend, BackendError, classify_exception
from ..backends.passes import pin_factory_defaults
from ..core.probe import ContextProbe
from ..fidelity.verify import neutral_replay
from ..specs.dims import concrete
from ..specs.materialize import inputs_for, materialize_leaves
from ..specs.signature import CallSpec, SeqSpec, Spec, call_tensors, tensor_values
from .assigned import Assigned, assigned_by, collect, joined_result
from .failed import CaptureFailed
from .isolate import forward_alone, forward_wrapped
from .mutation import MutationLog, arguments_state, watched
from .options import CaptureOptions, VariantRequest
from .reads import Reads, recorded
from .rngguard import rng_guard
from .worker import WorkerTimeout, run_in_worker

__all__ = ["TracePlan", "trace"]

#: ``(request, member name)``: a member's check of ``request`` starts (progress)
Tick = Callable[[VariantRequest, str], None]


class _ReplayFault(Exception):
    pass


class _ArtifactFault(Exception):
    """The backend returned, but no usable artifact: ``reason`` is the code."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@attrs.frozen(eq=False)
class TracePlan:
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
             *, embeds: bool = True) -> TracePlan:
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
        faults: list[BaseException] = []
        return cls(None if inside is None else _guard_inside(inside, faults), around,
                   embedded, ambient, request.binding, request.flatten_out, faults,
                   watch=MutationLog(ignore=options.ignore_attributes), dims=dims or {})


def trace(request: VariantRequest, plan: TracePlan, view: nn.Module, options: CaptureOptions,
           fail: Callable[..., CaptureFailed],
           neutral_probes: tuple[ContextProbe[Any], ...] = ()) -> tuple[Any, Spec | None, Backend]:
    """Trace ``view`` under the plan's replay: ``(artifact, output spec, the
    backend that produced it)``, or raise ``fail``'s ``CaptureFailed``."""
    try:
        target, args, kwargs = _bind(request, plan, view)
    except Exception as exc:  # rebuilding inputs runs user classes: fail() logs it
        raise fail("materialize_failed", exc) from None
    job = functools.partial(_trace_once, request, plan, options, neutral_probes, view, target,
                            args, kwargs)
    return _run_reported(job, plan, options, fail)


def _bind(request: VariantRequest, plan: TracePlan, view: nn.Module
          ) -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    """What the backend traces and the inputs it is called with: the view
    itself with the native call, or ``_Flattened`` around it with the tensor
    leaves."""
    if plan.binding == "native":
        args, kwargs = inputs_for(request.inputs, "native")
        return view, args, kwargs
    target = _Flattened(view, request.inputs, plan.inside, plan.flatten_out, plan.assigned)
    return target, materialize_leaves(request.inputs), {}


def _dynamic_shapes(plan: TracePlan, target: nn.Module, args: tuple[Any, ...],
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


def _trace_once(request: VariantRequest, plan: TracePlan, options: CaptureOptions,
                neutral_probes: tuple[ContextProbe[Any], ...], view: nn.Module, target: nn.Module,
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
            stack.enter_context(neutral_replay(request.snapshot, neutral_probes,
                                               only_neutral=True))
            stack.enter_context(plan.around)
        except Exception as exc:  # a probe's replay may raise anything: a replay fault
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
        except Exception as exc:  # a probe's restore may raise anything: a replay fault
            raise _ReplayFault() from exc
        return traced


def _resolve(raw: Any, plan: TracePlan, options: CaptureOptions, args: tuple[Any, ...],
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
    except Exception as exc:  # a backend's artifact may fail anyhow: a reason code
        code = classify_exception(exc)
        raise _ArtifactFault("bad_artifact" if code == "trace_error" else code) \
            from exc
    return artifact, spec, real


def _run_reported(job: Callable[[], tuple[Any, Spec | None, Backend]], plan: TracePlan,
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
        # force, so finalize()'s safety net (``engine.safetynet.SafetyNet``)
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
    except Exception as exc:  # a backend or tracer may raise anything: fail() logs it
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
        except Exception as exc:  # a probe's replay may raise anything: recorded, re-raised
            faults.append(exc)
            raise
        body_failed = False
        try:
            yield
        except BaseException:  # the replay is closed, then it is re-raised
            body_failed = True
            try:
                cm.__exit__(None, None, None)
            except Exception as exc:  # a probe's restore may raise anything: recorded
                faults.append(exc)
            raise
        finally:
            if not body_failed:
                try:
                    cm.__exit__(None, None, None)
                except Exception as exc:  # a probe's restore may raise anything: re-raised
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


class _Sink:
    """Where a trace leaves what the forward assigned.  Held by the module as
    an object pytree takes for a leaf, never as the list itself: torch 2.7's
    export snapshots a module's own attributes with pytree before the trace
    and compares them after, and a list that changed length fails that
    comparison (``Node arity mismatch``)."""

    __slots__ = ("found",)

    def __init__(self, found: list[Assigned]) -> None:
        self.found = found


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
        self._assigned = None if assigned is None else _Sink(assigned)

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
            self._assigned.found[:] = []
            return out
        self._assigned.found[:] = [found]
        return joined_result(out, tensors, self._flatten_out)


def _without_assigned(spec: Spec | None, assigned: Assigned | None) -> Spec | None:
    """The graph's output spec less the assigned tensors it returns last."""
    n = 0 if assigned is None else len(assigned.tensors)
    if not n or not isinstance(spec, SeqSpec):
        return spec
    return SeqSpec(spec.kind, spec.items[:-n])


