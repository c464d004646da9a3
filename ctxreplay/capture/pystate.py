"""The Python state a module's forward can reach, recorded shallowly so that
what a run wrote there can be named and put back.

An isolated view (``isolate.isolated``) copies what ``copy.deepcopy`` of a
module reaches, but a forward reaches more than its module's attributes: the
cells of closures (a counter a class's forward advances with ``nonlocal``,
the memo a forward replacement keeps in its enclosing function), the globals
its code names, the objects a replacement ``forward`` is bound to or holds as
a ``functools.partial``'s arguments, and the state of the hooks diffusers'
``HookRegistry`` runs around it (its rewritten forward is a partial of a
closure over the registry's function references).  Running the view ran
those shared objects: a trace left FakeTensors in them, a check advanced the
counter.

``reach(module)`` walks all of it, by identity and bounded, and records each
mutable slot it finds -- an object's ``__dict__`` or slots, a list, dict or
set, a closure cell, a global binding the forward's code names -- as a
shallow copy.  ``changes()`` names the slots whose entries are no longer the
same objects (a tensor the forward assigned is another object; an int it
incremented is another value), and ``restore()`` puts each back.  A shallow
record suffices: any object reachable before a run is itself recorded, and
an object made during the run is only reachable through a slot that changed.

Not followed: tensors (their contents are the graph's, and a view's runs put
back the weights they write), classes, Python modules, ctxreplay's own
wrappers (their ``prev`` alone: what the user's module held), and objects of
torch's or the standard library's types (a logger caches per level, torch's
objects hold native state), which no forward's own state lives in.
"""

from __future__ import annotations

import functools
import sys
import types
import weakref
from collections import OrderedDict, deque
from typing import Any

import torch
from torch import nn

from .offload import weight_hooks

__all__ = ["Reach", "held_constants", "reach"]

#: objects recorded at most: a real video-DiT block reaches a few hundred
_MAX_OBJECTS = 8192
#: how far a walk follows a forward's globals: a module-level dict or plain
#: object it fills, not the whole module graph behind it
_GLOBAL_DEPTH = 2
_ABSENT = object()
#: what every ``nn.Module`` holds for torch itself (its parameter, buffer and
#: submodule tables, a dozen hook tables, mostly empty): the weights are
#: guarded apart, submodules are walked as roots, and a forward keeps no
#: state of its own there; walking them was most of a block's walk
_MODULE_TABLES = frozenset(k for k in nn.Module().__dict__ if k != "training")
_STDLIB = frozenset(getattr(sys, "stdlib_module_names", ())) - {"builtins", "functools"}
_LEAVES = (torch.Tensor, type, types.ModuleType, str, bytes, int, float, bool, complex,
           type(None), torch.dtype, torch.device, range, types.BuiltinFunctionType,
           types.CodeType)


class Reach:
    """The recorded slots of one walk; ``changes`` and ``restore`` compare
    them with what they hold now."""

    __slots__ = ("complete", "slots", "tensors")

    def __init__(self) -> None:
        #: ``id`` -> where, of each tensor the kept state holds (alive: the
        #: records hold them)
        self.tensors: dict[int, str] = {}
        #: ``(kind, holder, key, saved, label)`` per recorded slot
        self.slots: list[tuple[str, Any, Any, Any, str]] = []
        #: whether the walk saw everything reachable (within its bounds)
        self.complete = True

    def changes(self, limit: int = 8) -> list[str]:
        """What differs now, in words (``Memo.last: assigned``), first few."""
        out: list[str] = []
        for kind, holder, key, saved, label in self.slots:
            if kind == "module":
                # a module's own attributes: a tracer sets some (Dynamo's
                # ``_is_torch_compile``), and what a forward assigns there
                # changes the member's identity, which observation keys on
                continue
            if kind in ("dict", "mapping"):
                out += _dict_changes(holder, saved, label, items=kind == "mapping")
            else:
                what = _differs(kind, holder, key, saved)
                if what is not None:
                    out.append(f"{label}: {what}")
            if len(out) >= limit:
                return out[:limit]
        return out

    def restore(self) -> int:
        """Put every changed slot back as recorded; how many were changed."""
        n = 0
        for kind, holder, key, saved, _ in self.slots:
            if _differs(kind, holder, key, saved) is None:
                continue
            n += 1
            try:
                _put_back(kind, holder, key, saved)
            except Exception:  # a slot that refuses (read-only): the rest still go back
                continue
        return n


