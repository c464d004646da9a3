"""Counting which modules' forwards ran, without a module hook.

A hook on a submodule of an installed member makes that member run eagerly
(install's ``hooks`` reason: the graph would skip it), so a test that asks
"did this block's own forward run, or its graph?" cannot count with one.
``forwards_run(modules)`` wraps the forward of each module's class while it
is open (the class attribute: what ``nn.Module.__call__`` looks up, and
nothing install compares) and counts the calls made on those modules.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

__all__ = ["forwards_run"]


@contextmanager
def forwards_run(modules: Iterable[nn.Module]) -> Iterator[list[int]]:
    """Inside, ``count[0]`` is how many times the forward of one of
    ``modules`` ran."""
    count = [0]
    modules = list(modules)
    watched = {id(m) for m in modules}
    classes = {type(m) for m in modules}
    saved: list[tuple[type[nn.Module], bool, Any]] = []
    for cls in classes:
        own = "forward" in cls.__dict__
        orig = cls.forward
        saved.append((cls, own, cls.__dict__.get("forward")))

        def counted(self: nn.Module, *args: Any, _orig: Any = orig, **kwargs: Any) -> Any:
            if id(self) in watched:
                count[0] += 1
            return _orig(self, *args, **kwargs)

        cls.forward = counted  # type: ignore[method-assign]
    try:
        yield count
    finally:
        for cls, own, before in saved:
            if own:
                cls.forward = before  # type: ignore[method-assign]
            else:
                delattr(cls, "forward")
