"""Capture and verification never change the user's model or random state.

Tracing a forward runs it: a BatchNorm in train mode updates its running
statistics, a forward that stores ``self.state.cache = ...`` leaves a
FakeTensor there, a forward drawing random numbers advances the global
generator and the user's own ones (``torch.export`` puts back tensors
assigned on a module, not the Python objects it holds).  So every capture
and every execution check works on ``isolated(module)``: a copy that shares
the parameters (the weights are not copied) and owns everything else --
buffers, plain attributes, the Python objects the module holds, generators
it keeps.  Where something the module holds refuses to be copied (a
``threading.Lock``), the copy shares that object alone and still owns every
container and plain object around it; where even that copy cannot be made,
``NotIsolable`` is raised: capture never runs the user's own module.
Inside ``isolated`` the thread is ``isolating()``: an open session (a second
``capture_with`` on the same blocks) does not count the calls made there.

A module tree whose weights hooks put in place around each forward
(offloading: ``offload.weight_hooks``) is copied while its hooks have the
weights in place, and the live module handed back to them at once: the view
holds the weights the live forward ran with (its own parameter objects, over
the same storage: an offloader that moves ``param.data`` back does not move
the view's), and each hooked submodule of the view runs the forward its
hook wraps, never the hook.  A tree whose hooks cannot be followed raises
``HookedWeights``.

A tree whose parameters FSDP2 shards (``sharded.fsdp_owners``) is copied
while the owners' whole parameters are gathered for it (``sharded.gathered``:
``unshard()``, in the policy's dtype), each gathered parameter cloned into
the view (``reshard()`` frees the gathered storage right after) and each
``FSDP<cls>`` module copied as its own class, without FSDP's state or hooks.

``forward_alone(module)`` makes calling the (isolated) member run its
``forward`` alone, the way observation saw the live call: without the
hooks ``nn.Module.__call__`` runs around it at the member's own level.

``rng_guard()`` puts back the global CPU (and, once initialised, CUDA)
generator state and the state of every ``torch.Generator`` any torch call
inside it received as ``generator=``; with ``weights=`` (a view), the
parameters a run wrote into in place too.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import threading
import types
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..errors import Error
from ..specs.storage import inner_tensors, storage_ptr, storage_ptrs
from .hookfree import gated_global_hooks, silence_view
from .offload import weight_hooks
from .pystate import reach
from .sharded import fsdp_owners, fsdp_states, gathered, is_fsdp, is_fsdp_key, original_class

__all__ = ["BookkeepingError", "HookedWeights", "NotIsolable", "forward_alone", "isolated",
           "isolating", "isolating_as", "isolation_depth", "rng_guard", "unwatch", "watch"]

_MAX_OBJECTS = 4096


class _Depth(threading.local):
    depth = 0


_local = _Depth()
#: open observations, told (``quiet()``) when a capture or check starts
_watchers: weakref.WeakSet[Any] = weakref.WeakSet()


def isolating() -> bool:
    """Whether this thread is inside ctxreplay's own capture or check of a
    module (a ``finalize()``): calls made there are not live calls, and an
    open session must not count them."""
    return _local.depth > 0


def watch(observation: Any) -> None:
    """Have ``observation.quiet()`` called whenever a capture or check
    starts: it drops whatever would count calls without asking
    ``isolating()`` (a member's memo of its last variant)."""
    _watchers.add(observation)


def unwatch(observation: Any) -> None:
    _watchers.discard(observation)


@contextmanager
def isolating_as(caller: int) -> Iterator[None]:
    """Inside, this thread is ``isolating()`` as deep as a thread whose
    ``isolation_depth()`` was ``caller``: a worker thread that traces for
    a capture entered there (calls it makes are not live calls either)."""
    before = _local.depth
    _local.depth = before + caller
    try:
        yield
    finally:
        _local.depth = before


def isolation_depth() -> int:
    """How many captures or checks this thread is inside (see
    ``isolating_as``)."""
    return int(_local.depth)


@contextmanager
def _isolating() -> Iterator[None]:
    _local.depth += 1
    try:
        for w in list(_watchers):
            w.quiet()
        yield
    finally:
        _local.depth -= 1


@contextmanager
def isolated(module: nn.Module, training: Iterable[tuple[str, bool]] = ()
             ) -> Iterator[nn.Module]:
    """A view of ``module`` that capture and execution may change freely,
    with each submodule path in ``training`` set to that mode (the mode the
    live call ran in, whatever the model is in now).  Its parameters are
    the module's own tensors (a copy of every weight per check would cost
    what the weights weigh): a run on it puts back the ones it writes in
    place (``rng_guard(weights=view)``), and the Python state its forward
    reaches outside the copy (``pystate.reach``) is put back on exit."""
    # closure cells, the globals the forward names, the objects a
    # replacement forward or a hook's closure holds: the copy does not own
    # them, so the view's runs write the user's, and each slot goes back
    kept = reach(module)
    view = _copy(module)  # raises NotIsolable: never run on the user's module
    _set_training(view, training)
    silence_view(view)  # no user hook runs in a capture or check (``hookfree``)
    try:
        with _isolating(), gated_global_hooks(isolating):
            yield view
    finally:
        kept.restore()


def _set_training(module: nn.Module, training: Iterable[tuple[str, bool]]) -> None:
    for path, mode in training:
        try:
            sub = module.get_submodule(path) if path else module
        except AttributeError:
            continue
        sub.training = mode  # the flag alone: train() would recurse


class NotIsolable(Error, TypeError):
    """No isolated view of a module could be made: capture refuses to run
    it rather than run the user's own module."""


class BookkeepingError(Error, RuntimeError):
    """ctxreplay's own watch around a run failed (not the run itself): a
    check that meets it cannot say anything of the program, and reports
    its own failure instead of a mismatch.  Its message names the cause
    (raised without the chain: a report names the innermost cause's type)."""

    @classmethod
    def of(cls, doing: str, exc: BaseException) -> BookkeepingError:
        return cls(f"ctxreplay's watch of a check run failed {doing}: "
                   f"{type(exc).__name__}: {exc}")


class HookedWeights(NotIsolable):
    """The module's weights are put in place by hooks that ctxreplay cannot
    follow (``str()`` names them): no view holds what the live forward ran with."""


def _copy(module: nn.Module) -> nn.Module:
    owners = fsdp_owners(module)
    if owners:
        return _copy_gathered(module, owners)
    held = weight_hooks(module)
    if held is None:
        return _copy_tree(module, {})
    if held.unknown:
        raise HookedWeights(
            "its weights are put in place by hooks beside others that change what the "
            f"forward computes ({', '.join(held.unknown[:3])})")
    shared: dict[int, Any] = {}
    for _, _, hooks in held.entries:
        for hook in hooks:  # shared, never copied: they hold the whole weights map
            shared[id(hook)] = hook
    for m in module.modules():
        registry = m.__dict__.get("_diffusers_hook")
        if registry is not None:
            shared[id(registry)] = registry
    with held.loaded():
        for p in module.parameters():
            if type(p) is nn.Parameter:  # the storage in place now, in an object of its own
                shared[id(p)] = nn.Parameter(p.data, requires_grad=p.requires_grad)
        view = _copy_tree(module, shared)
    for path in held.paths:
        unhooked(view.get_submodule(path) if path else view)
    return view


def _copy_gathered(module: nn.Module, owners: list[nn.Module]) -> nn.Module:
    """A view of a tree whose parameters FSDP2 shards: copied while the
    owners' whole parameters are registered (as FSDP's pre-hook gathers them
    for a call, in its policy's dtype), each of those cloned -- ``reshard()``
    frees the gathered storage, so a view sharing it would read freed memory
    -- and every ``FSDP<cls>`` module copied as its own class, without
    FSDP's state, markers or hooks: the view runs the forward the live call
    ran, on the weights it ran with."""
    memo: dict[int, Any] = {id(s): s for s in fsdp_states(module)}  # shared, never copied
    sharded = {id(p) for p in module.parameters()}
    with gathered(owners):
        for p in module.parameters():
            if id(p) not in sharded:  # gathered for this view: its own copy
                memo[id(p)] = nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)
        try:
            view = _copy_unfsdp(module, memo)
        except NotIsolable:
            raise
        except Exception as exc:
            raise NotIsolable(
                f"{type(module).__name__} (FSDP) cannot be copied for capture "
                f"({type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else '-'})"
            ) from None
    for m in view.modules():
        for key in [k for k in m.__dict__ if is_fsdp_key(k)]:
            del m.__dict__[key]
    return view