def held_constants(artifact: Any, gm: Any, before: Reach) -> list[str]:
    """Where each tensor constant of a traced artifact sits in the Python
    state the forward keeps (``before``, the walk of the traced module): a
    step cache's stored output, a memo.  ``torch.export`` lifts such a
    tensor into ``ExportedProgram.constants`` as the very object (measured,
    torch 2.13), a GraphModule holds it as an attribute; the program then
    returns what the cache held when finalize ran, whatever the call."""
    if not before.tensors:
        return []
    found: list[Any] = list(getattr(artifact, "constants", {}).values()) \
        if isinstance(getattr(artifact, "constants", None), dict) else []
    if isinstance(gm, nn.Module):
        found += [t for t in vars(gm).values() if isinstance(t, torch.Tensor)]
        found += [t for _, t in gm.named_buffers()]
    return list(dict.fromkeys(before.tensors[id(t)] for t in found
                              if id(t) in before.tensors))


def reach(module: nn.Module) -> Reach:
    """Record the Python state ``module``'s forward can reach (see the
    module docstring).  The hooks that put the tree's weights in place
    (offloading: ``offload.weight_hooks``) are not walked: what they write
    around every call (accelerate's ``AlignDevicesHook`` its tied-pointer
    set) is theirs, never what the forward computes from."""
    walk = _Walk()
    held = weight_hooks(module)
    if held is not None:
        walk.seen.update(id(h) for h in held.hooks)
    for m in module.modules():
        walk.push(m, type(m).__name__, 0)
        for cls in type(m).__mro__:
            if _foreign(cls):
                continue
            for name, value in list(vars(cls).items()):
                fn = getattr(value, "__func__", value)  # staticmethod, classmethod
                if isinstance(fn, types.FunctionType):
                    walk.push(fn, f"{cls.__qualname__}.{name}", 0)
    walk.run()
    return walk.out


class _Walk:
    def __init__(self) -> None:
        self.out = Reach()
        self.seen: set[int] = set()
        self.stack: list[tuple[Any, str, int]] = []

    def push(self, obj: Any, label: str, depth: int, held: bool = False) -> None:
        """Walk ``obj`` next; ``held``: it sits in the Python state the
        forward keeps (a closure cell, a plain object, a container), not in a
        module's attributes or a global binding."""
        if held and isinstance(obj, torch.Tensor):
            self.out.tensors.setdefault(id(obj), label)
        if not isinstance(obj, _LEAVES) and id(obj) not in self.seen:
            self.stack.append((obj, label, depth))

    def record(self, kind: str, holder: Any, key: Any, saved: Any, label: str) -> None:
        self.out.slots.append((kind, holder, key, saved, label))

    def run(self) -> None:
        budget = _MAX_OBJECTS
        while self.stack:
            obj, label, depth = self.stack.pop()
            if id(obj) in self.seen:
                continue
            if budget <= 0:
                self.out.complete = False
                return
            budget -= 1
            self.seen.add(id(obj))
            try:
                self.visit(obj, label, depth)
            except Exception:  # an object whose state refuses to be read: left alone
                continue

    def visit(self, obj: Any, label: str, depth: int) -> None:
        if _ctxreplays(obj):
            return
        if isinstance(obj, types.FunctionType):
            self.function(obj, label, depth)
        elif isinstance(obj, types.MethodType):
            self.push(obj.__self__, label, depth)
            self.push(obj.__func__, label, depth)
        elif isinstance(obj, functools.partial):
            self.push(obj.func, label, depth)
            for i, a in enumerate(obj.args):
                self.push(a, f"{label}.args[{i}]", depth)
            self.container(obj.keywords, f"{label}.keywords", depth)
        elif isinstance(obj, (list, dict, set, deque, tuple)):
            self.container(obj, label, depth)
        elif getattr(type(obj), "ctxreplay_holder", False):
            # ctxreplay's wrapper: what the module held before it (a
            # replacement forward) is the user's; its own state is not
            self.push(getattr(obj, "prev", None), label, depth)
        elif not _foreign(type(obj)) or isinstance(obj, nn.Module):
            self.plain(obj, label, depth)

    def function(self, fn: types.FunctionType, label: str, depth: int) -> None:
        for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
            try:
                held = cell.cell_contents
            except ValueError:  # an empty cell
                held = _ABSENT
            where = f"{fn.__qualname__} closure {name!r}"
            self.record("cell", cell, None, held, where)
            if held is not _ABSENT:
                self.push(held, where, depth, held=True)
        self.push(fn.__defaults__, label, depth)
        self.push(fn.__kwdefaults__, label, depth)
        if depth >= _GLOBAL_DEPTH:
            return
        g = fn.__globals__
        for name in _global_names(fn.__code__):
            value = g.get(name, _ABSENT)
            if value is _ABSENT or isinstance(value, (type, types.ModuleType)):
                continue
            where = f"{g.get('__name__', '?')}.{name}"
            self.record("global", g, name, value, where)
            self.push(value, where, depth + 1)

    def container(self, obj: Any, label: str, depth: int) -> None:
        if isinstance(obj, dict):
            self.record("mapping", obj, None, dict(dict.items(obj)), label)
            for k, v in list(dict.items(obj)):
                self.push(v, f"{label}[{k!r}]" if isinstance(k, (str, int)) else label, depth,
                          held=True)
            return
        if isinstance(obj, (list, deque)):
            self.record("list", obj, None, _elements(obj), label)
        elif isinstance(obj, set):
            self.record("set", obj, None, set(_elements(obj)), label)
        for i, v in enumerate(_elements(obj)):
            self.push(v, f"{label}[{i}]", depth, held=True)

    def plain(self, obj: Any, label: str, depth: int) -> None:
        d = getattr(obj, "__dict__", None)
        name = type(obj).__name__
        if type(d) is dict:
            self.record("module" if isinstance(obj, nn.Module) else "dict", d, None, dict(d),
                        name)
            module = isinstance(obj, nn.Module)
            for k, v in list(d.items()):
                if module and k == "forward":
                    # another tool's wrapper set above ctxreplay's runs
                    # outside the observed forward: from ctxreplay's down
                    v = _ours_in(v, 4) or v
                if not (module and k in _MODULE_TABLES):
                    self.push(v, f"{name}.{k}", depth, held=not module)
        for slot in _slots(type(obj)):
            value = getattr(obj, slot, _ABSENT)
            self.record("attr", obj, slot, value, f"{name}.{slot}")
            if value is not _ABSENT:
                self.push(value, f"{name}.{slot}", depth)


