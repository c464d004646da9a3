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

Whether a thread is inside a capture or check is ``isolating``'s job, the
functions a copy holds are pointed at it by ``closures``, and random state
and the live weights a run writes are put back by ``rngguard``.
"""

from __future__ import annotations

import copy
import functools
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from ..errors import Error
from .closures import follow_closures, held_objects
from .hookfree import gated_global_hooks, silence_view
from .isolating import entered, isolating
from .offload import weight_hooks
from .pystate import reach
from .sharded import fsdp_owners, fsdp_states, gathered, is_fsdp, is_fsdp_key, original_class
from .stephooks import inner_seat

__all__ = ["HookedWeights", "NotIsolable", "forward_alone", "isolated"]

_log = logging.getLogger("ctxreplay")


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
    if inner_seat(module) is not None:
        # observed beneath its step cache's hooks: the view runs its own
        # forward, never a copy of the hooks (their decisions are Python)
        view.__dict__.pop("forward", None)
    _set_training(view, training)
    silence_view(view)  # no user hook runs in a capture or check (``hookfree``)
    try:
        with entered(), gated_global_hooks(isolating):
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
        except Exception as exc:  # deepcopy of user objects may raise anything: logged
            _log.debug("copying %s failed", type(module).__name__, exc_info=True)
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
        follow_closures(view, memo)
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
    except Exception:  # deepcopy of user objects may raise anything: retried
        pass
    empties: list[Any] = []
    for obj in held_objects(module):
        # a tensor the forward made (it has a grad_fn) refuses deepcopy: the
        # copy holds a detached copy of it instead
        if isinstance(obj, torch.Tensor):
            if obj.grad_fn is not None:
                memo[id(obj)] = obj.detach().clone().requires_grad_(obj.requires_grad)
        elif _empty(obj):
            empties.append(obj)
    try:
        return _deepcopy(module, dict(memo), empties)
    except Exception:  # deepcopy of user objects may raise anything: retried
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
    except Exception as exc:  # deepcopy of user objects may raise anything: logged
        _log.debug("copying %s failed", type(module).__name__, exc_info=True)
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
    follow_closures(view, memo)
    return view


def _uncopyable(module: nn.Module, memo: dict[int, Any]) -> list[Any]:
    """The leaf objects of the module tree (neither a module, a tensor, a
    container nor a plain object with a ``__dict__``) that ``deepcopy``
    refuses, bounded like ``held_objects``."""
    out: list[Any] = []
    for obj in held_objects(module, _synchronising):
        if _synchronising(obj):
            out.append(obj)
            continue
        if isinstance(obj, (torch.Tensor, nn.Module, list, tuple, dict, set, frozenset, type)) \
                or id(obj) in memo or type(getattr(obj, "__dict__", None)) is dict:
            continue
        try:
            copy.deepcopy(obj, dict(memo))
        except Exception:  # deepcopy of user objects may raise anything: shared
            out.append(obj)
    return out


#: modules whose objects synchronise threads or processes
_SYNC_MODULES = frozenset({"threading", "_thread", "queue", "multiprocessing.synchronize",
                           "asyncio.locks", "concurrent.futures._base"})


def _synchronising(obj: Any) -> bool:
    return type(obj).__module__ in _SYNC_MODULES


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