def _copy_unfsdp(module: nn.Module, memo: dict[int, Any]) -> nn.Module:
    """``module``'s tree copied with each ``FSDP<cls>`` module (which refuses
    ``deepcopy``) as an instance of its own class: a shell of that class for
    each is in ``memo`` before anything is copied, so the tree's references
    to it land on the shell, and the shell is then given a copy of the
    module's attributes but FSDP's own."""
    shells: list[tuple[nn.Module, nn.Module]] = []
    for m in module.modules():
        if is_fsdp(m):
            cls = original_class(m)
            shell = object.__new__(cls)  # nn.Module has no __new__ of its own
            memo[id(m)] = shell
            shells.append((m, shell))
    for m, shell in shells:
        own = {k: v for k, v in m.__dict__.items() if not is_fsdp_key(k)}
        shell.__dict__.update(copy.deepcopy(own, memo))
    if is_fsdp(module):
        view: nn.Module = memo[id(module)]
        _follow_closures(view, memo)
        return view
    return _copy_tree(module, memo)


def unhooked(module: nn.Module) -> None:
    """``module`` (a view) runs the forward its hook wraps: accelerate keeps it as
    ``_old_forward`` (bound to the view by the copy); diffusers' registry wraps
    the class's."""
    own = module.__dict__.get("_old_forward")
    if own is not None and getattr(own, "__self__", None) is module:
        module.forward = own
    else:
        module.__dict__.pop("forward", None)


