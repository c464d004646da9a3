"""Weights that hooks put in place around a module's forward (offloading).

accelerate (``cpu_offload``, ``dispatch_model``, a diffusers pipeline's
sequential offload) and diffusers (group offloading, layerwise casting)
keep a module's weights elsewhere between calls -- on the ``meta`` device
with the values in a weights map, on the CPU for a model that runs on a
GPU, in a storage dtype -- and replace the module's ``forward`` with one
that runs a hook's ``pre_forward`` (put the weights in place, move the
inputs), the module's own forward, then the hook's ``post_forward`` (take
them away again).  A capture traced from what such a module holds between
calls sees ``meta`` placeholders, or weights on another device or in
another dtype than the live call ran with.

``weight_hooks(module)`` finds those hooks in a module tree, when every
hook found is one whose only effect is that (the classes in
``WEIGHT_HOOKS``); ``Held.loaded()`` runs their ``pre_forward`` on the
modules (in module order) and their ``post_forward`` after (in reverse),
so whatever sits between is what the live forward had in place -- the
weights a hook loads for a call, the same way it loads them.  Hooks that
change what the forward computes (diffusers' caches, layer skipping) are
not weight hooks: a tree holding one beside a weight hook cannot be
followed (``Held.unknown`` names it).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

__all__ = ["WEIGHT_HOOKS", "Held", "weight_hooks"]

#: module -> class names of the hooks whose only effect around a forward is
#: to put the weights (and the inputs) where the forward runs, and to take
#: the weights away after
WEIGHT_HOOKS: dict[str, frozenset[str]] = {
    # ``ModelHook`` itself does nothing; ``SequentialHook`` is a chain (its
    # members are looked at one by one)
    "accelerate.hooks": frozenset({"ModelHook", "AlignDevicesHook", "CpuOffload",
                                   "UserCpuOffloadHook"}),
    "diffusers.hooks.group_offloading": frozenset({"GroupOffloadingHook",
                                                   "LazyPrefetchGroupOffloadingHook",
                                                   "LayerExecutionTrackerHook"}),
    "diffusers.hooks.layerwise_casting": frozenset({"LayerwiseCastingHook"}),
}


def _known(hook: Any) -> bool:
    cls = type(hook)
    return cls.__name__ in WEIGHT_HOOKS.get(cls.__module__, frozenset())


def _accelerate_hooks(hook: Any) -> list[Any]:
    """An accelerate hook as the list of hooks it runs (a ``SequentialHook``'s members)."""
    if type(hook).__name__ == "SequentialHook" and isinstance(getattr(hook, "hooks", None),
                                                              (list, tuple)):
        return [h for inner in hook.hooks for h in _accelerate_hooks(inner)]
    return [hook]


def _diffusers_hooks(registry: Any) -> list[Any]:
    """The hooks of a diffusers ``HookRegistry``, outermost first."""
    hooks = getattr(registry, "hooks", None)
    order = getattr(registry, "_hook_order", None)
    if not isinstance(hooks, dict):
        return [registry]  # not a registry this reader knows: unknown
    names = list(order) if isinstance(order, list) else list(hooks)
    return [hooks[n] for n in reversed(names) if n in hooks]


class Held:
    """The weight hooks of one module tree: ``entries`` are ``(path, module,
    hooks)`` in module order; ``unknown``: ``path: hook class`` of hooks there that
    are not weight hooks, beside weight hooks (then the tree cannot be followed)."""

    def __init__(self, entries: list[tuple[str, nn.Module, list[Any]]],
                 unknown: list[str]) -> None:
        self.entries = entries
        self.unknown = unknown

    @property
    def hooks(self) -> list[Any]:
        """Every weight hook found (their bookkeeping is not the forward's
        state: they put weights in place and take them away)."""
        return [h for _, _, hooks in self.entries for h in hooks]

    @property
    def paths(self) -> tuple[str, ...]:
        """The submodule paths whose forward a weight hook wraps."""
        return tuple(p for p, _, _ in self.entries)

    def onload(self) -> None:
        """Each hook's ``pre_forward``: the weights in place, as before a forward."""
        for _, module, hooks in self.entries:
            for hook in hooks:
                hook.pre_forward(module)

    def offload(self) -> None:
        """Each hook's ``post_forward``: the weights taken away, as after a forward."""
        for _, module, hooks in reversed(self.entries):
            for hook in reversed(hooks):
                hook.post_forward(module, None)

    @contextmanager
    def loaded(self) -> Iterator[None]:
        """The weights in place inside; taken away again after, also on error."""
        self.onload()
        try:
            yield
        finally:
            self.offload()


def weight_hooks(module: nn.Module) -> Held | None:
    """The weight hooks of ``module``'s tree (``None``: it has none)."""
    entries: list[tuple[str, nn.Module, list[Any]]] = []
    unknown: list[str] = []
    for path, m in module.named_modules():
        found: list[Any] = []
        hf = m.__dict__.get("_hf_hook")
        if hf is not None:
            found += _accelerate_hooks(hf)
        registry = m.__dict__.get("_diffusers_hook")
        if registry is not None:
            found += _diffusers_hooks(registry)
        if not found:
            continue
        known = [h for h in found if _known(h)]
        if len(known) < len(found):
            unknown += [f"{path or '.'}: {type(h).__qualname__}" for h in found
                        if not _known(h)]
        if known and any(type(h).__name__ != "ModelHook" for h in known):
            entries.append((path, m, known))
    if not entries:
        return None
    return Held(entries, unknown)
