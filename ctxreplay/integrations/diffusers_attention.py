"""diffusers' attention dispatch: the backend ``dispatch_attention_fn`` runs.

diffusers (read on 0.42) keeps the active backend in a class attribute,
``diffusers.models.attention_dispatch._AttentionBackendRegistry._active_backend``
(an ``AttentionBackendName``; the ``attention_backend(...)`` context and
``set_active_backend`` set it; its start value is ``DIFFUSERS_ATTN_BACKEND``,
default ``native``).  Every attention call whose processor names no backend
of its own reads it, and no torch getter shows it: a graph captured under
``native`` and run under ``_native_math`` computes something else (0.047 on
the latents of a tiny Wan transformer, measured).

Observed per call with one attribute read; replayed inside the traced
callable, together with the SDPA lowering (``sdpa_lowering``) that writes the
math kernel ``_native_math`` picks into the graph, so a capture made under a
backend reproduces it wherever it runs; portable as the backend's name; and,
as every probe state, checked by the install guard.

A processor may name a backend of its own (``processor._attention_backend``,
set by ``model.set_attention_backend`` -- which sets the global one too -- or
on a processor directly); ``dispatch_attention_fn`` then runs that one, the
global one aside.  That state lives on the model: ``capture_with`` and
``install`` bind the probe to their model (``ContextProbe.bind``), which then
also observes the backend each attention module's processor names, by
module path (a module whose processor names none is left out).  Those reads
are one per attention module, so they are checked once per call of the
model (``watch_forward``), not on every block call: a processor changed
inside a forward counts from the next call.  The processors' backends are
carried into the trace by the traced module itself (its processors' own
attribute); the lowering is entered whenever one of them, or the global
backend, chooses the math kernel inside diffusers' function.
"""

from __future__ import annotations

import os
import sys
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from functools import partial
from typing import Any

import attrs

from .._base.jsonread import read_mapping, read_pairs, read_str
from ..core.probe import ContextProbe, FrameworkStateError, composed
from ..core.registry import register_probe
from .sdpa_lowering import lowering_math_sdpa

__all__ = ["DiffusersAttentionProbe", "DiffusersAttentionState"]

_MODULE = "diffusers.models.attention_dispatch"
_REGISTRY = "_AttentionBackendRegistry"
_ATTR = "_active_backend"
#: diffusers' own default (diffusers/utils/constants.py)
_NEUTRAL_NAME = "native"
#: backends whose function enters ``sdpa_kernel`` around torch's SDPA
_SDPA_KERNEL_PREFIX = "_native_"
#: the per-processor backend diffusers' attention processors hold
_PROC_ATTR = "_attention_backend"
#: descriptions name each processor's module up to this many, then count them
_DESCRIBED = 4


def _version() -> str:
    return str(getattr(sys.modules.get("diffusers"), "__version__", "unknown"))


def _registry() -> Any:
    """diffusers' backend registry class, ``None`` while its attention
    dispatch is not imported; a clear error where the private name moved."""
    mod = sys.modules.get(_MODULE)
    if mod is None:
        return None
    reg = getattr(mod, _REGISTRY, None)
    if reg is None or not hasattr(reg, _ATTR) or not hasattr(reg, "_backends"):
        raise FrameworkStateError(
            "diffusers", _version(), f"{_MODULE}.{_REGISTRY}.{_ATTR} (or its _backends) is "
            "not there; the diffusers_attention probe reads it (present in diffusers 0.42), "
            "so this diffusers' attention backend cannot be observed")
    return reg


def _name(raw: object) -> str:
    value = getattr(raw, "value", raw)  # an AttentionBackendName is a str enum
    return str(value)


@attrs.frozen(cache_hash=True)
class DiffusersAttentionState:
    """``backend``: the name of the active attention backend (``native``,
    ``_native_math``, ``flex``, ...); before diffusers' attention dispatch is
    imported, the one it will start with (``DIFFUSERS_ATTN_BACKEND``, default
    ``native``), so a process without diffusers loaded matches a capture made
    under that backend with it loaded.  ``processors``: the backends the
    bound model's attention processors name of their own, by module path."""

    backend: str
    """The attention backend's name, as ``attention_backend()`` takes it."""
    processors: tuple[tuple[str, str], ...] = ()
    """``(attention module path, backend)`` for each attention module of the
    bound model whose processor names a backend of its own, sorted (empty: no
    model bound, or every processor follows the global backend)."""


