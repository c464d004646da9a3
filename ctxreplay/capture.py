"""Capturing one variant: materialise, replay, trace, check, fingerprint."""

from __future__ import annotations

import functools
import hashlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from ._frozen import freeze_constants
from .backends import Backend, BackendError, classify_exception
from .backends.base import graph_nodes
from .passes import pin_factory_defaults
from .report import Capture, CaptureFailure
from .signature import (
    CallSpec,
    ConstSpec,
    Spec,
    TensorSpec,
    _native,
    materialize,
    materialize_call,
    materialize_leaves,
    spec_to_json,
    tensor_values,
)
from .verify import flat_tensor_spec, verify

if TYPE_CHECKING:
    from .session import Scope, Variant
    from .snapshot import ContextSnapshot

__all__ = ["CaptureSettings", "Failed", "capture_variant", "recapture"]


class CaptureSettings(Protocol):
    """What ``capture_variant`` reads from its session."""

    backend: Backend
    replay: str
    verify: str
    pin_factories: bool
    capture_timeout: float | None


class Failed(Exception):
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


def capture_variant(session: CaptureSettings, scope: Scope, v: Variant) -> Capture:
    t0 = time.perf_counter()
    backend = session.backend

    def fail(reason: str, exc: BaseException | None,
             attempts: tuple[tuple[str, str, str], ...] = ()) -> Failed:
        return Failed(CaptureFailure(
            scope.name, v.index, backend.name, reason,
            type(exc).__name__ if exc is not None else "-", attempts,
            _safe_describe(v)))

    module = v.module
    if module is None:
        raise fail("module_released", None)
    try:
        args, kwargs = materialize_call(freeze_constants(v.inputs))  # fresh copies
    except Exception as exc:
        raise fail("materialize_failed", exc) from None

    embedded_mode = session.replay == "embedded" and backend.records_embedded
    try:
        if session.replay == "off":
            inside: Callable[[], AbstractContextManager[Any]] = nullcontext
            around: AbstractContextManager[None] = nullcontext()
            embedded: tuple[str, ...] = ()
            ambient = v.snapshot.names
        else:
            inside, around, embedded, ambient = v.snapshot.replay_parts(embedded=embedded_mode)
    except Exception as exc:
        raise fail("replay_failed", exc) from None

    outputs_native = v.outputs is None or _native(v.outputs)
    binding = "native" if v.inputs.is_pytree_native() and outputs_native else "flattened"
    faults: list[BaseException] = []
    guarded_inside = _guard_inside(inside, faults) if embedded else None

    if binding == "native":
        target: nn.Module = module
        call_args, call_kwargs = args, kwargs
        constants: tuple[str, ...] = ()
    else:
        target = _Flattened(module, v.inputs, guarded_inside, not outputs_native)
        call_args = materialize_leaves(v.inputs)
        call_kwargs = {}
        constants = tuple(p for p, s in _const_paths(v.inputs))

    def job() -> tuple[Any, Spec | None, Backend]:
        with ExitStack() as stack:
            try:
                stack.enter_context(around)
            except Exception as exc:
                raise _ReplayFault() from exc
            with _swapped_forward(target, guarded_inside if binding == "native" else None):
                raw = backend.capture(target, call_args, call_kwargs)
                try:  # what the backend returned must hold up, or it is no artifact
                    real, artifact = backend.resolve(raw)
                    if artifact is None:
                        raise _ArtifactFault("no_artifact")
                    gm = real.graph_module(artifact)
                    if session.pin_factories and gm is not None:
                        pin_factory_defaults(gm)
                    # a fallback backend that records no embedded context
                    # (symbolic, under auto) reads its outputs inside them
                    unrecorded = guarded_inside is not None and not real.records_embedded
                    with guarded_inside() if guarded_inside and unrecorded else nullcontext():
                        spec = real.output_spec(artifact, call_args, call_kwargs)
                except _ArtifactFault:
                    raise
                except Exception as exc:
                    code = classify_exception(exc)
                    raise _ArtifactFault("bad_artifact" if code == "trace_error" else code) \
                        from exc
            try:  # a replay that fails while restoring is a replay fault too
                stack.close()
            except Exception as exc:
                raise _ReplayFault() from exc
            return artifact, spec, real

    try:
        artifact, captured_spec, real = _run(job, session.capture_timeout)
    except _Timeout:
        raise fail("timeout", None, backend.last_attempts) from None
    except _ReplayFault as exc:
        raise fail("replay_failed", exc.__cause__) from None
    except _ArtifactFault as exc:
        raise fail(exc.reason, exc.__cause__, backend.last_attempts) from None
    except BackendError as exc:
        if faults:
            raise fail("replay_failed", faults[0], exc.attempts) from None
        raise fail(exc.reason, exc, exc.attempts) from None
    except Exception as exc:
        if faults:
            raise fail("replay_failed", faults[0], backend.last_attempts) from None
        raise fail(classify_exception(exc), exc, backend.last_attempts) from None

    if embedded and not real.records_embedded:  # the artifact carries none of them
        embedded, ambient = (), v.snapshot.names
    pinned = tuple(p.name for p in v.snapshot.probes if session.pin_factories and p.pinnable)
    carried = tuple(n for n in embedded if n not in ambient) + pinned
    applied = () if session.replay == "off" else v.snapshot.names

    def execute() -> Any:
        # outside any replay, on fresh inputs: proves the artifact is self-contained
        if binding == "flattened":
            return real.run(artifact, materialize_leaves(v.inputs), {})
        a, k = materialize_call(freeze_constants(v.inputs))
        return real.run(artifact, a, k)

    live = v.outputs
    if live is not None and binding == "flattened" and not outputs_native:
        live = flat_tensor_spec(live)
    try:
        fidelity = verify(session.verify, live, captured_spec, snapshot=v.snapshot,
                          applied=applied, embedded=carried, execute=execute)
    except Exception as exc:
        raise fail("verify_failed", exc) from None

    try:
        gm = real.graph_module(artifact)
        ops = _ops(gm) if gm is not None else ()
        fingerprint = _fingerprint(ops, v.inputs, v.snapshot.to_json(), real.name)
    except Exception as exc:
        raise fail("bad_artifact", exc) from None
    ambient_only = tuple(
        n for n, p, s in zip(v.snapshot.names, v.snapshot.probes, v.snapshot.states)
        if (n in ambient or n not in embedded) and n not in pinned and not _neutral(p, s))
    return Capture(
        scope=scope.name, members=tuple(scope.members), variant=v.index,
        signature=v.inputs, outputs=v.outputs, graph_outputs=captured_spec,
        snapshot=v.snapshot, calls=v.calls,
        backend=real.name, artifact=artifact, fidelity=fidelity,
        fingerprint=fingerprint,
        embedded=embedded, ambient_only=ambient_only, binding=binding,
        constants=constants, attempts=backend.last_attempts,
        seconds=time.perf_counter() - t0, ops=ops,
    )


