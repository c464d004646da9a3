"""transformers' attention implementation: the kernel each model's attention
layers run.

transformers (read on 5.24) picks a layer's attention function per call from
``self.config._attn_implementation`` (``eager``, ``sdpa``, ``flex_attention``,
...), a property over the config's ``_attn_implementation_internal`` that
``model.set_attn_implementation(...)`` rewrites.  The state lives on the
model, not in the process: ``capture_with`` and ``install`` bind the probe to
their model (``ContextProbe.bind``: a probe of its own, reading that model's
configs by weak reference; the registered probe reads none), and it observes
the distinct ``(config class, implementation)`` pairs -- so a switch between
calls starts a new variant, one capture per implementation.

Replayed around the traced forward (``baked``) by overriding
``_attn_implementation`` on the config's class (capture traces an isolated
copy of the model, whose config is a copy): the implementation is Python
control flow, so the graph holds the chosen kernel's ops and the artifact
carries it.  Portable as the pairs.  A model holding configs of one class
under two implementations cannot be replayed (one class, one override): that
capture fails with a clear error rather than trace the wrong one.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from functools import partial
from typing import Any

import attrs

from .._base.jsonread import read_list, read_mapping, read_str
from ..core.probe import ContextProbe, FrameworkStateError
from ..core.registry import register_probe

__all__ = ["TransformersAttentionProbe", "TransformersAttentionState"]

_INTERNAL = "_attn_implementation_internal"
_PROPERTY = "_attn_implementation"
_MISSING = object()


def _version() -> str:
    return str(getattr(sys.modules.get("transformers"), "__version__", "unknown"))


def _is_transformers(obj: object) -> bool:
    return any(c.__module__.startswith("transformers.") for c in type(obj).__mro__)


@attrs.frozen(cache_hash=True)
class TransformersAttentionState:
    """``implementations``: the distinct ``(config class, implementation)``
    pairs of the bound model's configs, sorted (empty: no model bound)."""

    implementations: tuple[tuple[str, str], ...] = ()
    """``(config class, attn_implementation)`` pairs, sorted."""


@register_probe
class TransformersAttentionProbe(ContextProbe[TransformersAttentionState]):
    """The attention implementation of transformers models (see the module docstring)."""

    name = "transformers_attention"
    description = ("transformers attention implementation of the observed model's configs "
                   "(set_attn_implementation); active once transformers is imported")
    default = True
    # replayed around the capture (Dynamo cannot trace a class attribute being
    # set), yet carried: the graph holds the attention function it chose
    baked = True
    requires = ("transformers",)

    def __init__(self, module: Any = None) -> None:
        self._configs: tuple[weakref.ref[Any], ...] = ()
        self._classes: dict[str, type] = {}
        self._moved: str | None = None
        if module is not None:
            self._read(module)

    def bind(self, module: Any) -> TransformersAttentionProbe:
        """A probe that reads ``module``'s configs (the registered one reads none)."""
        return TransformersAttentionProbe(module)

    def _read(self, module: Any) -> None:
        refs = []
        for cfg in _configs_of(module):
            if not isinstance(vars(cfg).get(_INTERNAL, _MISSING), (str, type(None))):
                self._moved = (f"{type(cfg).__qualname__}.{_INTERNAL} is not there; the "
                               "transformers_attention probe reads it (present in "
                               "transformers 5.24)")
                continue
            refs.append(weakref.ref(cfg))  # weakly: a probe keeps no model alive
            self._classes[type(cfg).__qualname__] = type(cfg)
        self._configs = tuple(refs)

    def _live(self) -> list[Any]:
        found = [ref() for ref in self._configs]
        return [c for c in found if c is not None]

    # -- the probe ------------------------------------------------------------------
    def observe(self) -> TransformersAttentionState:
        if self._moved is not None:
            raise FrameworkStateError("transformers", _version(), self._moved)
        pairs = {(type(c).__qualname__, str(vars(c).get(_INTERNAL))) for c in self._live()}
        return TransformersAttentionState(tuple(sorted(pairs)))

    def watch(self, state: TransformersAttentionState
              ) -> tuple[tuple[Callable[[], object], object], ...]:
        # one C-level read per config of the bound model: the config's own
        # dict, not getattr -- PreTrainedConfig.__getattribute__ is Python (its
        # attribute map), 4.2 us a read against 30 ns (measured)
        checks: list[tuple[Callable[[], object], object]] = []
        for cfg in self._live():
            held = vars(cfg)
            checks.append((partial(held.get, _INTERNAL), held.get(_INTERNAL)))
        return tuple(checks)

    def replay(self, state: TransformersAttentionState) -> AbstractContextManager[None]:
        return _overriding(self._classes, state)

    def neutral_state(self) -> TransformersAttentionState:
        return TransformersAttentionState()

    def neutral(self, state: TransformersAttentionState) -> bool:
        return not state.implementations

    def encode(self, state: TransformersAttentionState) -> dict[str, Any]:
        return {"implementations": [list(p) for p in state.implementations]}

    def decode(self, data: Any, path: str) -> TransformersAttentionState:
        doc = read_mapping(data, path, keys={"implementations"}, required={"implementations"})
        pairs = []
        for i, item in enumerate(read_list(doc["implementations"], f"{path}.implementations")):
            where = f"{path}.implementations[{i}]"
            pair = read_list(item, where, max_len=2)
            if len(pair) != 2:
                raise ValueError(f"{where}: expected [config class, implementation]")
            pairs.append((read_str(pair[0], f"{where}[0]", max_len=200),
                          read_str(pair[1], f"{where}[1]", max_len=200)))
        return TransformersAttentionState(tuple(sorted(set(pairs))))

    def describe(self, state: TransformersAttentionState) -> str:
        if not state.implementations:
            return "none"  # no transformers model bound
        return ", ".join(f"{c}: {i}" for c, i in state.implementations)


def _configs_of(module: Any) -> list[Any]:
    """The transformers configs the module's submodules hold, each once."""
    seen: dict[int, Any] = {}
    modules = getattr(module, "modules", None)
    if not callable(modules):
        return []
    for m in modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and _is_transformers(cfg):
            seen.setdefault(id(cfg), cfg)
    return list(seen.values())


def _constant(value: str) -> Callable[[Any], str]:
    def get(self: Any) -> str:
        return value
    return get


@contextmanager
def _overriding(classes: dict[str, type], state: TransformersAttentionState) -> Iterator[None]:
    wanted: dict[str, str] = {}
    for cls_name, impl in state.implementations:
        if wanted.setdefault(cls_name, impl) != impl:
            raise ValueError(f"transformers_attention: {cls_name} is bound under two "
                             f"implementations ({wanted[cls_name]!r}, {impl!r}); one class "
                             "can be replayed under one: capture such models one at a time")
    targets = []
    for cls_name, impl in wanted.items():
        cls = classes.get(cls_name)
        if cls is None:
            raise ValueError(f"transformers_attention: this probe is bound to no model with a "
                             f"{cls_name} config; bound: {sorted(classes) or 'none'}")
        targets.append((cls, impl, cls.__dict__.get(_PROPERTY, _MISSING)))
    try:
        for cls, impl, _ in targets:
            setattr(cls, _PROPERTY, property(_constant(impl)))
        yield
    finally:
        for cls, _, before in reversed(targets):
            if before is _MISSING:
                delattr(cls, _PROPERTY)
            else:
                setattr(cls, _PROPERTY, before)
