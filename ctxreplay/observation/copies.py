"""An observed model stays a plain model to whatever copies, scripts or
inspects it.

While a session is open, ctxreplay's wrappers are instance attributes of
the modules it observes (``forward``).  Three things would see them:

* **Copies** -- ``copy.deepcopy``, ``pickle``, ``torch.save`` -- would carry
  a pass-through ``forward`` forever, which ``torch.jit.script`` of the copy
  then refuses (``*args``).
* **torch.jit.script** of the live model would compile the wrapper.
* **Signature readers** -- ``torch.jit.trace`` naming its inputs, a
  framework reading ``inspect.signature(module.forward)`` for its keyword
  arguments -- would see ``(*args, **kwargs)``.

So every module on a path from the root to a member answers copies and
scripting itself, through instance entries (``ENTRIES``) that ``Entries``
installs and removes exactly: a copy is made the way the module's class
makes it and ctxreplay's entries are left out of it; ``torch.jit.script``
scripts such a copy, its parameters and buffers shared with the live model
(torch puts what ``__prepare_scriptable__`` returns into the parent's
submodules, so each module on the path must answer for itself, or a live
member would be replaced by its copy).  ``signed`` gives a wrapper the
signature of the forward it wraps.

A holder of ctxreplay's wrappers (observation's and dispatch's, through
``observation.modules.Holder``, and ``observation.modules.Detached``) has ``ctxreplay_holder =
True`` and ``user_forward()``: the instance ``forward`` the module had before
ctxreplay, or ``None``.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import types
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

__all__ = ["ENTRIES", "Entries", "is_ours", "path_modules", "plain_state", "signed"]

#: the instance attributes ``Entries`` sets on a module while observed
ENTRIES = ("__deepcopy__", "__reduce_ex__", "__prepare_scriptable__")
_MISSING = object()


def is_ours(value: Any) -> bool:
    """Whether ``value`` is a bound method of one of ctxreplay's holders."""
    holder = getattr(value, "__self__", None)
    return bool(getattr(type(holder), "ctxreplay_holder", False))


def callees(fn: Any, budget: int = 64) -> Iterator[Any]:
    """``fn`` and what calling it calls, as far as wrappers say so the usual
    ways: ``__wrapped__`` (``functools.wraps``, accelerate's hooks), a
    bound method's function, a ``functools.partial``'s function and
    arguments, a function's closure cells and default arguments, and the
    ``orig`` of ctxreplay's own wrappers.  At most ``budget`` callables;
    modules are not looked into."""
    stack, seen = [fn], set()
    while stack and budget > 0:
        f = stack.pop()
        budget -= 1
        if f is None or isinstance(f, nn.Module) or id(f) in seen:
            continue
        seen.add(id(f))
        yield f
        holder = getattr(f, "__self__", None)
        if getattr(type(holder), "ctxreplay_holder", False):
            stack.append(getattr(holder, "orig", None))
            continue
        if isinstance(f, functools.partial):
            stack += [f.func, *f.args, *f.keywords.values()]
        for name in ("__wrapped__", "__func__"):
            inner = getattr(f, name, None)
            if inner is not None:
                stack.append(inner)
        for cell in getattr(f, "__closure__", None) or ():
            try:
                stack.append(cell.cell_contents)
            except ValueError:  # an empty cell
                continue
        stack += [*(getattr(f, "__defaults__", None) or ()),
                  *(getattr(f, "__kwdefaults__", None) or {}).values()]


def plain_state(state: dict[str, Any]) -> dict[str, Any]:
    """A module's ``__dict__`` without ctxreplay's entries: ``forward`` is
    what the module had before ctxreplay (absent if nothing)."""
    out = {}
    for key, value in state.items():
        if not is_ours(value):
            out[key] = value
        elif key == "forward":
            before = value.__self__.user_forward()
            if before is not None:
                out[key] = before
    return out


def _strip(module: nn.Module) -> None:
    """Leave ctxreplay's entries out of a copy, in place."""
    state = module.__dict__
    if any(is_ours(v) for v in state.values()):
        clean = plain_state(state)
        state.clear()
        state.update(clean)


