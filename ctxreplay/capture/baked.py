"""What a trace baked into its program, found from what it read.

``baked_of(view, reads)`` turns the attribute reads a non-strict trace
noted (``capture.reads``) and the globals its forward's code loads into
the places a program's constants came from (``specs.baked.Source``):

* a tensor that is no parameter or buffer of the view (an attribute, one
  in a list or dict, a parameter of a module the view only refers to);
* a small Python value read from a class (``self.mode`` found on the
  class), from a module the view only refers to, or from a list, dict or
  set a submodule holds (a change in place assigns nothing);
* a small Python value or tensor a module global holds (``MODE``,
  ``knobs.MODE``), loaded by the ``forward`` of a module the trace read
  from, by a method it read, or by a function those load from their
  globals -- the user's own code (not torch, ctxreplay, the standard
  library or an installed package), read
  from its bytecode (a global on a path the trace did not take is guarded
  too: a change there runs calls eagerly, never wrongly).  Code of installed
  packages (transformers, diffusers) is not scanned: its globals are its
  own settings.

A submodule's own plain attributes that cannot change in place (numbers,
strings, tuples) are left out: they are part of its identity, which
``install`` holds a member to, and an assignment to one is seen there.
"""

from __future__ import annotations

import dis
import functools
import inspect
import os
import sys
import sysconfig
import types
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..specs.baked import Baked, Source, digest, plain
from .reads import Reads

__all__ = ["baked_of"]

#: nn.Module's own attribute names: its machinery, never state the program bakes
_MODULE_NAMES = frozenset(dir(nn.Module)) | frozenset(nn.Module().__dict__)
_DEPTH = 3
_ITEMS = 16
_CODES = 256
_Steps = tuple[tuple[str, Any], ...]
_NONE = object()


def baked_of(view: nn.Module, reads: Reads) -> Baked:
    """The places ``view``'s trace read state from (``reads``: what the
    trace noted; every place it can tell where that is not complete)."""
    found: dict[tuple[bool, str, _Steps], Source] = {}
    own = {id(t) for t in (*view.parameters(), *view.buffers())}
    functions: list[types.FunctionType] = []
    for ident, names in reads.names.items():
        m = reads.modules.get(ident)
        if m is None:
            continue
        inside = ident in reads.paths
        base, steps = (reads.paths[ident][0], ()) if inside else reads.reached[ident]
        for name in sorted(names):
            for s in _attribute(m, name, base, steps, inside, own, functions):
                found.setdefault((s.global_, s.base, s.steps), s)
    functions += [f for m in reads.modules.values()
                  if isinstance(f := getattr(type(m), "forward", None), types.FunctionType)]
    for s in _globals(functions):
        found.setdefault((s.global_, s.base, s.steps), s)
    return Baked(tuple(found.values()), reads.complete)


def _attribute(m: nn.Module, name: str, base: str, steps: _Steps, inside: bool,
               own: set[int], functions: list[types.FunctionType]) -> Iterator[Source]:
    """The places under attribute ``name`` of ``m`` the program took state
    from (a method read is scanned for the globals it loads)."""
    in_dict = name in m.__dict__
    value = m.__dict__[name] if in_dict else inspect.getattr_static(m, name, _NONE)
    if isinstance(value, types.FunctionType):
        functions.append(value)
    if name in m._parameters or name in m._buffers:
        if not inside:  # a module the view only refers to: its tensors are constants
            t = m._parameters.get(name) if name in m._parameters else m._buffers.get(name)
            if t is not None and _digestible(t):
                yield Source(base, (*steps, ("attr", name)), "tensor", digest(t))
        return
    if name in _MODULE_NAMES or name in m._modules or value is _NONE:
        return
    if not in_dict and hasattr(type(value), "__get__"):
        return  # a method, property or descriptor: code, not state
    # a submodule's own immutable attribute: its identity holds it
    mutable = not inside or not in_dict or type(value) in (list, dict, set)
    yield from _sources(value, base, (*steps, ("attr", name)), own, mutable, _DEPTH)


def _sources(value: Any, base: str, steps: _Steps, own: set[int], mutable: bool,
             depth: int, global_: bool = False) -> Iterator[Source]:
    if isinstance(value, torch.Tensor):
        if id(value) not in own and _digestible(value):
            yield Source(base, steps, "tensor", digest(value), global_)
        return
    if isinstance(value, (nn.Module, type, types.ModuleType)) or callable(value):
        return
    if plain(value):
        if mutable:
            yield Source(base, steps, "value", digest(value), global_)
        return
    if depth <= 0:
        return
    if type(value) in (list, tuple):
        for i, item in enumerate(value[:_ITEMS]):
            yield from _sources(item, base, (*steps, ("item", i)), own, True, depth - 1, global_)
    elif type(value) is dict:
        for key in list(value)[:_ITEMS]:
            if type(key) in (str, int):
                yield from _sources(value[key], base, (*steps, ("item", key)), own, True,
                                    depth - 1, global_)