def _copy_tree(module: nn.Module, memo: dict[int, Any]) -> nn.Module:
    for p in module.parameters():
        memo.setdefault(id(p), p)
    # Most trees copy at the first try; the walk below (bounded, but ~150
    # objects for a small block) only runs for those that do not.
    try:
        return _deepcopy(module, dict(memo), [
            v for m in module.modules() for v in m.__dict__.values() if _empty(v)])
    except Exception:
        pass
    empties: list[Any] = []
    for obj in _held_objects(module):
        # a tensor the forward made (it has a grad_fn) refuses deepcopy: the
        # copy holds a detached copy of it instead
        if isinstance(obj, torch.Tensor):
            if obj.grad_fn is not None:
                memo[id(obj)] = obj.detach().clone().requires_grad_(obj.requires_grad)
        elif _empty(obj):
            empties.append(obj)
    try:
        return _deepcopy(module, dict(memo), empties)
    except Exception:
        pass
    # Something the tree holds refuses to be copied (a threading.Lock, an
    # open file): the view shares each such leaf object with the module and
    # copies everything else, its containers and plain objects included, so
    # what the forward writes (a list it appends to) lands in the copy.
    # Synchronisation objects are shared whole: a copied Event (its lock
    # shared, its flag and waiters copied) would never be set by the
    # thread that sets the user's.
    shared = _uncopyable(module, memo)
    memo.update((id(x), x) for x in shared)
    try:
        return _deepcopy(module, memo, empties)
    except Exception as exc:
        raise NotIsolable(
            f"{type(module).__name__} cannot be copied for capture ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0][:120] if str(exc) else '-'}); it is not run on the "
            "user's module instead") from None