def _ctxreplays(obj: Any) -> bool:
    """An object or function of ctxreplay's own (its bookkeeping: the
    sampled calls it keeps, its counters), which no user's forward keeps
    state in; ctxreplay's wrappers are followed to what they hold instead."""
    if isinstance(obj, types.FunctionType):
        mod = obj.__module__ or ""
    elif getattr(type(obj), "ctxreplay_holder", False) or isinstance(obj, nn.Module):
        return False
    else:
        mod = getattr(type(obj), "__module__", None) or ""
    return mod == "ctxreplay" or mod.startswith("ctxreplay.")


def _ours_in(value: Any, depth: int) -> Any:
    """The ctxreplay wrapper in a chain of forwards (bound methods, partials,
    callable objects, closures) ``depth`` steps deep at most, or ``None``."""
    if depth <= 0 or value is None:
        return None
    if getattr(type(value), "ctxreplay_holder", False):
        return value
    if isinstance(value, types.MethodType):
        inner: list[Any] = [value.__self__]
    elif isinstance(value, functools.partial):
        inner = [value.func, *value.args]
    elif isinstance(value, types.FunctionType):
        inner = [c.cell_contents for c in value.__closure__ or ()
                 if not _empty_cell(c)]
    elif callable(value) and type(getattr(value, "__dict__", None)) is dict:
        inner = [v for v in vars(value).values() if callable(v)]
    else:
        return None
    for v in inner:
        found = _ours_in(v, depth - 1)
        if found is not None:
            return found
    return None


def _empty_cell(cell: Any) -> bool:
    try:
        _ = cell.cell_contents
    except ValueError:
        return True
    return False


def _elements(obj: Any) -> list[Any]:
    """A list's, set's or deque's items, read with the base class's own
    methods where a subclass may override them."""
    if isinstance(obj, list):
        return list.copy(obj)
    if isinstance(obj, set):
        return list(set.__iter__(obj))
    return list(obj)


def _foreign(cls: type) -> bool:
    """A type of torch's or the standard library's (or ``object``)."""
    mod = getattr(cls, "__module__", None) or ""
    top = mod.partition(".")[0]
    return cls is object or top in _STDLIB or top == "builtins" or \
        (top == "torch" and not mod.startswith("torch.testing"))