def _digestible(t: torch.Tensor) -> bool:
    """A dense tensor whose values can be read here (not a fake, meta or
    wrapper tensor: a DTensor's shard is no constant of one process)."""
    return type(t) in (torch.Tensor, nn.Parameter) and t.layout == torch.strided and \
        t.device.type != "meta"


# -- globals the forward's code loads ---------------------------------------------

def _library_dirs() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    dirs = {os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)),
            paths["stdlib"]}
    return tuple(os.path.join(d, "") for d in dirs)


_LIBRARY = _library_dirs()
#: installed packages (a venv's ``platstdlib`` holds its site-packages; a
#: system Python's does not): what is scanned must not depend on which
_INSTALLED = (f"{os.sep}site-packages{os.sep}", f"{os.sep}dist-packages{os.sep}")


def _user_code(code: types.CodeType) -> bool:
    """Code of the user's own files: not generated (``<string>``), not
    torch's, ctxreplay's, the standard library's or an installed package's
    (their module globals are settings of theirs, not a pipeline's state)."""
    f = code.co_filename
    return not f.startswith("<") and not f.startswith(_LIBRARY) and \
        not any(part in f for part in _INSTALLED)


def _globals(functions: list[types.FunctionType]) -> Iterator[Source]:
    """The module globals the user code of ``functions`` loads, and of the
    functions it loads from them."""
    todo = [(f.__code__, f.__globals__) for f in functions]
    seen: set[int] = set()
    while todo and len(seen) < _CODES:
        code, globs = todo.pop()
        if id(code) in seen or not _user_code(code):
            continue
        seen.add(id(code))
        todo += [(c, globs) for c in code.co_consts if isinstance(c, types.CodeType)]
        for chain in _chains(code):
            yield from _global(chain, globs, todo)


@functools.lru_cache(maxsize=4096)
def _chains(code: types.CodeType) -> tuple[tuple[str, ...], ...]:
    """Each ``NAME.attr.attr`` a code object loads from its globals."""
    return tuple(_chained(code))


def _chained(code: types.CodeType) -> Iterator[tuple[str, ...]]:
    chain: list[str] = []
    for ins in dis.get_instructions(code):
        if ins.opname == "LOAD_GLOBAL":
            if chain:
                yield tuple(chain)
            chain = [str(ins.argval)]
        elif chain and ins.opname in ("LOAD_ATTR", "LOAD_METHOD"):
            chain.append(str(ins.argval))
        elif chain:
            yield tuple(chain)
            chain = []
    if chain:
        yield tuple(chain)


def _global(chain: tuple[str, ...], globs: dict[str, Any],
            todo: list[tuple[types.CodeType, dict[str, Any]]]) -> Iterator[Source]:
    """The state at the first value along ``chain`` that is not a module or
    class (a function found there is scanned in turn)."""
    module = globs.get("__name__")
    if chain[0] not in globs or not isinstance(module, str) or sys.modules.get(module) is None:
        return
    obj = globs[chain[0]]
    steps: _Steps = (("attr", chain[0]),)
    for name in chain[1:]:
        if not isinstance(obj, (types.ModuleType, type)):
            break
        if isinstance(obj, types.ModuleType) and sys.modules.get(obj.__name__) is obj:
            module, steps = obj.__name__, ()  # found from the module that holds it
        try:
            obj = inspect.getattr_static(obj, name)
        except AttributeError:
            return
        steps = (*steps, ("attr", name))
    if isinstance(obj, types.FunctionType):
        todo.append((obj.__code__, obj.__globals__))
        return
    if isinstance(obj, (types.ModuleType, type)) or hasattr(type(obj), "__get__"):
        return
    yield from _sources(obj, module, steps, set(), True, 1, global_=True)


# -- the places a forward's code reads, before any trace --------------------------

def static_places(module: nn.Module) -> tuple[Source, ...]:
    """The places the code of ``module``'s forward and its submodules'
    reads, from their bytecode (no run): ``self.NAME`` and ``self.NAME.FIELD``
    that hold a tensor (no parameter or buffer), ``None``, a list, dict or set,
    a field of a plain object, or a class attribute; and the module globals
    it loads.  A submodule's immutable plain attributes are left out, as in
    ``baked_of``.  Their digests are empty: an observer compares what they
    hold from call to call, not with a trace."""
    found: dict[tuple[bool, str, _Steps], Source] = {}
    functions: list[types.FunctionType] = []
    for path, m in module.named_modules():
        for chain in _self_chains(type(m), functions):
            for s in _place(m, path, chain):
                found.setdefault((s.global_, s.base, s.steps), s)
    for s in _globals(functions):
        found.setdefault((s.global_, s.base, s.steps), s)
    return tuple(found.values())


