"""The built-in backends, each registered through ``register_backend`` exactly as
a downstream package's backend would be."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from .._base.torchcaps import CAPS
from ..specs.signature import SeqSpec, Spec, flatten_spec, spec_of
from . import dtensor
from .base import Backend, BackendError, classify_exception, share_tensors_copy
from .passes import lower_wrappers
from .registry import register_backend

__all__ = ["AutoBackend", "DynamoBackend", "ExportBackend", "SymbolicBackend",
           "refuse_fake_tensors"]

_log = logging.getLogger("ctxreplay")


@register_backend
class ExportBackend(Backend):
    """``torch.export.export`` (non-strict by default).

    A program that recorded embedded contexts as higher-order ops
    (``wrap_with_autocast``) already runs like the live call, with no ambient
    state; ``lower_wrappers`` turns them into explicit ``_to_copy`` nodes
    with ``run_decompositions({})`` -- no op decomposed -- which
    ``torch.export.save`` needed before it accepted the wrappers, and which
    every consumer of a ``.pt2`` understands.  Lowering costs several times the
    export itself, so by default it happens only when an artifact is saved;
    ``lower=True`` does it at capture.
    """

    name = "export"

    @property
    def folds(self) -> bool:  # type: ignore[override]
        # a subclass that traces its own way (``capture`` overridden, not
        # ``capture_dynamic``) is never bypassed by a fold
        cls = type(self)
        return cls.capture is ExportBackend.capture \
            or cls.capture_dynamic is not ExportBackend.capture_dynamic

    def __init__(self, *, strict: bool = False, lower: bool = False) -> None:
        self.strict = strict
        self.lower = lower

    def capture(self, module: torch.nn.Module, args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> Any:
        _refuse_untraceable_dtensors(module)
        with dtensor.traceable(module):  # a tensor-parallel module builds DTensors
            ep = dtensor.desugared(torch.export.export(module, args, kwargs or None,
                                                       strict=self.strict))
        return lower_wrappers(ep) if self.lower else ep

    def capture_dynamic(self, module: torch.nn.Module, args: tuple[Any, ...],
                        kwargs: dict[str, Any], dynamic_shapes: Any) -> Any:
        _refuse_untraceable_dtensors(module)
        with dtensor.traceable(module):
            ep = dtensor.desugared(torch.export.export(module, args, kwargs or None,
                                                       strict=self.strict,
                                                       dynamic_shapes=dynamic_shapes))
        return lower_wrappers(ep) if self.lower else ep

    def output_spec(self, artifact: Any, args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> Spec | None:
        gm = artifact.graph_module
        out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
        kinds = artifact.graph_signature.output_specs
        user = [a for a, k in zip(out.args[0], kinds) if k.kind.name == "USER_OUTPUT"]
        leaves = []
        for a in user:
            v = a.meta.get("val") if isinstance(a, torch.fx.Node) else a
            leaves.append(spec_of(v))
        return SeqSpec(list, tuple(leaves))

    def run(self, artifact: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return artifact.module()(*args, **kwargs)

    def module(self, artifact: Any) -> torch.nn.Module | None:
        # a new GraphModule sharing the program's tensors: ``module()`` makes
        # a fresh one each call, all over the same parameter tensors
        out: torch.nn.Module = artifact.module()
        return out


@register_backend
class DynamoBackend(Backend):
    """``torch._dynamo.export`` with an aten graph: casts from embedded
    autocast are baked in as ``_to_copy`` nodes."""

    name = "dynamo"

    def capture(self, module: torch.nn.Module, args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> Any:
        import torch._dynamo

        # static like torch.export: the live call ran with these exact shapes
        # (dynamo's own default makes every dimension symbolic)
        with _forward_on_the_class(module):
            result = torch._dynamo.export(module, aten_graph=True,
                                          assume_static_by_default=True)(*args, **kwargs)
        refuse_fake_tensors(result.graph_module)
        return result.graph_module

    def run(self, artifact: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return artifact(*args, **kwargs)


def _refuse_untraceable_dtensors(module: torch.nn.Module) -> None:
    if not CAPS.export_traces_dtensor and dtensor.holds_dtensors(module.parameters()):
        raise NotImplementedError(
            f"torch {torch.__version__}'s torch.export cannot trace a module with DTensor "
            "parameters (tensor parallel); torch 2.9 or later can")


def refuse_fake_tensors(gm: torch.fx.GraphModule) -> None:
    """Raise where a graph module holds a tensor its trace made (a
    ``FakeTensor``) instead of a real one: it could never run.  Dynamo of
    torch 2.9 and earlier keeps a tensor the forward made and stored in a
    Python container of the module (a dict filled per size) as such a
    constant."""
    from torch._subclasses.fake_tensor import FakeTensor

    held = [(name, t) for name, t in vars(gm).items() if isinstance(t, torch.Tensor)]
    held += [*gm.named_parameters(), *gm.named_buffers()]
    fake = sorted({name for name, t in held if isinstance(t, FakeTensor)})
    if fake:
        raise ValueError(f"the traced graph holds tensors its trace made, not real ones: "
                         f"{', '.join(fake[:4])}")


@contextmanager
def _forward_on_the_class(module: torch.nn.Module) -> Iterator[None]:
    """Dynamo before 2.10 (``CAPS.dynamo_traces_instance_forward``) refuses to
    export a module whose ``forward`` is an instance attribute -- how a
    capture enters its embedded replay -- once that forward reads the
    module's own parameters ("references tensors that are neither
    buffers/parameters/constants nor are direct inputs").  There the instance
    forward moves onto a one-off subclass for the trace; the module's class
    and ``__dict__`` are put back exactly after."""
    inst = module.__dict__.get("forward")
    if inst is None or CAPS.dynamo_traces_instance_forward:
        yield
        return
    cls = type(module)

    def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        return inst(*args, **kwargs)

    one_off = type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__,
                                          "__qualname__": cls.__qualname__})
    del module.__dict__["forward"]
    module.__class__ = one_off
    try:
        yield
    finally:
        module.__class__ = cls
        module.__dict__["forward"] = inst


@register_backend
class SymbolicBackend(Backend):
    """``torch.fx.symbolic_trace``.  Its graph has no dtypes and records no
    context, so its outputs are read by running it inside the replay."""

    name = "symbolic"
    records_embedded = False

    def capture(self, module: torch.nn.Module, args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> Any:
        concrete = {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}
        return torch.fx.symbolic_trace(module, concrete_args=concrete or None)

    def output_spec(self, artifact: Any, args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> Spec | None:
        with torch.no_grad():
            out = _call_traced(artifact, args, kwargs)
        return _flat_spec(out)

    def run(self, artifact: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return _call_traced(artifact, args, kwargs)

    def module(self, artifact: Any) -> torch.nn.Module | None:
        return _Positional(share_tensors_copy(artifact))


class _Positional(torch.nn.Module):
    """Calls a symbolically traced module the way ``SymbolicBackend.run`` does."""

    def __init__(self, gm: torch.nn.Module) -> None:
        super().__init__()
        self.gm = gm

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return _call_traced(self.gm, args, kwargs)


def _call_traced(gm: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Call a symbolically traced module with every keyword argument passed by
    position: fx renames the parameters of concrete arguments (``scale`` ->
    ``scale_1``) and asserts their traced value, so they must be passed."""
    import inspect

    params = list(inspect.signature(gm.forward).parameters)[len(args):]
    values = []
    for p in params:
        name = p if p in kwargs else p.rpartition("_")[0]
        if name not in kwargs:
            break
        values.append(kwargs[name])
    if len(values) < len(kwargs):  # not bindable by position: fall back to names
        return gm(*args, **{k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)})
    return gm(*args, *values)