#: containers whose deep copy, when empty and without instance attributes,
#: is a new empty one of the same type (``OrderedDict`` copies through
#: ``__reduce__``, its ``__dict__`` included; ``set`` through its items)
_EMPTIES = frozenset({dict, OrderedDict, set, list})


def _empty(obj: Any) -> bool:
    return type(obj) in _EMPTIES and not obj and not getattr(obj, "__dict__", None)


def _deepcopy(module: nn.Module, memo: dict[int, Any], empties: list[Any]) -> nn.Module:
    """``copy.deepcopy(module, memo)`` and the closures it holds followed.

    ``empties`` (empty containers the module tree holds) are copied ahead as
    new empty ones, exactly what ``deepcopy`` would make of them: a module
    holds a dozen empty hook tables (``OrderedDict``), each ~3 us through
    ``deepcopy``'s generic ``__reduce_ex__`` path, most of the copy's time.
    The memo maps each by identity, so one table shared by two modules is
    one new table shared by the two copies, as ``deepcopy`` keeps it;
    ``empties`` keeps the originals alive, so no identity is reused."""
    memo.update((id(e), type(e)()) for e in empties)
    view: nn.Module = copy.deepcopy(module, memo)
    _follow_closures(view, memo)
    return view


def _uncopyable(module: nn.Module, memo: dict[int, Any]) -> list[Any]:
    """The leaf objects of the module tree (neither a module, a tensor, a
    container nor a plain object with a ``__dict__``) that ``deepcopy``
    refuses, bounded like ``_held_objects``."""
    out: list[Any] = []
    for obj in _held_objects(module, _synchronising):
        if _synchronising(obj):
            out.append(obj)
            continue
        if isinstance(obj, (torch.Tensor, nn.Module, list, tuple, dict, set, frozenset, type)) \
                or id(obj) in memo or type(getattr(obj, "__dict__", None)) is dict:
            continue
        try:
            copy.deepcopy(obj, dict(memo))
        except Exception:
            out.append(obj)
    return out


#: modules whose objects synchronise threads or processes
_SYNC_MODULES = frozenset({"threading", "_thread", "queue", "multiprocessing.synchronize",
                           "asyncio.locks", "concurrent.futures._base"})


def _synchronising(obj: Any) -> bool:
    return type(obj).__module__ in _SYNC_MODULES


def _follow_closures(view: nn.Module, memo: dict[int, Any]) -> None:
    """Point the functions the copy holds at the copy.

    ``deepcopy`` keeps a function as it is, so a function held as an
    attribute reaches the original's objects through its closure cells:
    diffusers' hook registry sets an attention's ``forward`` to a partial of
    a closure over its hook (Pyramid Attention Broadcast's hook stores each
    output in its state), so running the copy wrote the trace's FakeTensors
    into the user's model and the check's reference run read them back.
    Each such function in the copy is rebuilt with cells holding the copies
    ``memo`` made; cells holding what was not copied stay shared."""
    seen: set[int] = set()
    stack: list[Any] = list(view.modules())
    budget = _MAX_OBJECTS
    while stack and budget > 0:
        obj = stack.pop()
        budget -= 1
        if id(obj) in seen or isinstance(obj, (torch.Tensor, type)):
            continue
        seen.add(id(obj))
        if isinstance(obj, list):
            slots: Iterable[tuple[Any, Any]] = list(enumerate(obj))
            table: Any = obj
        elif isinstance(obj, dict):
            slots, table = list(obj.items()), obj
        else:
            table = getattr(obj, "__dict__", None)
            if type(table) is not dict:
                continue
            slots = [(k, v) for k, v in table.items() if k not in _MODULE_DICTS]
        for key, value in slots:
            if isinstance(value, _FUNCTIONS):
                rebuilt = _rebound(value, memo, 3)
                if rebuilt is not value:
                    table[key] = rebuilt
            elif isinstance(value, (list, dict)):
                if value:  # an empty one holds nothing to point (a module's hook tables)
                    stack.append(value)
            elif not (isinstance(value, _LEAVES) or callable(value)):
                stack.append(value)  # an object whose __dict__ is walked