@functools.lru_cache(maxsize=4096)
def _global_names(code: types.CodeType) -> tuple[str, ...]:
    """The global names a code object (and the code nested in it) can read
    or write."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names.update(_global_names(const))
    return tuple(sorted(names))


#: class -> the slot names its instances have (read once per class; weakly:
#: a capture makes one-off classes)
_SLOTS: weakref.WeakKeyDictionary[type, tuple[str, ...]] = weakref.WeakKeyDictionary()


def _slots(cls: type) -> tuple[str, ...]:
    found = _SLOTS.get(cls)
    if found is not None:
        return found
    out: list[str] = []
    for c in cls.__mro__:
        s = c.__dict__.get("__slots__", ())
        for name in (s,) if isinstance(s, str) else s:
            if name not in ("__dict__", "__weakref__") and name not in out:
                out.append(name)
    _SLOTS[cls] = tuple(out)
    return _SLOTS[cls]


#: values compared by value: a tracer may put back an equal tuple of ints
#: (a LayerNorm's ``normalized_shape``) where the forward changed nothing
_VALUES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)


def _same(now: Any, saved: Any) -> bool:
    if now is saved:
        return True
    if type(now) is not type(saved):
        return False
    if isinstance(now, _VALUES):
        return bool(now == saved)
    if type(now) is tuple:
        return len(now) == len(saved) and all(_same(a, b) for a, b in zip(now, saved))
    return False


def _differs(kind: str, holder: Any, key: Any, saved: Any) -> str | None:
    """How a slot differs from its record (``None``: it does not)."""
    if kind == "cell":
        try:
            now = holder.cell_contents
        except ValueError:
            now = _ABSENT
        return None if _same(now, saved) else _assigned(now)
    if kind == "global" or kind == "attr":
        now = holder.get(key, _ABSENT) if kind == "global" else getattr(holder, key, _ABSENT)
        return None if _same(now, saved) else _assigned(now)
    if kind in ("dict", "mapping", "module"):
        return _dict_change(holder, saved)
    if kind == "set":
        now = _elements(holder)
        return None if set(now) == saved and {id(x) for x in now} == {id(x) for x in saved} \
            else f"changed ({len(saved)} -> {len(holder)} items)"
    now_items = _elements(holder)
    if len(now_items) == len(saved) and all(_same(a, b) for a, b in zip(now_items, saved)):
        return None
    return f"changed ({len(saved)} -> {len(now_items)} items)"


def _dict_change(d: dict[Any, Any], saved: dict[Any, Any]) -> str | None:
    if len(d) == len(saved) and all(_same(v, saved.get(k, _ABSENT))
                                    for k, v in dict.items(d)):
        return None
    return "changed"


def _dict_changes(d: dict[Any, Any], saved: dict[Any, Any], label: str, items: bool
                  ) -> list[str]:
    """Each key of ``d`` (an object's attributes, or ``items``) that differs
    from its record, in words."""
    if _dict_change(d, saved) is None:
        return []
    out = []
    for k in [*saved, *(k for k in dict.keys(d) if k not in saved)]:
        now = dict.get(d, k, _ABSENT)
        if not _same(now, saved.get(k, _ABSENT)):
            step = f".{k}" if not items and isinstance(k, str) else f"[{k!r}]"
            out.append(f"{label}{step}: {_assigned(now)}")
    return out


def _assigned(now: Any) -> str:
    # a trace assigns FakeTensors where the live call assigned tensors
    kind = "Tensor" if isinstance(now, torch.Tensor) else type(now).__name__
    return "deleted" if now is _ABSENT else f"assigned (new {kind})"


def _put_back(kind: str, holder: Any, key: Any, saved: Any) -> None:
    if kind == "cell":
        if saved is _ABSENT:
            del holder.cell_contents
        else:
            holder.cell_contents = saved
    elif kind == "global":
        if saved is _ABSENT:
            holder.pop(key, None)
        else:
            holder[key] = saved
    elif kind == "attr":
        if saved is _ABSENT:
            delattr(holder, key)
        else:
            setattr(holder, key, saved)
    elif kind in ("dict", "mapping", "module"):
        # the base class's own methods: a subclass may override them
        # (transformers' ACT2FN instantiates the class an item names)
        base: Any = OrderedDict if isinstance(holder, OrderedDict) else dict
        for k in [k for k in dict.keys(holder) if k not in saved]:
            base.__delitem__(holder, k)
        for k, v in saved.items():
            if not _same(dict.get(holder, k, _ABSENT), v):
                base.__setitem__(holder, k, v)
    elif kind == "set":
        set.clear(holder)
        set.update(holder, saved)
    elif isinstance(holder, list):
        list.__setitem__(holder, slice(None), saved)
    else:  # a deque
        holder.clear()
        holder.extend(saved)