def _self_chains(cls: type, functions: list[types.FunctionType]) -> set[tuple[str, ...]]:
    """Each ``self.a.b`` the user code of ``cls.forward`` loads, and of the
    methods it calls on ``self`` (those functions are noted in ``functions``)."""
    out: set[tuple[str, ...]] = set()
    todo = [f for f in (getattr(cls, "forward", None),) if isinstance(f, types.FunctionType)]
    seen: set[int] = set()
    while todo and len(seen) < _CODES:
        f = todo.pop()
        if id(f) in seen or not _user_code(f.__code__):
            continue
        seen.add(id(f))
        functions.append(f)
        for chain in _loads_of_self(f.__code__):
            out.add(chain)
            method = inspect.getattr_static(cls, chain[0], None)
            if isinstance(method, types.FunctionType):
                todo.append(method)
    return out


@functools.lru_cache(maxsize=4096)
def _loads_of_self(code: types.CodeType) -> tuple[tuple[str, ...], ...]:
    """Each ``self.a.b`` chain ``code`` loads (``self``: its first argument)."""
    if not code.co_argcount:
        return ()
    me = code.co_varnames[0]
    out: list[tuple[str, ...]] = []
    chain: list[str] | None = None
    for ins in dis.get_instructions(code):
        if ins.opname in ("LOAD_ATTR", "LOAD_METHOD") and chain is not None:
            chain.append(str(ins.argval))
            continue
        if chain:
            out.append(tuple(chain))
        chain = [] if ins.opname == "LOAD_FAST" and ins.argval == me else None
    if chain:
        out.append(tuple(chain))
    return tuple(out)


def _place(m: nn.Module, path: str, chain: tuple[str, ...]) -> Iterator[Source]:
    name = chain[0]
    if name in _MODULE_NAMES or name in m._modules or name in m._parameters \
            or name in m._buffers:
        return
    steps: _Steps = (("attr", name),)
    if name in m.__dict__:
        value = m.__dict__[name]
        if value is None or isinstance(value, torch.Tensor) or type(value) in (list, dict, set):
            yield from _sources(value, path, steps, set(), True, 1) if value is not None \
                else iter((Source(path, steps, "value", ""),))
        elif len(chain) > 1 and _plain_object(value):
            field = getattr(value, chain[1], _NONE)
            if field is not _NONE:
                yield from _sources(field, path, (*steps, ("attr", chain[1])), set(), True, 1)
        return
    value = inspect.getattr_static(m, name, _NONE)
    if value is not _NONE and not hasattr(type(value), "__get__"):
        yield from _sources(value, path, steps, set(), True, 1)  # a class attribute


def _plain_object(value: Any) -> bool:
    """An object of the user's that keeps fields in a ``__dict__`` (a
    ``SimpleNamespace``, a dataclass): no module, class, function or tensor."""
    return type(getattr(value, "__dict__", None)) is dict and not isinstance(
        value, (nn.Module, type, types.ModuleType, torch.Tensor)) and not callable(value)


def argument_attributes(module: nn.Module) -> tuple[tuple[int, str, str], ...]:
    """``(position, argument, attribute)`` for each Python attribute the user
    code of ``module``'s forward reads off an argument (``x._uncond``,
    ``getattr(x, "_uncond", False)``) that is no attribute of a tensor: a
    pipeline may tag the tensors it passes, which no signature records."""
    f = getattr(type(module), "forward", None)
    if not isinstance(f, types.FunctionType) or not _user_code(f.__code__):
        return ()
    code = f.__code__
    names = code.co_varnames[1:code.co_argcount + code.co_kwonlyargcount]
    out: dict[tuple[int, str, str], None] = {}
    ins = list(dis.get_instructions(code))
    for k, i in enumerate(ins[:-1]):
        if i.opname != "LOAD_FAST" or i.argval not in names:
            continue
        nxt, prev = ins[k + 1], ins[k - 1] if k else None
        attr = nxt.argval if nxt.opname == "LOAD_ATTR" else \
            nxt.argval if nxt.opname == "LOAD_CONST" and prev is not None and \
            prev.opname == "LOAD_GLOBAL" and prev.argval in ("getattr", "hasattr") else None
        if isinstance(attr, str) and not hasattr(torch.Tensor, attr):
            out[(names.index(i.argval), str(i.argval), attr)] = None
    return tuple(out)