#: what ``_follow_closures`` rebuilds, and what it never walks into
_FUNCTIONS = (types.FunctionType, functools.partial)
_LEAVES = (torch.Tensor, type, str, bytes, int, float, bool, complex, type(None), tuple,
           torch.dtype, torch.device)


def _rebound(value: Any, memo: dict[int, Any], depth: int) -> Any:
    """``value`` (a function with a closure, or a partial of one) with its
    cells pointing at ``memo``'s copies; ``value`` itself when none moves."""
    if depth <= 0:
        return value
    if isinstance(value, functools.partial):
        func = _rebound(value.func, memo, depth - 1)
        if func is value.func:
            return value
        out = functools.partial(func, *value.args, **value.keywords)
        out.__dict__.update(value.__dict__)
        return out
    if not isinstance(value, types.FunctionType) or not value.__closure__:
        return value
    cells, moved = [], False
    for cell in value.__closure__:
        try:
            held = cell.cell_contents
        except ValueError:  # an empty cell: nothing to point anywhere
            cells.append(cell)
            continue
        now = _rebound(memo.get(id(held), held), memo, depth - 1)
        moved = moved or now is not held
        cells.append(types.CellType(now) if now is not held else cell)
    if not moved:
        return value
    fn = types.FunctionType(value.__code__, value.__globals__, value.__name__,
                            value.__defaults__, tuple(cells))
    fn.__kwdefaults__ = value.__kwdefaults__
    fn.__qualname__ = value.__qualname__
    fn.__dict__.update(value.__dict__)
    return fn


def _held_objects(module: nn.Module, leaf: Callable[[Any], bool] = lambda obj: False
                  ) -> Iterator[Any]:
    """Every object reached from the ``__dict__`` of the module tree through
    lists, tuples, sets, dicts and plain objects (but none that ``leaf``
    holds), once each, bounded."""
    seen: set[int] = set()
    stack: list[Any] = list(module.modules())
    budget = _MAX_OBJECTS
    while stack and budget > 0:
        obj = stack.pop()
        budget -= 1
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        yield obj
        if isinstance(obj, torch.Tensor) or leaf(obj):
            continue
        if isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
            continue
        if isinstance(obj, dict):
            stack.extend(obj.values())
            continue
        d = getattr(obj, "__dict__", None)
        if type(d) is dict and not isinstance(obj, type) and not callable(obj):
            stack.extend(v for k, v in d.items() if k not in _MODULE_DICTS)
        elif isinstance(obj, nn.Module):
            stack.extend(v for k, v in obj.__dict__.items() if k not in _MODULE_DICTS)


# a module's parameter / buffer / submodule tables: walked through modules()
_MODULE_DICTS = frozenset({"_parameters", "_modules"})


# What ``nn.Module.__call__`` (``_call_impl``, torch 2.7 to 2.14) consults
# before taking its no-hook shortcut to ``forward``: the module's own forward
# pre-hooks, forward hooks and backward hooks (their ``with_kwargs`` and
# ``always_call`` tables only qualify entries of these), and torch's global
# module hooks, which it runs at every module's level.
_OWN_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_GLOBAL_HOOKS = ("_global_forward_pre_hooks", "_global_forward_hooks",
                 "_global_backward_pre_hooks", "_global_backward_hooks")


def _has_hooks(module: nn.Module) -> bool:
    table = torch.nn.modules.module
    # a table this torch does not have counts as holding hooks: forward alone
    # is right whether or not it has any
    return any(getattr(module, n, True) for n in _OWN_HOOKS) or \
        any(getattr(table, n, True) for n in _GLOBAL_HOOKS)


