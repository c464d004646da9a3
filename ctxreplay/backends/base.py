"""The backend protocol and failure classification."""

from __future__ import annotations

import abc
import copy
import re
from typing import Any

import torch

from ..errors import Error
from ..specs.signature import SeqSpec, Spec, spec_of

__all__ = ["BACKEND_REASONS", "Adapter", "Backend", "BackendError", "classify_exception",
           "exception_message", "share_tensors_copy"]


class BackendError(Error, RuntimeError):
    """A backend failed; ``reason`` is a code, ``attempts`` the per-backend codes."""

    def __init__(self, reason: str, exc_type: str,
                 attempts: tuple[tuple[str, str, str], ...] = ()) -> None:
        super().__init__(f"{reason} ({exc_type})")
        self.reason = reason
        """The failure's reason code."""
        self.exc_type = exc_type
        """The type name of the exception behind it."""
        self.attempts = attempts
        """``(backend, reason code, exception type)`` of each backend tried."""


class Backend(abc.ABC):
    """Capture one variant.  Subclass it, or pass any object with the same
    methods as ``capture_with(..., backend=obj)``."""

    name: str = "custom"
    """The name reports give it (``Capture.backend``)."""
    records_embedded: bool = True
    """Whether the artifact records contexts entered inside the callable."""
    folds: bool = False
    """Whether ``capture_dynamic`` traces with dynamic sizes: calls that
    differ in sizes only are then captured as one graph."""

    @abc.abstractmethod
    def capture(self, module: torch.nn.Module, args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> Any:
        """Trace ``module`` on example inputs; return the artifact."""

    def capture_dynamic(self, module: torch.nn.Module, args: tuple[Any, ...],
                        kwargs: dict[str, Any], dynamic_shapes: Any) -> Any:
        """Trace ``module`` with the dimensions ``dynamic_shapes`` marks (in
        ``torch.export``'s form) left symbolic (a backend whose ``folds`` is
        true)."""
        raise NotImplementedError(f"backend {self.name!r} does not trace dynamic sizes")

    def graph_module(self, artifact: Any) -> torch.fx.GraphModule | None:
        """The artifact's top-level graph, if it has one (for ops and fingerprints)."""
        gm = getattr(artifact, "graph_module", artifact)
        return gm if isinstance(gm, torch.fx.GraphModule) else None

    def output_spec(self, artifact: Any, args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> Spec | None:
        """The graph's user outputs as a ``SeqSpec`` of their flattened leaves,
        from metadata when the graph carries it.  Called inside the replay."""
        gm = self.graph_module(artifact)
        if gm is None:
            return None
        vals = _output_vals(gm)
        if vals is None:
            return None
        return SeqSpec(list, tuple(spec_of(v) for v in vals))

    def resolve(self, artifact: Any) -> tuple[Backend, Any]:
        """The backend that really produced ``artifact`` and the bare artifact
        (a composite backend returns the one that succeeded)."""
        return self, artifact

    @property
    def last_attempts(self) -> tuple[tuple[str, str, str], ...]:
        """``(backend, reason, exception type)`` of failed attempts in the last capture."""
        return ()

    def run(self, artifact: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Execute the artifact with its own weights."""
        fn = self.module(artifact)
        return (artifact if fn is None else fn)(*args, **kwargs)

    def module(self, artifact: Any) -> torch.nn.Module | None:
        """A fresh module that runs ``artifact``, whose parameters and buffers
        may be reassigned (``load_state_dict(..., assign=True)``) without
        changing the artifact -- how one capture runs with another member's
        weights.  ``None`` when the artifact is not a module -- or when a
        subclass overrides ``run`` but not this method: it runs its
        artifacts its own way, so they run only with their own weights."""
        cls = type(self)
        if cls.run is not Backend.run and cls.module is Backend.module:
            return None
        if isinstance(artifact, torch.nn.Module):
            return share_tensors_copy(artifact)
        make = getattr(artifact, "module", None)
        if callable(make):
            out = make()
            return out if isinstance(out, torch.nn.Module) else None
        return None


def share_tensors_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``module`` whose parameter and buffer dicts are its own but
    whose tensors are the original's."""
    memo: dict[int, Any] = {}
    for t in (*module.parameters(), *module.buffers()):
        memo[id(t)] = t
    out: torch.nn.Module = copy.deepcopy(module, memo)
    return out


def _output_vals(gm: torch.fx.GraphModule) -> list[Any] | None:
    out = next((n for n in reversed(gm.graph.nodes) if n.op == "output"), None)
    if out is None:
        return None
    leaves: list[Any] = []

    def walk(a: Any) -> bool:
        if isinstance(a, torch.fx.Node):
            v = a.meta.get("val", a.meta.get("example_value"))
            if v is None:
                return False
            leaves.append(v)
            return True
        if isinstance(a, (list, tuple)):
            return all(walk(x) for x in a)
        if isinstance(a, dict):
            return all(walk(x) for x in a.values())
        leaves.append(a)
        return True

    return leaves if walk(out.args[0]) else None


_REASONS = (
    # (substring of the exception's qualified type name, reason code)
    ("GuardOnDataDependentSymNode", "data_dependent_control_flow"),
    ("DataDependentOutputException", "data_dependent_control_flow"),
    # an op whose output shape depends on input values (ctc_loss, lstsq)
    ("DynamicOutputShapeException", "data_dependent_output_shape"),
    ("PendingUnbackedSymbolNotFound", "data_dependent_control_flow"),
    ("TraceError", "dynamic_python_control_flow"),
    ("Unsupported", "unsupported_graph"),
    ("UncapturedHigherOrderOpError", "unsupported_graph"),
    ("UserError", "unsupported_graph"),
    ("TorchRuntimeError", "trace_error"),
)

#: every code ``classify_exception`` gives (a built-in backend's failure reasons)
BACKEND_REASONS = tuple(dict.fromkeys([*(code for _, code in _REASONS), "trace_error"]))


def classify_exception(exc: BaseException) -> str:
    """A reason code for a backend exception, from its type and its cause's
    type (never its text)."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        for cls in type(cur).__mro__:
            name = f"{cls.__module__}.{cls.__qualname__}"
            for needle, code in _REASONS:
                if needle in name:
                    return code
        cur = cur.__cause__ or cur.__context__
    return "trace_error"


_TENSOR_REPR = re.compile(r"tensor\((.|\n)*", re.IGNORECASE)
MAX_MESSAGE = 200


def exception_message(exc: BaseException) -> tuple[str, str]:
    """``(type name, first line of the message)`` of the innermost cause of
    ``exc`` -- what the user's own code or torch said, not the wrapper a
    tracer put around it.  Capped at 200 characters; anything that starts
    like a tensor's repr is cut, so no tensor value reaches a report."""
    seen: set[int] = set()
    cur: BaseException = exc
    while id(cur) not in seen:
        seen.add(id(cur))
        nxt = cur.__cause__ or (None if cur.__suppress_context__ else cur.__context__)
        if nxt is None:
            break
        cur = nxt
    try:
        text = str(cur)
    except Exception:  # an exception's __str__ is user code: no message
        text = ""
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    line = _TENSOR_REPR.sub("tensor(...)", line)
    line = "".join(c if c.isprintable() else " " for c in line)
    if len(line) > MAX_MESSAGE:
        line = line[:MAX_MESSAGE - 3] + "..."
    return type(cur).__name__, line


class Adapter(Backend):
    """Wraps a duck-typed backend object, filling in the optional methods."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj
        self.name = str(getattr(obj, "name", type(obj).__name__))
        self.records_embedded = bool(getattr(obj, "records_embedded", True))

    def capture(self, module: torch.nn.Module, args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> Any:
        return self.obj.capture(module, args, kwargs)

    def graph_module(self, artifact: Any) -> torch.fx.GraphModule | None:
        f = getattr(self.obj, "graph_module", None)
        return f(artifact) if f is not None else super().graph_module(artifact)

    def output_spec(self, artifact: Any, args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> Spec | None:
        f = getattr(self.obj, "output_spec", None)
        return f(artifact, args, kwargs) if f is not None else super().output_spec(
            artifact, args, kwargs)

    def run(self, artifact: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        f = getattr(self.obj, "run", None)
        return f(artifact, args, kwargs) if f is not None else super().run(
            artifact, args, kwargs)

    def module(self, artifact: Any) -> torch.nn.Module | None:
        f = getattr(self.obj, "module", None)
        if f is None:
            if getattr(self.obj, "run", None) is not None:
                return None  # it runs its artifacts its own way: only with their weights
            return super().module(artifact)
        out = f(artifact)
        return out if isinstance(out, torch.nn.Module) else None
