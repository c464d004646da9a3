"""diffusers' step caches: hooks that decide, on each call, whether a
module's own forward runs or a stored output is reused.

Pyramid Attention Broadcast, FasterCache, FirstBlockCache, MagCache,
TaylorSeer and SeaCache are hooks of diffusers' ``HookRegistry``.  A
registry replaces the module's instance ``forward`` with a chain: each hook
has a function reference (``registry._fn_refs``, innermost first) whose
``forward`` -- or, for a hook that brings its own ``new_forward``, whose
``original_forward`` -- is what that hook calls to run what it wraps.  The
innermost reference's holds the module's own bound forward: that is where a
step is computed, and what it computes does not depend on the cache's state.

So ctxreplay goes *beneath* the hooks: ``inner_seat(module)`` names the
reference and attribute holding the module's own forward, observation and
dispatch wrap that, and the hooks stay Python and keep deciding.  A view of
such a module (``isolate``) runs the class's forward, never a copy of the
hooks.  A module whose tree holds a step-cache hook *below* it cannot be
captured whole: the hooks would be traced into the graph, their decisions
frozen (``below``).
"""

from __future__ import annotations

import weakref
from typing import Any

from torch import nn

from .offload import WEIGHT_HOOKS, weight_hooks

__all__ = ["below", "inner_seat", "step_hooks"]


def _registry(module: nn.Module) -> Any:
    return module.__dict__.get("_diffusers_hook")


def step_hooks(module: nn.Module) -> tuple[str, ...]:
    """The class names of the hooks on ``module``'s own diffusers registry
    that are not weight hooks (``offload.WEIGHT_HOOKS``), innermost first;
    empty for a module without such hooks or a registry of another shape."""
    registry = _registry(module)
    hooks = getattr(registry, "hooks", None)
    order = getattr(registry, "_hook_order", None)
    if not isinstance(hooks, dict) or not isinstance(order, list):
        return ()
    out = []
    for name in order:
        cls = type(hooks.get(name))
        if cls.__name__ not in WEIGHT_HOOKS.get(cls.__module__, frozenset()):
            out.append(cls.__qualname__)
    return tuple(out)


def inner_seat(module: nn.Module) -> tuple[Any, str] | None:
    """``(function reference, attribute)`` where ``module``'s step-cache
    hooks call its own forward; ``None`` when it has none, when it also has
    weight hooks (those are followed apart), or when the chain is not the
    shape diffusers builds (its innermost reference holding the module's
    own bound forward)."""
    hooks = step_hooks(module)
    registry = _registry(module)
    refs = getattr(registry, "_fn_refs", None)
    if not hooks or not isinstance(refs, list) or not refs or \
            len(hooks) != len(getattr(registry, "_hook_order", ())):
        return None
    ref = refs[0]
    name = "original_forward" if getattr(ref, "original_forward", None) is not None \
        else "forward"
    if not _own(getattr(ref, name, None), module):
        return None
    return ref, name


def _own(fn: Any, module: nn.Module) -> bool:
    """Whether ``fn`` calls ``module``'s own forward: it is that bound
    method, or ctxreplay wrappers over it (one a stopped session left in the
    chain calls it through a weak reference)."""
    for _ in range(8):
        owner = getattr(fn, "__self__", None)
        if owner is module:
            return True
        weak = getattr(fn, "module", None)  # a wrapper let go of: its forward, held weakly
        if isinstance(weak, weakref.ref):
            return weak() is module
        if not getattr(type(owner), "ctxreplay_holder", False):
            return False
        fn = getattr(owner, "orig", None)
    return False


def below(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The submodules of ``module`` (its own level left out) that carry
    step-cache hooks and have none below them, ``(path, submodule)`` in
    module order: what a capture of ``module`` goes beneath instead.  None
    for a tree whose weights hooks put in place: those are followed from
    the tree's top (``offload.weight_hooks``), never from a submodule."""
    if weight_hooks(module) is not None:
        return []
    hooked = [(p, m) for p, m in module.named_modules() if p and step_hooks(m)]
    paths = [p for p, _ in hooked]
    return [(p, m) for p, m in hooked
            if not any(q.startswith(p + ".") for q in paths)]
