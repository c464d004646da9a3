"""What the observation wrapper (``observation.wrapper``) needs to know of the modules it
wraps besides their calls: the wrappers copies get, the counter on a compiled
entry point, the Python state a forward writes, jit's re-runs and lazy
modules."""

from __future__ import annotations

import copy
import sys
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .copies import is_ours
from .targets import _Uninitialized

__all__ = ["NO_FORWARD", "CompiledEntry", "Detached", "Holder", "before_ctxreplay",
           "held_changes", "held_state", "in_jit_check", "uninitialized"]


#: what a module's ``__dict__`` held under ``forward`` when it had nothing
NO_FORWARD = object()


def before_ctxreplay(fn: Any) -> Any:
    """``fn`` with every ctxreplay wrapper in its chain skipped (``None``: a
    module's class forward)."""
    while fn is not NO_FORWARD and fn is not None and is_ours(fn):
        fn = fn.__self__.prev
    return None if fn is NO_FORWARD else fn


def uninitialized(module: nn.Module) -> bool:
    return any(isinstance(p, _Uninitialized) for p in (*module.parameters(), *module.buffers()))


_HELD_LIMIT = 64


def held_state(module: nn.Module, ignore: tuple[str, ...]
                ) -> list[tuple[str, Any, dict[str, Any]]]:
    """``(label, object, shallow copy of its __dict__)`` of the plain Python
    objects the module tree holds (a caching hook's state): a forward that
    writes them depends on what earlier calls left there."""
    out = []
    for path, m in module.named_modules():
        for name, value in m.__dict__.items():
            if name.startswith("_") or name in ignore or isinstance(
                    value, (nn.Module, torch.Tensor, type)) or callable(value):
                continue
            d = getattr(value, "__dict__", None)
            if type(d) is dict:
                out.append((f"{path}.{name}" if path else name, value, dict(d)))
                if len(out) >= _HELD_LIMIT:
                    return out
    return out


def held_changes(held: list[tuple[str, Any, dict[str, Any]]]) -> list[str]:
    changed = []
    for label, obj, before in held:
        now = obj.__dict__
        for k in set(before) | set(now):
            if before.get(k, NO_FORWARD) is not now.get(k, NO_FORWARD):
                changed.append(f"{label}.{k}")
    return changed


def in_jit_check(depth: int = 40) -> bool:
    """Whether ``torch.jit.trace`` is re-running the module to check its
    trace (``check_trace=True``): torch's own second run, not a call."""
    frame: types.FrameType | None = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return False
        code = frame.f_code
        if code.co_name in ("_check_trace", "run_mod_and_filter_tensor_outputs") and \
                code.co_filename.endswith(("jit/_trace.py", "jit\\_trace.py")):
            return True
        frame = frame.f_back
    return False


class Detached:
    """The wrapper state of a copy of an observed module: observes nothing,
    calls the copy's own forward (or what the copy had before)."""

    ctxreplay_holder = True
    __slots__ = ("off", "orig", "prev")
    #: ``copy.deepcopy`` of a bound ``forward`` (another tool's wrapper
    #: holding ours) keeps the wrapper's function, bound to this instead:
    #: the member wrapper's reads ``memo`` and calls ``_call`` before ``off``
    memo = None

    def __init__(self, module: nn.Module, prev: Any) -> None:
        self.off = True
        self.prev = prev
        self.orig = prev if prev is not None else types.MethodType(type(module).forward,
                                                                   module)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.orig(*args, **kwargs)

    def _call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return self.orig(*args, **kwargs)

    def user_forward(self) -> Any:
        return before_ctxreplay(self.prev)


class Holder:
    """What a ctxreplay wrapper (a member's, the root's) is to copies: its
    bound ``forward`` sits in a module's ``__dict__`` (with what was there
    before in ``prev``).  A copy of it (held by the copy of a module, or by
    another tool's wrapper) is the same function bound to a ``Detached``,
    whose ``off`` is set, so it passes straight through to the copy's own
    forward."""

    __slots__ = ()
    ctxreplay_holder = True
    module: nn.Module
    prev: Any

    def user_forward(self) -> Any:
        """The instance ``forward`` the module had before ctxreplay (``None``:
        its class's)."""
        return before_ctxreplay(self.prev)

    def __deepcopy__(self, memo: dict[int, Any]) -> Detached:
        # copy.deepcopy of the module maps it to its copy before copying its
        # state (copy._reconstruct), so the twin is in ``memo`` here
        twin = memo.get(id(self.module))
        prev = None if self.prev is NO_FORWARD else copy.deepcopy(self.prev, memo)
        return Detached(twin if twin is not None else self.module, prev)

    def __reduce__(self) -> Any:
        return (Detached, (self.module, None if self.prev is NO_FORWARD else self.prev))


class CompiledEntry:
    """A compiled entry point that exists when the session attaches (an
    ``OptimizedModule``'s ``forward``, a module's ``_compiled_call_impl``
    from ``Module.compile()``), run uncompiled while the session observes:
    Dynamo would trace the blocks inside into compiled code, where nothing
    is observed.  It runs what the compiled code was made of -- the
    ``OptimizedModule``'s wrapped module, called with its hooks, or the
    module's own ``_call_impl`` -- so the blocks' calls are observed and
    captured; ``calls`` counts its runs.  Detaching puts the compiled entry
    point back."""

    __slots__ = ("attr", "calls", "eager", "name", "orig", "owner")

    def __init__(self, owner: nn.Module, attr: str, name: str) -> None:
        self.owner, self.attr, self.name = owner, attr, name
        self.orig = owner.__dict__[attr]
        self.calls = 0
        self.eager = _uncompiled(owner, attr, self.orig)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.eager(*args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return copy.deepcopy(self.orig, memo)

    def __reduce__(self) -> Any:
        return (_identity, (self.orig,))


def _uncompiled(owner: nn.Module, attr: str, compiled: Callable[..., Any]) -> Callable[..., Any]:
    """What a compiled entry point was compiled from: an ``OptimizedModule``'s
    wrapped module (``_orig_mod``, called as a module: its hooks run),
    ``nn.Module._call_impl`` for ``Module.compile()`` (what ``__call__``
    runs when nothing is compiled); the compiled one itself otherwise."""
    if attr == "_compiled_call_impl":
        return owner._call_impl
    inner = owner._modules.get("_orig_mod")
    return inner.__call__ if inner is not None else compiled


def _identity(x: Any) -> Any:
    return x