class _Settings:
    __slots__ = ("backend", "capture_timeout", "pin_factories", "replay", "verify")

    def __init__(self, backend: Backend, replay: str, verify: str, pin_factories: bool,
                 capture_timeout: float | None) -> None:
        self.backend = backend
        self.replay = replay
        self.verify = verify
        self.pin_factories = pin_factories
        self.capture_timeout = capture_timeout


def recapture(capture: Capture, module: nn.Module, snapshot: ContextSnapshot, *,
              backend: Backend, replay: str = "embedded", verify: str = "off",
              pin_factories: bool = True, capture_timeout: float | None = None) -> Capture:
    """Capture ``capture``'s variant again from its recorded specs, on
    ``module``, under ``snapshot`` (e.g. ``capture.snapshot.without(name)``).

    Raises :class:`Failed` carrying the ``CaptureFailure``.
    """
    from .session import Scope, Variant  # the engine imports this module

    scope = Scope(capture.scope, (), list(capture.members))
    variant = Variant(capture.variant, snapshot, capture.signature, module, capture.outputs)
    settings = _Settings(backend, replay, verify, pin_factories, capture_timeout)
    return capture_variant(settings, scope, variant)


# -- helpers ---------------------------------------------------------------------

def _neutral(probe: Any, state: Any) -> bool:
    try:
        return bool(probe.neutral(state))
    except Exception:
        return False


def _safe_describe(v: Variant) -> dict[str, str]:
    try:
        return v.snapshot.describe()
    except Exception:
        return {}


def _guard_inside(inside: Callable[[], AbstractContextManager[Any]],
                  faults: list[BaseException]) -> Callable[[], AbstractContextManager[Any]]:
    """Remember a replay fault raised inside the traced callable, so it is
    reported as ``replay_failed`` whatever the tracer wraps it in."""

    @contextmanager
    def guarded() -> Iterator[None]:
        try:
            cm = inside()
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
    """Enter ``inside`` within the module's own forward while it is traced.

    Swapping the instance's forward (rather than wrapping the module) keeps
    parameter names and the forward's signature in the artifact."""
    if inside is None:
        yield
        return
    had = "forward" in module.__dict__
    prev = module.__dict__.get("forward")
    orig = module.forward

    @functools.wraps(orig)
    def forward(*args: Any, **kwargs: Any) -> Any:
        with inside():
            return orig(*args, **kwargs)

    module.forward = forward
    try:
        yield
    finally:
        if had:
            module.forward = prev  # type: ignore[assignment]
        else:
            del module.forward


