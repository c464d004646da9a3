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
as every probe state, checked by the install guard.  Only the process-global
backend is observed: a backend set on a model's processors
(``model.set_attention_backend``) also sets the global one, but one changed
on the processors alone is not seen.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from functools import partial
from typing import Any

import attrs

from .._base.jsonread import read_mapping, read_str
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
    under that backend with it loaded."""

    backend: str
    """The attention backend's name, as ``attention_backend()`` takes it."""


@register_probe
class DiffusersAttentionProbe(ContextProbe[DiffusersAttentionState]):
    """The diffusers attention backend (see the module docstring)."""

    name = "diffusers_attention"
    description = ("diffusers attention backend (attention_backend(), set_attention_backend); "
                   "active once diffusers is imported")
    default = True
    traceable = True
    requires = ("diffusers",)

    def observe(self) -> DiffusersAttentionState:
        reg = _registry()
        if reg is None:
            return DiffusersAttentionState(os.environ.get("DIFFUSERS_ATTN_BACKEND", _NEUTRAL_NAME))
        return DiffusersAttentionState(_name(getattr(reg, _ATTR)))

    def watch(self, state: DiffusersAttentionState
              ) -> tuple[tuple[Callable[[], object], object], ...]:
        # one C-level read per call: the class attribute (an AttentionBackendName
        # compares equal to its name), or whether the module got imported
        reg = _registry()
        if reg is None:
            return ((partial(sys.modules.get, _MODULE), None),)
        return ((partial(getattr, reg, _ATTR), state.backend),)

    def replay(self, state: DiffusersAttentionState) -> AbstractContextManager[None]:
        return _backend(state)

    def split_replay(self, state: DiffusersAttentionState) -> tuple[
            AbstractContextManager[None] | None, AbstractContextManager[None] | None]:
        # Inside the traced callable: diffusers reads the backend while the
        # tracer runs its forward, and the lowering writes a math kernel choice
        # (made inside diffusers' function) into the graph.
        if not state.backend.startswith(_SDPA_KERNEL_PREFIX):
            return self.replay(state), None
        return composed((partial(self.replay, state), lowering_math_sdpa)), None

    def neutral_state(self) -> DiffusersAttentionState:
        return DiffusersAttentionState(_NEUTRAL_NAME)

    def neutral(self, state: DiffusersAttentionState) -> bool:
        return state.backend == _NEUTRAL_NAME

    def encode(self, state: DiffusersAttentionState) -> dict[str, Any]:
        return {"backend": state.backend}

    def decode(self, data: Any, path: str) -> DiffusersAttentionState:
        doc = read_mapping(data, path, keys={"backend"}, required={"backend"})
        name = read_str(doc["backend"], f"{path}.backend", max_len=64)
        if not name.replace("_", "a").isalnum():
            raise ValueError(f"{path}.backend: {name!r} is not a diffusers backend name "
                             "(letters, digits and underscores)")
        return DiffusersAttentionState(name)

    def describe(self, state: DiffusersAttentionState) -> str:
        return state.backend


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