def _flat_spec(value: Any) -> Spec:
    return SeqSpec(list, tuple(s for s in flatten_spec(spec_of(value))
                               if not (hasattr(s, "value") and s.value is None)))


@register_backend
class AutoBackend(Backend):
    """Tries export, then dynamo, then symbolic; every failed attempt is kept
    on the capture (``attempts``)."""

    name = "auto"

    def __init__(self, backends: tuple[Backend, ...] | None = None) -> None:
        self.backends = backends or (ExportBackend(), DynamoBackend(), SymbolicBackend())
        self._attempts: tuple[tuple[str, str, str], ...] = ()

    def capture(self, module: torch.nn.Module, args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> Any:
        attempts: list[tuple[str, str, str]] = []
        errors: list[BaseException] = []
        for b in self.backends:
            try:
                art = b.capture(module, args, kwargs)
            except Exception as exc:  # a backend may raise anything: the next one is tried
                attempts.append((b.name, classify_exception(exc), type(exc).__name__))
                _log.debug("backend %s failed: %s", b.name, attempts[-1][1], exc_info=True)
                errors.append(exc)
                continue
            self._attempts = tuple(attempts)
            return _Chosen(b, art)
        self._attempts = tuple(attempts)
        reason = attempts[-1][1] if attempts else "trace_error"
        # the most specific reason wins over the generic one
        for _, code, _ in attempts:
            if code != "trace_error":
                reason = code
                break
        # the cause: the first backend's error, the closest to the user's code
        # (Dynamo wraps a user's exception in its own "Observed..." types)
        raise BackendError(reason, attempts[-1][2] if attempts else "?", tuple(attempts)) \
            from (errors[0] if errors else None)

    @property
    def folds(self) -> bool:  # type: ignore[override]
        return any(b.folds for b in self.backends)

    def capture_dynamic(self, module: torch.nn.Module, args: tuple[Any, ...],
                        kwargs: dict[str, Any], dynamic_shapes: Any) -> Any:
        """The first backend that folds; a failure is the fold's, never a
        fallback to a backend of fixed sizes (the variants are then
        captured one by one)."""
        b = next(b for b in self.backends if b.folds)
        try:
            art = b.capture_dynamic(module, args, kwargs, dynamic_shapes)
        except Exception as exc:  # recorded, then re-raised
            self._attempts = ((b.name, classify_exception(exc), type(exc).__name__),)
            raise
        self._attempts = ()
        return _Chosen(b, art)

    def resolve(self, artifact: Any) -> tuple[Backend, Any]:
        return artifact.backend, artifact.artifact

    @property
    def last_attempts(self) -> tuple[tuple[str, str, str], ...]:
        return self._attempts


class _Chosen:
    """What ``AutoBackend`` returns: the backend that succeeded and its artifact."""

    __slots__ = ("artifact", "backend")

    def __init__(self, backend: Backend, artifact: Any) -> None:
        self.backend = backend
        self.artifact = artifact