@contextmanager
def forward_wrapped(module: nn.Module,
                    wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Iterator[None]:
    """Inside, the (isolated) module's instance ``forward`` is ``wrap`` of
    the forward it runs now; swapping the instance's forward, rather than
    wrapping the module, keeps parameter names and the forward's signature.
    What the instance held is put back exactly afterwards."""
    had = "forward" in module.__dict__
    prev = module.__dict__.get("forward")
    orig = module.forward
    module.forward = functools.wraps(orig)(wrap(orig))
    try:
        yield
    finally:
        if had:
            module.forward = prev  # type: ignore[assignment]
        else:
            del module.forward


@contextmanager
def forward_alone(module: nn.Module) -> Iterator[nn.Module]:
    """Inside, calling ``module`` runs ``module.forward`` alone.

    Observation wraps the instance's ``forward``, so the live call it saw
    is ``forward`` alone: ``nn.Module.__call__`` ran the module's own
    forward pre-hooks and hooks (``with_kwargs`` or not, ``always_call``),
    its backward hooks and torch's global module hooks around that
    wrapper, outside it.  A tracer calls the module (``torch.export``'s
    wrapper calls ``module(...)``), which would run them again and record
    them: the artifact would hold what ``install`` runs a second time around
    it, and a recording hook would see fake tensors.  So, while hooks
    exist, the module's class is a one-off subclass whose ``__call__`` is
    its ``forward``; every submodule is called as usual, its own hooks and
    the global ones included (they ran inside the live forward).  On exit
    the class is put back, and the one-off ``__call__`` turns into the
    class's own should the class not be put back (a second capture holds a
    module used in place while a timed-out trace still runs on it)."""
    cls = type(module)
    if not _has_hooks(module):
        yield module
        return
    active = [True]
    # type() builds the class with its base's metaclass, should it have one
    bare = type(cls.__name__, (cls,), {"__call__": _own_call(cls, active),
                                       "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__})
    module.__class__ = bare
    try:
        yield module
    finally:
        active[0] = False
        if type(module) is bare:
            module.__class__ = cls


def _own_call(cls: type[nn.Module], active: list[bool]) -> Callable[..., Any]:
    """The one-off class's ``__call__``: ``forward`` alone while ``active``,
    ``cls.__call__`` after.  A code object of its own: Dynamo keeps its
    compiled frames per code object, guarded on the type of ``self``, so one
    shared by every one-off class would reach its recompile limit after a
    few captures."""

    def call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if active[0]:
            return self.forward(*args, **kwargs)
        return cls.__call__(self, *args, **kwargs)

    call.__code__ = call.__code__.replace()
    return call


class _RunWatch(TorchFunctionMode):
    """Remembers the state of every generator passed to a torch call, and
    keeps a copy of each watched tensor (a parameter an isolated view shares
    with the live module) before the first torch call that writes into its
    storage in place.  One mode for both: each is a Python call per torch
    call of the run."""

    def __init__(self, generators: bool, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().__init__()
        self.generators = generators
        self.seen: dict[int, tuple[torch.Generator, torch.Tensor]] = {}
        # by the storage of each ordinary tensor holding a weight's data:
        # a wrapper subclass (a quantized weight, a DTensor) has none of its
        # own, its inner tensors do
        self.watched: dict[int, list[tuple[str, torch.Tensor]]] = {}
        try:
            for name, t in tensors:
                for _path, inner in inner_tensors(t):
                    ptr = storage_ptr(inner) if inner.numel() else None
                    if ptr is not None:
                        self.watched.setdefault(ptr, []).append((name, inner))
        except Exception as exc:
            raise BookkeepingError.of("reading the weights' storage", exc) from None
        self.kept: dict[tuple[str, int], tuple[str, torch.Tensor, torch.Tensor]] = {}

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if torch.compiler.is_compiling():
            # a compiled function the forward calls: Dynamo inlines an active
            # mode, and guarded on the per-callable table below, which its
            # own trace fills (torch 2.9.1 failed its guard self-check with
            # an AssertionError, so the check run did).  Writes made inside
            # compiled code are not watched.
            return func(*args, **kwargs)
        if self.generators:
            g = kwargs.get("generator")
            if isinstance(g, torch.Generator) and id(g) not in self.seen:
                self.seen[id(g)] = (g, g.get_state())
        if self.watched:
            try:
                self._keep(func, args, kwargs)
            except Exception as exc:
                raise BookkeepingError.of(f"finding what {func!r} writes", exc) from None
        return func(*args, **kwargs)

    def _keep(self, func: Any, args: Any, kwargs: Any) -> None:
        for t in _written(func, args, kwargs):
            for ptr in storage_ptrs(t):  # none: a tensor without storage (functional)
                for name, p in self.watched.get(ptr, ()):
                    if (name, ptr) not in self.kept:
                        self.kept[name, ptr] = (name, p, p.detach().clone())


def _written(func: Any, args: Any, kwargs: Any) -> list[torch.Tensor]:
    """The tensors a torch call writes into in place (``_write_spots``), and
    whatever it is given as ``out=``."""
    try:
        spots = _SPOTS[func]
    except (KeyError, TypeError):
        spots = _write_spots(func)
    target = kwargs.get("out")
    if not spots and target is None:
        return []
    found = [args[i] if i < len(args) else kwargs.get(n) for i, n in spots]
    out: list[torch.Tensor] = []
    for t in (*found, target):
        if isinstance(t, torch.Tensor):
            out.append(t)
        elif isinstance(t, (tuple, list)):
            out += [x for x in t if isinstance(x, torch.Tensor)]
    return out


#: torch callable -> where its in-place targets are, read once per callable
_SPOTS: dict[Any, tuple[tuple[int, str], ...]] = {}


def _write_spots(func: Any) -> tuple[tuple[int, str], ...]:
    """``(position, name)`` of each argument ``func`` writes into: those an
    operator's schema marks written (``Tensor(a!)``, what a graph's
    ``torch.ops.aten.mul_.Tensor`` shows), else -- a Python-level function
    or method -- the first of one named in place (``mul_``, ``__iadd__``,
    ``__setitem__``)."""
    schema = getattr(func, "_schema", None)
    if schema is not None:
        spots = tuple((i, a.name) for i, a in enumerate(schema.arguments)
                      if a.alias_info is not None and a.alias_info.is_write)
    else:
        name = getattr(func, "__name__", "")
        in_place = (name.endswith("_") and not name.endswith("__")) \
            or name.startswith("__i") or name == "__setitem__"
        spots = ((0, "self"),) if in_place else ()
    with contextlib.suppress(TypeError):  # not hashable: looked at again next time
        _SPOTS[func] = spots
    return spots


@contextmanager
def rng_guard(*, watch_generators: bool = True, weights: Any = None
              ) -> Iterator[dict[int, str]]:
    """Random state as it was, whatever runs inside; with ``weights`` (a
    module: an isolated view, or a program bound to one -- the live
    module's own tensors), each of its parameters that a torch call writes
    in place is put back as it was too, and the dict yielded then maps each
    one's storage to its name.  A check's runs work on the live weights (a
    copy of every weight per run would cost what the weights weigh), so a
    forward that updates a parameter in place would otherwise change the
    user's."""
    cpu = torch.random.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None  # type: ignore[no-untyped-call]
    params = weights.named_parameters() if isinstance(weights, nn.Module) else ()
    mode = _RunWatch(watch_generators, params)
    written: dict[int, str] = {}
    try:
        if not (watch_generators or mode.watched):
            yield written
        else:
            with mode:
                yield written
    finally:
        torch.random.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        for g, state in mode.seen.values():
            g.set_state(state)
        with torch.no_grad():
            for (_key, ptr), (name, p, saved) in mode.kept.items():
                p.detach().copy_(saved)
                written[ptr] = name

