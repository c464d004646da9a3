"""Which attributes of a member a trace read: what lets one graph serve members
that differ only in attributes their forward never looks at.

Blocks of a stack differ in plain attributes (a layer's index) that often
only matter on some paths (indexing a cache the call did not get).  A
graph is made by running the forward's Python once; an attribute that run
never read cannot have shaped it.  ``recorded(view, reads)`` notes every
attribute read on the isolated view and its submodules during the first
run of the view's forward that happens in Python (a non-strict
``torch.export`` trace): while that run lasts each module of the view is of
a one-off subclass whose ``__getattribute__`` notes the name.  Hooks of the
submodules run inside that run, so their reads are noted too.  A read of a
module's ``__dict__`` from outside ``nn.Module``'s own code (``vars(self)``,
a copy) counts as a read of every attribute of that module.  Modules the
view reaches outside its submodule tree (an adapter in a plain list, the
model it refers to) are recorded the same way, by where they are found
(``Reads.reached``): their state is a constant of the graph.  A run under
Dynamo (which interprets the bytecode rather than running it, and fails on
a Python ``__getattribute__``) is not recorded, and nothing it made is
served to other members; nor is a run on a view whose modules hold weak
references (a child's ``weakref`` to its parent): ``deepcopy`` keeps them
pointing at the live modules, whose reads are nobody's to note.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import attrs
from torch import nn

from .._base.torchcaps import dynamo_compiling
from .isolate import forward_wrapped

__all__ = ["Reads", "recorded"]

#: the file of ``nn.Module``'s own methods: its ``__getattr__`` and
#: ``__setattr__`` read ``self.__dict__`` for parameters, buffers and
#: submodules, never for a plain attribute's value
_MODULE_FILE = sys.modules[nn.Module.__module__].__file__


@attrs.define(eq=False)
class Reads:
    """What one recorded run read, by submodule path of the view."""

    #: ``id`` of each module of the view -> its paths (a shared one has several)
    paths: dict[int, tuple[str, ...]] = attrs.Factory(dict)
    #: ``id`` of a module -> the attribute names read on it
    names: dict[int, set[str]] = attrs.Factory(dict)
    #: ``id`` of modules whose whole ``__dict__`` was read
    everything: set[int] = attrs.Factory(set)
    #: ``id`` of a module the view reaches but does not hold as a submodule
    #: (one in a list, a parent referred to) -> where it is found from the
    #: view: a submodule path and the ``("attr" | "item", key)`` steps from it
    reached: dict[int, tuple[str, tuple[tuple[str, Any], ...]]] = attrs.Factory(dict)
    #: ``id`` -> each module of the view and each module it reaches
    modules: dict[int, nn.Module] = attrs.Factory(dict)
    #: the recorded run ended normally: every read of the run is here
    complete: bool = False
    #: the next run of the forward in Python is recorded
    armed: bool = True

    def read(self) -> dict[str, set[str] | None]:
        """Path -> names read (``None``: every attribute)."""
        out: dict[str, set[str] | None] = {}
        for ident, paths in self.paths.items():
            names = None if ident in self.everything else self.names.get(ident, set())
            for p in paths:
                out[p] = names
        return out

    def untouched(self, changed: Iterable[tuple[str, str]]) -> bool:
        """Whether the complete run read none of ``changed``
        (``(submodule path, attribute)`` pairs)."""
        if not self.complete:
            return False
        read = self.read()
        for path, name in changed:
            if path not in read:  # a module the run did not know: assume read
                return False
            names = read[path]
            if names is None or name in names:
                return False
        return True


@contextmanager
def recorded(view: nn.Module, reads: Reads) -> Iterator[None]:
    """Inside, the first run of ``view``'s forward in Python notes what it
    reads into ``reads`` (see the module's docstring)."""
    def wrap(orig: Callable[..., Any]) -> Callable[..., Any]:
        def recorded_forward(*args: Any, **kwargs: Any) -> Any:
            if not reads.armed or dynamo_compiling():
                return orig(*args, **kwargs)
            reads.armed = False
            weak = _weak_references(view)  # (before the swap: it reads __dict__)
            swapped, whole = _swap(view, reads)
            try:
                out = orig(*args, **kwargs)
            finally:
                for m, cls, one_off in swapped:
                    if type(m) is one_off:
                        m.__class__ = cls
            reads.complete = whole and not weak
            return out
        return recorded_forward

    with forward_wrapped(view, wrap):
        yield


def _swap(view: nn.Module, reads: Reads) -> tuple[list[tuple[nn.Module, type, type]], bool]:
    """Every module of ``view`` made an instance of a one-off recording
    subclass of its class: ``(module, class, one-off)`` to put back, and
    whether every one could be (a class Python will not swap is left as it
    is, and the run's reads are then not complete)."""
    paths: dict[int, list[str]] = {}
    modules: dict[int, nn.Module] = {}
    for path, m in view.named_modules(remove_duplicate=False):
        paths.setdefault(id(m), []).append(path)
        modules[id(m)] = m
    reads.paths = {k: tuple(v) for k, v in paths.items()}
    reached = reached_modules(view, modules)
    reads.reached = {k: (base, steps) for k, (_, base, steps) in reached.items()}
    modules.update((k, m) for k, (m, _, _) in reached.items())
    reads.modules = dict(modules)
    classes: dict[type, type] = {}
    out = []
    whole = True
    for m in modules.values():
        cls = type(m)
        try:
            if cls not in classes:
                classes[cls] = _recording(cls, reads)
            m.__class__ = classes[cls]
        except TypeError:  # a layout or metaclass that refuses a subclass
            whole = False
            continue
        out.append((m, cls, classes[cls]))
    return out, whole


#: how deep the walk for modules a view reaches goes into the lists, dicts
#: and plain objects it holds, and how many items of each it looks at
_DEPTH = 3
_ITEMS = 16
_NOT_STATE = frozenset({"_parameters", "_buffers", "_modules"}) | frozenset(
    k for k in nn.Module().__dict__)


_Steps = tuple[tuple[str, Any], ...]
_Reached = dict[int, tuple[nn.Module, str, _Steps]]


def reached_modules(view: nn.Module, inside: dict[int, nn.Module]) -> _Reached:
    """The modules ``view``'s modules hold outside their submodule tree (an
    adapter in a plain list, a parent referred to), with their own subtrees:
    ``id`` -> the module, and the submodule path and steps where it is
    first found."""
    out: _Reached = {}
    seen: set[int] = set(inside)
    for path, m in view.named_modules():
        for k, v in m.__dict__.items():
            if k not in _NOT_STATE:
                _reach(v, path, (("attr", k),), out, seen, _DEPTH)
    return out


def _reach(v: Any, base: str, steps: _Steps, out: _Reached, seen: set[int],
           depth: int) -> None:
    if isinstance(v, nn.Module):
        if id(v) in seen:
            return
        for sub, m in v.named_modules():
            if id(m) not in seen:
                seen.add(id(m))
                out[id(m)] = (m, base, steps + tuple(("attr", p) for p in sub.split(".") if p))
        return
    if depth <= 0 or id(v) in seen:
        return
    if type(v) in (list, tuple):
        seen.add(id(v))
        for i, item in enumerate(v[:_ITEMS]):
            _reach(item, base, (*steps, ("item", i)), out, seen, depth - 1)
    elif type(v) is dict:
        seen.add(id(v))
        for key in list(v)[:_ITEMS]:
            if type(key) in (str, int):
                _reach(v[key], base, (*steps, ("item", key)), out, seen, depth - 1)


_WEAK = (weakref.ReferenceType, weakref.ProxyType, weakref.CallableProxyType)


def _weak_references(view: nn.Module) -> bool:
    """Whether a module of ``view`` holds a weak reference as an attribute
    or in a list, tuple or dict it holds (one level down)."""
    for m in view.modules():
        for k, v in m.__dict__.items():
            if k in ("_parameters", "_buffers", "_modules"):
                continue
            items = v.values() if isinstance(v, dict) else \
                v if isinstance(v, (list, tuple)) else (v,)
            if any(isinstance(i, _WEAK) for i in items):
                return True
    return False


def _recording(cls: type, reads: Reads) -> type:
    """A subclass of ``cls`` (same names, so messages and stack traces read
    the same) whose attribute reads are noted in ``reads``."""
    base: Callable[[Any, str], Any] = cls.__getattribute__  # type: ignore[assignment]
    names, everything = reads.names, reads.everything

    def __getattribute__(self: Any, name: str) -> Any:
        if name == "__dict__":
            if sys._getframe(1).f_code.co_filename != _MODULE_FILE:
                everything.add(id(self))
        else:
            seen = names.get(id(self))
            if seen is None:
                seen = names[id(self)] = set()
            seen.add(name)
        return base(self, name)

    # type() builds the class with its base's metaclass, should it have one
    return type(cls.__name__, (cls,), {"__getattribute__": __getattribute__,
                                       "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__})