class _Flattened(nn.Module):
    """Takes the tensor leaves of a call whose arguments torch's pytree does
    not know (dataclasses, a framework's metadata objects), rebuilds the
    call around them -- the rest bound as constants -- and optionally
    returns the tensor leaves of an output pytree cannot carry."""

    def __init__(self, inner: nn.Module, inputs: CallSpec,
                 inside: Callable[[], AbstractContextManager[Any]] | None,
                 flatten_out: bool) -> None:
        super().__init__()
        self.inner = inner
        self._inputs = inputs
        self._inside = inside
        self._flatten_out = flatten_out

    def forward(self, *leaves: torch.Tensor) -> Any:
        it = iter(leaves)

        def take(_spec: TensorSpec) -> torch.Tensor:
            return next(it)

        inputs = freeze_constants(self._inputs)  # each trace mutates its own copies
        args = tuple(materialize(s, tensor_factory=take) for s in inputs.args)
        kwargs = {k: materialize(s, tensor_factory=take) for k, s in inputs.kwargs}
        with self._inside() if self._inside is not None else ExitStack():
            out = self.inner(*args, **kwargs)
        if self._flatten_out:
            return tuple(tensor_values(out))
        return out


def _const_paths(inputs: CallSpec) -> Iterator[tuple[str, Spec]]:
    def walk(spec: Spec, path: str) -> Iterator[tuple[str, Spec]]:
        if isinstance(spec, ConstSpec):
            if spec.value is not None:
                yield path, spec
            return
        if isinstance(spec, TensorSpec):
            return
        from .signature import _children

        for sub, child in _children(spec) or []:
            yield from walk(child, path + sub)

    for i, a in enumerate(inputs.args):
        yield from walk(a, f"args[{i}]")
    for k, s in inputs.kwargs:
        yield from walk(s, f"kwargs[{k!r}]")


def _ops(gm: torch.fx.GraphModule) -> tuple[tuple[str, str | None], ...]:
    out = []
    for n in graph_nodes(gm):
        if n.op != "call_function":
            continue
        val = n.meta.get("val")
        dtype = str(val.dtype).removeprefix("torch.") if isinstance(val, torch.Tensor) else None
        out.append((_op_name(n.target), dtype))
    return tuple(out)


def _op_name(target: Any) -> str:
    name = getattr(target, "__name__", None)
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    return str(name or target)


def _fingerprint(ops: tuple[tuple[str, str | None], ...], inputs: CallSpec,
                 snapshot_json: Any, backend: str) -> str:
    doc = {
        "ops": [list(o) for o in ops],
        "inputs": [spec_to_json(s) for s in inputs.args],
        "kwargs": [[k, spec_to_json(s)] for k, s in inputs.kwargs],
        "snapshot": snapshot_json,
        "backend": backend,
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()[:32]


class _Timeout(Exception):
    pass


def _run(job: Callable[[], Any], timeout: float | None) -> Any:
    """Run ``job`` here, or in a worker thread bounded by ``timeout``.

    The replay is entered inside ``job``, so thread-local state (grad mode,
    autocast) is established in the thread that traces.  A timed-out worker
    cannot be killed; it is abandoned as a daemon and its replay context
    unwinds when the backend eventually returns.  Until then its
    process-global replays (default dtype, determinism, matmul precision) are
    in force, so ``finalize()``'s safety net (``_baseline.Baseline``) puts
    back the state finalize began with before the next variant and before it
    returns.  The worker's late restore writes back what it found on entry --
    that same state -- so it changes nothing, unless the caller has changed
    those globals meanwhile (or a later variant of the same finalize is being
    captured under other process-global states at that moment: that capture
    may then see them undone).  A ``KeyboardInterrupt`` raised in the worker
    is re-raised here."""
    if timeout is None:
        return job()
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = job()
        except BaseException as exc:
            box["error"] = exc

    worker = threading.Thread(target=target, name="ctxreplay-capture", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        raise _Timeout()
    if "error" in box:
        raise box["error"]
    return box["value"]