def path_modules(root: nn.Module, members: list[str]) -> list[nn.Module]:
    """The root, every member, and every module between them, once each."""
    out: dict[int, nn.Module] = {id(root): root}
    for name in members:
        parts = name.split(".") if name else []
        for i in range(1, len(parts) + 1):
            try:
                m = root.get_submodule(".".join(parts[:i]))
            except AttributeError:
                break
            out.setdefault(id(m), m)
    return list(out.values())


class Entries:
    """The copy and scripting entries of one module on a path to a member."""

    ctxreplay_holder = True
    __slots__ = ("module", "prev")

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.prev: dict[str, Any] = {}

    def install(self) -> None:
        state = self.module.__dict__
        for name in ENTRIES:
            self.prev[name] = state.get(name, _MISSING)
        state["__deepcopy__"] = self.deepcopy
        state["__reduce_ex__"] = self.reduce_ex
        state["__prepare_scriptable__"] = self.prepare_scriptable

    def remove(self) -> None:
        """Put back what each entry held, unless another tool replaced ours."""
        state = self.module.__dict__
        for name in ENTRIES:
            current = state.get(name)
            if not (is_ours(current) and getattr(current, "__self__", None) is self):
                continue
            before = self.prev.get(name, _MISSING)
            if before is _MISSING:
                del state[name]
            else:
                state[name] = before

    def user_forward(self) -> Any:
        return None

    # -- the entries --------------------------------------------------------
    def deepcopy(self, memo: dict[int, Any]) -> nn.Module:
        module = self.module
        cls = type(module)
        own = getattr(cls, "__deepcopy__", None)
        if own is not None:
            new: nn.Module = own(module, memo)
        else:  # what copy.deepcopy does for a class without __deepcopy__
            reduced = cls.__reduce_ex__(module, 4)
            new = copy._reconstruct(module, memo, *reduced)  # type: ignore[attr-defined]
        _strip(new)
        return new

    def reduce_ex(self, protocol: int) -> Any:
        module = self.module
        reduced = type(module).__reduce_ex__(module, protocol)
        if isinstance(reduced, tuple) and len(reduced) >= 3 and isinstance(reduced[2], dict):
            reduced = (reduced[0], reduced[1], plain_state(reduced[2]), *reduced[3:])
        return reduced

    def prepare_scriptable(self) -> nn.Module:
        module = self.module
        shared = {id(t): t for t in (*module.parameters(), *module.buffers())}
        new = copy.deepcopy(module, shared)
        own = getattr(type(new), "__prepare_scriptable__", None)
        return own(new) if own is not None else new

    def __deepcopy__(self, memo: dict[int, Any]) -> Entries:
        return self  # only ever reached through an entry, which the copy drops

    def __reduce__(self) -> Any:
        raise TypeError("ctxreplay's copy entries are never pickled")  # plain_state drops them


def signed(holder: Any, function: Callable[..., Any], wrapped: Callable[..., Any]
           ) -> types.MethodType:
    """``function`` bound to ``holder``, as a fresh function object that
    carries ``wrapped``'s signature (``inspect.signature`` of the bound
    method is then ``wrapped``'s); equal code, so the same speed.

    The code object is a copy of its own: Dynamo guards a module's instance
    ``forward`` by its function's code object (``ID_MATCH`` on
    ``forward.__func__.__code__``), so with one code for every wrapper a
    graph traced through one block's wrapper (a ``torch.cond`` branch)
    would run for the next block's without a trace."""
    code = getattr(function, "__code__", None)
    if code is None:
        return types.MethodType(function, holder)
    fn = types.FunctionType(code.replace(), function.__globals__, function.__name__,
                            function.__defaults__, function.__closure__)
    fn.__kwdefaults__ = function.__kwdefaults__
    fn.__qualname__ = function.__qualname__
    fn.__doc__ = function.__doc__
    try:
        sig = inspect.signature(wrapped)
    except (TypeError, ValueError):
        return types.MethodType(fn, holder)
    first = inspect.Parameter("__ctxreplay_self", inspect.Parameter.POSITIONAL_ONLY)
    with contextlib.suppress(ValueError):  # a signature that takes no leading positional
        fn.__signature__ = sig.replace(  # type: ignore[attr-defined]
            parameters=[first, *sig.parameters.values()])
    return types.MethodType(fn, holder)