@register_probe
class DiffusersAttentionProbe(ContextProbe[DiffusersAttentionState]):
    """The diffusers attention backend (see the module docstring)."""

    name = "diffusers_attention"
    description = ("diffusers attention backend (attention_backend(), set_attention_backend, "
                   "the bound model's processors); active once diffusers is imported")
    default = True
    traceable = True
    requires = ("diffusers",)

    def __init__(self, module: Any = None) -> None:
        # (path, attention module) by weak reference: a probe keeps no model alive
        self._attention: tuple[tuple[str, weakref.ref[Any]], ...] = ()
        if module is not None:
            self._attention = tuple((path, weakref.ref(m)) for path, m in _attention_of(module))

    def bind(self, module: Any) -> DiffusersAttentionProbe:
        """A probe that also reads ``module``'s processors (the registered one reads none)."""
        return DiffusersAttentionProbe(module)

    def _processors(self) -> tuple[tuple[str, str], ...]:
        found = []
        for path, ref in self._attention:
            name = _processor_backend(ref)
            if name is not None:
                found.append((path, name))
        return tuple(sorted(found))

    def observe(self) -> DiffusersAttentionState:
        reg = _registry()
        if reg is None:
            backend = os.environ.get("DIFFUSERS_ATTN_BACKEND", _NEUTRAL_NAME)
        else:
            backend = _name(getattr(reg, _ATTR))
        return DiffusersAttentionState(backend, self._processors())

    def watch(self, state: DiffusersAttentionState
              ) -> tuple[tuple[Callable[[], object], object], ...]:
        # one C-level read per call: the class attribute (an AttentionBackendName
        # compares equal to its name), or whether the module got imported
        reg = _registry()
        if reg is None:
            return ((partial(sys.modules.get, _MODULE), None),)
        return ((partial(getattr, reg, _ATTR), state.backend),)

    def watch_forward(self, state: DiffusersAttentionState
                      ) -> tuple[tuple[Callable[[], object], object], ...]:
        # one read per attention module of the bound model: once per model
        # call (a model holds dozens; a block call would pay for all of them)
        held = dict(state.processors)
        return tuple((partial(_processor_backend, ref), held.get(path))
                     for path, ref in self._attention)

    def replay(self, state: DiffusersAttentionState) -> AbstractContextManager[None]:
        return _backend(state)

    def split_replay(self, state: DiffusersAttentionState) -> tuple[
            AbstractContextManager[None] | None, AbstractContextManager[None] | None]:
        # Inside the traced callable: diffusers reads the backend while the
        # tracer runs its forward, and the lowering writes a math kernel choice
        # (made inside diffusers' function, by the global backend or by a
        # processor's own) into the graph.
        names = (state.backend, *(n for _, n in state.processors))
        if not any(n.startswith(_SDPA_KERNEL_PREFIX) for n in names):
            return self.replay(state), None
        return composed((partial(self.replay, state), lowering_math_sdpa)), None

    def neutral_state(self) -> DiffusersAttentionState:
        return DiffusersAttentionState(_NEUTRAL_NAME)

    def neutral(self, state: DiffusersAttentionState) -> bool:
        return state.backend == _NEUTRAL_NAME and not state.processors

    def encode(self, state: DiffusersAttentionState) -> dict[str, Any]:
        if not state.processors:
            return {"backend": state.backend}
        return {"backend": state.backend, "processors": [list(p) for p in state.processors]}

    def decode(self, data: Any, path: str) -> DiffusersAttentionState:
        doc = read_mapping(data, path, keys={"backend", "processors"}, required={"backend"})
        name = _read_backend(doc["backend"], f"{path}.backend")
        pairs = read_pairs(doc.get("processors", []), f"{path}.processors",
                           "[attention module path, backend]",
                           partial(read_str, max_len=1000), _read_backend)
        return DiffusersAttentionState(name, tuple(sorted(set(pairs))))

    def describe(self, state: DiffusersAttentionState) -> str:
        if not state.processors:
            return state.backend
        if len(state.processors) <= _DESCRIBED:
            own = ", ".join(f"{p}={n}" for p, n in state.processors)
        else:
            counts = Counter(n for _, n in state.processors)
            own = ", ".join(f"{n} x{c}" for n, c in sorted(counts.items()))
        return f"{state.backend}; processors: {own}"


def _read_backend(value: object, path: str) -> str:
    name = read_str(value, path, max_len=64)
    if not name.replace("_", "a").isalnum():
        raise ValueError(f"{path}: {name!r} is not a diffusers backend name "
                         "(letters, digits and underscores)")
    return name


def _attention_of(module: Any) -> list[tuple[str, Any]]:
    """The submodules whose processor can name a backend (what diffusers'
    ``set_attention_backend`` sets), by path."""
    named = getattr(module, "named_modules", None)
    if not callable(named):
        return []
    found = []
    for path, m in named():
        proc = vars(m).get("processor")
        if proc is not None and hasattr(proc, _PROC_ATTR):
            found.append((path, m))
    return found


def _processor_backend(ref: weakref.ref[Any]) -> str | None:
    """The backend the module's current processor names, ``None`` when it
    names none (or the module is gone)."""
    module = ref()
    if module is None:
        return None
    raw = getattr(vars(module).get("processor"), _PROC_ATTR, None)
    return None if raw is None else _name(raw)


@contextmanager
def _backend(state: DiffusersAttentionState) -> Iterator[None]:
    reg = _registry()
    if reg is None:  # no diffusers attention can run: nothing to establish
        yield
        return
    before = getattr(reg, _ATTR)
    if _name(before) == state.backend:
        yield
        return
    backends = {_name(b): b for b in reg._backends}
    if state.backend not in backends:
        raise ValueError(f"diffusers {_version()} has no attention backend "
                         f"{state.backend!r}; registered: {', '.join(sorted(backends))}")
    setattr(reg, _ATTR, backends[state.backend])
    try:
        yield
    finally:
        setattr(reg, _ATTR, before)
