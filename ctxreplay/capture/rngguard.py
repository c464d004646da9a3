"""Random state and the live weights as they were, whatever a check runs.

``rng_guard()`` puts back the global CPU (and, once initialised, CUDA)
generator state and the state of every ``torch.Generator`` any torch call
inside it received as ``generator=``; with ``weights=`` (a view), the
parameters a run wrote into in place too.  ``BookkeepingError``: this watch
itself failed (not the run).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..errors import Error
from ..specs.storage import inner_tensors, storage_ptr, storage_ptrs

__all__ = ["BookkeepingError", "rng_guard"]


class BookkeepingError(Error, RuntimeError):
    """ctxreplay's own watch around a run failed (not the run itself): a
    check that meets it cannot say anything of the program, and reports
    its own failure instead of a mismatch.  Its message names the cause
    (raised without the chain: a report names the innermost cause's type)."""

    @classmethod
    def of(cls, doing: str, exc: BaseException) -> BookkeepingError:
        return cls(f"ctxreplay's watch of a check run failed {doing}: "
                   f"{type(exc).__name__}: {exc}")


class _RunWatch(TorchFunctionMode):
    """Remembers the state of every generator passed to a torch call, and
    keeps a copy of each watched tensor (a parameter an isolated view shares
    with the live module) before the first torch call that writes into its
    storage in place.  One mode for both: each is a Python call per torch
    call of the run."""

    def __init__(self, generators: bool, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().__init__()
        self.generators = generators
        self.seen: dict[int, tuple[torch.Generator, torch.Tensor]] = {}
        # by the storage of each ordinary tensor holding a weight's data:
        # a wrapper subclass (a quantized weight, a DTensor) has none of its
        # own, its inner tensors do
        self.watched: dict[int, list[tuple[str, torch.Tensor]]] = {}
        try:
            for name, t in tensors:
                for _path, inner in inner_tensors(t):
                    ptr = storage_ptr(inner) if inner.numel() else None
                    if ptr is not None:
                        self.watched.setdefault(ptr, []).append((name, inner))
        except Exception as exc:  # a tensor subclass may raise anything: a BookkeepingError
            raise BookkeepingError.of("reading the weights' storage", exc) from None
        self.kept: dict[tuple[str, int], tuple[str, torch.Tensor, torch.Tensor]] = {}

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if torch.compiler.is_compiling():
            # a compiled function the forward calls: Dynamo inlines an active
            # mode, and guarded on the per-callable table below, which its
            # own trace fills (torch 2.9.1 failed its guard self-check with
            # an AssertionError, so the check run did).  Writes made inside
            # compiled code are not watched.
            return func(*args, **kwargs)
        if self.generators:
            g = kwargs.get("generator")
            if isinstance(g, torch.Generator) and id(g) not in self.seen:
                self.seen[id(g)] = (g, g.get_state())
        if self.watched:
            try:
                self._keep(func, args, kwargs)
            except Exception as exc:  # a tensor subclass may raise anything: a BookkeepingError
                raise BookkeepingError.of(f"finding what {func!r} writes", exc) from None
        return func(*args, **kwargs)

    def _keep(self, func: Any, args: Any, kwargs: Any) -> None:
        for t in _written(func, args, kwargs):
            for ptr in storage_ptrs(t):  # none: a tensor without storage (functional)
                for name, p in self.watched.get(ptr, ()):
                    if (name, ptr) not in self.kept:
                        self.kept[name, ptr] = (name, p, p.detach().clone())


def _written(func: Any, args: Any, kwargs: Any) -> list[torch.Tensor]:
    """The tensors a torch call writes into in place (``_write_spots``), and
    whatever it is given as ``out=``."""
    try:
        spots = _SPOTS[func]
    except (KeyError, TypeError):
        spots = _write_spots(func)
    target = kwargs.get("out")
    if not spots and target is None:
        return []
    found = [args[i] if i < len(args) else kwargs.get(n) for i, n in spots]
    out: list[torch.Tensor] = []
    for t in (*found, target):
        if isinstance(t, torch.Tensor):
            out.append(t)
        elif isinstance(t, (tuple, list)):
            out += [x for x in t if isinstance(x, torch.Tensor)]
    return out


#: torch callable -> where its in-place targets are, read once per callable
_SPOTS: dict[Any, tuple[tuple[int, str], ...]] = {}


def _write_spots(func: Any) -> tuple[tuple[int, str], ...]:
    """``(position, name)`` of each argument ``func`` writes into: those an
    operator's schema marks written (``Tensor(a!)``, what a graph's
    ``torch.ops.aten.mul_.Tensor`` shows), else -- a Python-level function
    or method -- the first of one named in place (``mul_``, ``__iadd__``,
    ``__setitem__``)."""
    schema = getattr(func, "_schema", None)
    if schema is not None:
        spots = tuple((i, a.name) for i, a in enumerate(schema.arguments)
                      if a.alias_info is not None and a.alias_info.is_write)
    else:
        name = getattr(func, "__name__", "")
        in_place = (name.endswith("_") and not name.endswith("__")) \
            or name.startswith("__i") or name == "__setitem__"
        spots = ((0, "self"),) if in_place else ()
    with contextlib.suppress(TypeError):  # not hashable: looked at again next time
        _SPOTS[func] = spots
    return spots


@contextmanager
def rng_guard(*, watch_generators: bool = True, weights: Any = None
              ) -> Iterator[dict[int, str]]:
    """Random state as it was, whatever runs inside; with ``weights`` (a
    module: an isolated view, or a program bound to one -- the live
    module's own tensors), each of its parameters that a torch call writes
    in place is put back as it was too, and the dict yielded then maps each
    one's storage to its name.  A check's runs work on the live weights (a
    copy of every weight per run would cost what the weights weigh), so a
    forward that updates a parameter in place would otherwise change the
    user's."""
    cpu = torch.random.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None  # type: ignore[no-untyped-call]
    params = weights.named_parameters() if isinstance(weights, nn.Module) else ()
    mode = _RunWatch(watch_generators, params)
    written: dict[int, str] = {}
    try:
        if not (watch_generators or mode.watched):
            yield written
        else:
            with mode:
                yield written
    finally:
        torch.random.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        for g, state in mode.seen.values():
            g.set_state(state)
        with torch.no_grad():
            for (_key, ptr), (name, p, saved) in mode.kept.items():
                p.detach().copy_(saved)
                written[ptr] = name
