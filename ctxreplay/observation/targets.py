"""Choosing the submodules to observe, grouping them by structure, and the
identity that decides which members may share a capture."""

from __future__ import annotations

import copy
import difflib
import enum
import functools
import hashlib
import re
import types
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from ..capture.options import Unrestorable
from ..capture.sharded import is_fsdp_key
from ..capture.stephooks import below, inner_seat
from ..specs.baked import SCALARS
from .copies import callees, is_ours

# torch's lazy modules hold these until their first forward
_Uninitialized: type = getattr(nn.parameter, "UninitializedTensorMixin", type(None))

__all__ = ["beneath_step_caches", "changed_attributes", "describe_identity_change",
           "held_objects", "identity_digest", "identity_of", "resolve_targets", "state_of",
           "structure_key", "training_of"]

#: an object's address in a repr: never part of what is compared across processes
ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _tensor_key(t: torch.Tensor) -> tuple[Any, ...]:
    if isinstance(t, _Uninitialized):
        return ("uninitialized", t.device.type)
    return (tuple(t.shape), t.dtype, t.device.type)


def _fsdp_key(t: torch.Tensor) -> tuple[Any, ...]:
    """A parameter FSDP2 manages is one parameter in two forms: its shard (a
    ``DTensor`` of the whole shape, in the dtype it was made in) between
    calls, and the gathered whole (in ``MixedPrecisionPolicy.param_dtype``)
    during one.  Both have the whole shape; the dtype tells the forms apart,
    not two members."""
    return (tuple(t.shape), "fsdp", t.device.type)


def structure_key(module: nn.Module) -> tuple[Any, ...]:
    """Class plus parameter and buffer names, shapes and dtypes: the scope a
    member is reported under.  (Whether members share a capture is decided
    by ``identity_of``, which also looks at non-tensor state.)"""
    params = tuple((n, *_tensor_key(p)) for n, p in module.named_parameters())
    bufs = tuple((n, *_tensor_key(b)) for n, b in module.named_buffers())
    return (type(module), params, bufs)


# nn.Module's own bookkeeping, not state a forward reads
_INTERNALS = frozenset(nn.Module().__dict__) | {
    "forward", "training", "_compiled_call_impl", "_is_torch_compile",
    "__prepare_scriptable__", "__deepcopy__", "__reduce_ex__"}  # (``copies.ENTRIES``)
_PLAIN = SCALARS
_SKIP = object()
_MAX_ITEMS = 256


#: the exact types of ``_PLAIN``: a value of one is its own form, whatever
#: the walk's budget or memo
_SCALAR_TYPES = frozenset(_PLAIN)

#: ``id`` of a value walked -> ``(value, its form, the budget its walk
#: took)``, for one reading of state: an object several submodules (or
#: members) hold -- a model's config, held by every attention and MLP block
#: -- is walked once
Memo = dict[int, tuple[Any, Any, int]]


def _plain(value: Any, budget: list[int], memo: Memo | None = None) -> Any:
    """A comparable form of a plain attribute, or ``_SKIP`` for state the
    identity does not cover (modules, callables, identity-compared objects).

    With ``memo``, a value already walked is given the form it had, and its
    budget taken, where the budget left covers that walk (which then never
    ran out, so walking it again gives the same form); a walk that ran out
    is not kept."""
    if memo is None or type(value) in _SCALAR_TYPES:
        return _walk(value, budget, memo)
    hit = memo.get(id(value))
    if hit is not None and hit[0] is value and budget[0] >= hit[2]:
        budget[0] -= hit[2]
        return hit[1]
    start = budget[0]
    out = _walk(value, budget, memo)
    if budget[0] >= 0:
        memo[id(value)] = (value, out, start - budget[0])
    return out


def _walk(value: Any, budget: list[int], memo: Memo | None) -> Any:
    budget[0] -= 1
    if budget[0] < 0:
        return ("<too large>",)
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, enum.Enum):
        return (type(value), value.name)
    if isinstance(value, torch.Tensor):  # not a buffer: a constant of the graph
        return ("tensor", *_tensor_key(value))
    if isinstance(value, (tuple, list, frozenset, set)):
        items = [_plain(v, budget, memo) for v in value]
        if any(i is _SKIP for i in items):
            return _SKIP
        return (type(value).__name__, tuple(sorted(items, key=repr)) if isinstance(
            value, (set, frozenset)) else tuple(items))
    if isinstance(value, dict):
        if len(value) > _MAX_ITEMS:
            return ("<too large>",)
        items = [(k, _plain(v, budget, memo)) for k, v in value.items() if isinstance(k, _PLAIN)]
        return ("dict", tuple((k, v) for k, v in items if v is not _SKIP))
    if isinstance(value, nn.Module):
        return _SKIP  # a submodule: ``identity_of`` walks it as one
    if isinstance(value, type) or callable(value):
        return _callable(value, budget, memo)
    if getattr(type(value), "__eq__", object.__eq__) is not object.__eq__:
        # a value-comparable config object: by its attributes as they are now
        # (the object itself would compare equal to itself after a change in
        # place), or with == where it keeps no ``__dict__``
        state = getattr(value, "__dict__", None)
        if type(state) is not dict:
            return value
        if len(state) > _MAX_ITEMS:
            return ("<too large>",)
        return ("object", type(value).__module__, type(value).__qualname__,
                tuple((k, p) for k, v in state.items() if isinstance(k, str)
                      for p in (_plain(v, budget, memo),) if p is not _SKIP))
    return _SKIP


def _callable(value: Any, budget: list[int], memo: Memo | None = None) -> Any:
    """A callable held as an attribute (an attention processor swapped by
    ``set_processor``, an activation function): its class or function by
    name, and an object's own plain attributes -- never its address, so
    members holding equal processors of one class still share a capture."""
    if isinstance(value, type):
        return ("class", value.__module__, value.__qualname__)
    if isinstance(value, functools.partial):
        return ("partial", _callable(value.func, budget, memo), _plain(value.args, budget, memo),
                _plain(value.keywords, budget, memo))
    func = getattr(value, "__func__", None)
    if func is not None:  # a bound method: its function and its owner's class
        owner = type(getattr(value, "__self__", None))
        return ("method", _callable(func, budget, memo), owner.__qualname__)
    code = getattr(value, "__code__", None)
    if code is not None:
        return ("function", getattr(value, "__module__", None),
                getattr(value, "__qualname__", None), code.co_firstlineno)
    if isinstance(value, types.BuiltinFunctionType):
        return ("builtin", getattr(value, "__module__", None), value.__name__)
    state = getattr(value, "__dict__", None)
    own: tuple[Any, ...] = ()
    if type(state) is dict and len(state) <= _MAX_ITEMS:
        own = tuple((k, p) for k, v in state.items() if isinstance(k, str)
                    for p in (_plain(v, budget, memo),) if p is not _SKIP)
    return ("callable", type(value).__module__, type(value).__qualname__, own)


def _own_forward(module: nn.Module) -> tuple[str, ...] | None:
    """The function an instance ``forward`` runs (ctxreplay's wrappers
    skipped), by name; ``None`` for the class's own ``forward``.  Members
    whose forwards differ (one a user or a tool set anew) trace to
    different graphs."""
    if inner_seat(module) is not None:
        return None  # observed beneath a step cache's hooks: its class's forward runs there
    fn: Any = module.__dict__.get("forward")
    ours = next((f for f in callees(fn) if is_ours(f)), None)
    if ours is not None:  # ours, or another tool's wrapper on top of ours: the
        fn = ours.__self__.user_forward()  # observed call is what ours runs
    if fn is None:
        return None
    if isinstance(fn, types.MethodType) and fn.__self__ is module:
        if fn.__func__ is getattr(type(module), "forward", None):
            return None
        fn = fn.__func__
    while isinstance(fn, functools.partial):
        fn = fn.func
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return (str(getattr(fn, "__module__", None) or type(fn).__module__), str(name))


def identity_of(module: nn.Module, ignore: Iterable[str] = (),
                memo: Memo | None = None) -> tuple[Any, ...]:
    """What decides whether two members trace to the same graph, up to
    parameter values: per submodule, its class, parameter and buffer shapes,
    ``training``, and its plain attributes (numbers, strings, enums, dtypes,
    tuples of them, value-comparable config objects).  ``ignore``: attribute
    names left out (e.g. a step counter a forward increments).  ``memo``:
    shared by the readings of several members made together, where nothing
    runs between them (each reading has its own otherwise)."""
    skip = _INTERNALS | set(ignore)
    memo = {} if memo is None else memo
    out: list[Any] = []
    for path, m in module.named_modules(remove_duplicate=False):
        budget = [4 * _MAX_ITEMS]
        attrs_ = []
        fsdp = m.__dict__.get("_is_fsdp_managed_module") is True
        for k, v in m.__dict__.items():
            # FSDP's state keys are new uuids in each process: its bookkeeping,
            # not state a forward reads
            if k in skip or (fsdp and is_fsdp_key(k)):
                continue
            p = _plain(v, budget, memo)
            if p is not _SKIP:
                attrs_.append((k, p))
        own = _own_forward(m)
        if own is not None:  # another forward than the class's runs this module
            attrs_.append(("forward", own))
        key = _fsdp_key if fsdp else _tensor_key
        out.append((path, type(m).__qualname__, bool(m.training),
                    tuple((n, *key(t)) for n, t in m._parameters.items()
                          if t is not None),
                    tuple((n, *_tensor_key(t)) for n, t in m._buffers.items()
                          if t is not None),
                    tuple(attrs_)))
    return tuple(out)


def identity_digest(identity: tuple[Any, ...]) -> str:
    """A short digest of an ``identity_of`` value, equal in every process for
    equal state (object addresses left out).  Metadata only."""
    return hashlib.sha256(ADDRESS.sub("", repr(identity)).encode()).hexdigest()[:16]


def training_of(identity: tuple[Any, ...]) -> tuple[tuple[str, bool], ...]:
    """``(submodule path, training)`` recorded in an identity."""
    return tuple((entry[0], entry[2]) for entry in identity)


def describe_identity_change(before: tuple[Any, ...], after: tuple[Any, ...]) -> str:
    """The first difference between two identities as a short token (metadata
    only: a submodule path and an attribute name, never a value):
    ``submodules``, ``PATH:class``, ``PATH:training``, ``PATH:shapes`` or
    ``PATH.ATTRIBUTE``."""
    if len(before) != len(after):
        return "submodules"
    for a, b in zip(before, after):
        where = a[0] or "."
        if a[1] != b[1]:
            return f"{where}:class"
        if a[2] != b[2]:
            return f"{where}:training"
        if a[3] != b[3] or a[4] != b[4]:
            return f"{where}:shapes"
        da, db = dict(a[5]), dict(b[5])
        for k in sorted(set(da) | set(db), key=str):
            if da.get(k, _SKIP) != db.get(k, _SKIP):
                return f"{where}.{k}" if a[0] else str(k)
    return "none"


def changed_attributes(before: tuple[Any, ...], after: tuple[Any, ...]
                       ) -> set[tuple[str, str]] | None:
    """``(submodule path, attribute)`` of every plain attribute that differs
    between two identities of one member (``None``: the submodules, classes
    or shapes differ, so no attribute values can make one the other)."""
    if len(before) != len(after):
        return None
    out: set[tuple[str, str]] = set()
    for a, b in zip(before, after):
        if a[0] != b[0] or a[1] != b[1] or a[3] != b[3] or a[4] != b[4]:
            return None
        da, db = dict(a[5]), dict(b[5])
        for k in set(da) | set(db):
            try:
                same = k in da and k in db and bool(da[k] == db[k])
            except Exception:  # a config object whose __eq__ fails: not equal
                same = False
            if not same:
                out.add((a[0], k))
    return out


def _is_stack(mod: nn.Module) -> bool:
    """A stack of repeated blocks: an ``nn.ModuleList`` whose children share
    one class, or an ``nn.Sequential`` of two or more blocks of one class
    (torchvision's ResNet stages, ViT's encoder layers)."""
    if isinstance(mod, nn.ModuleList):
        return len(mod) > 0 and len({type(m) for m in mod}) == 1
    if type(mod) is nn.Sequential and len(mod) >= 2:
        kinds = {type(m) for m in mod}
        # a Sequential of plain layers (Linear, ReLU) is a block, not a stack
        return len(kinds) == 1 and next(iter(kinds)).__module__.split(".")[:3] != [
            "torch", "nn", "modules"]
    return False


def _inside(name: str, taken: set[str]) -> bool:
    parts = name.split(".")
    return any(".".join(parts[:i]) in taken for i in range(1, len(parts) + 1))


def _repeated(named: dict[str, nn.Module]) -> list[tuple[str, nn.Module]]:
    out: list[tuple[str, nn.Module]] = []
    taken: set[str] = set()  # members already observed
    for name, mod in named.items():
        # Every homogeneous ModuleList counts, nested ones too (an MoE layer's
        # experts); a Sequential stack only outside an observed member.  The
        # ancestors of a name are its dotted prefixes: O(depth), not O(members).
        if not isinstance(mod, nn.ModuleList) and _inside(name, taken):
            continue
        if _is_stack(mod):
            members = [(f"{name}.{child}" if name else child, m)
                       for child, m in mod.named_children()]
            out += members
            taken.update(n for n, _ in members)
    if not out:
        raise ValueError("targets='repeated': the module has no stack of repeated blocks "
                         "(an nn.ModuleList, or an nn.Sequential of two or more, whose "
                         "children share one class)")
    return out


def resolve_targets(root: nn.Module, targets: object) -> list[tuple[str, nn.Module]]:
    """``(qualified name, module)`` pairs to observe, in module order; a
    module reachable under several names is selected once, under the first
    name the targets chose."""
    return _unique(_resolve(root, targets))


def beneath_step_caches(pairs: list[tuple[str, nn.Module]]
                        ) -> tuple[list[tuple[str, nn.Module]], tuple[str, ...]]:
    """``pairs`` with each module that holds diffusers step-cache hooks
    below its own level replaced by the hooked submodules (``stephooks.below``):
    captured whole, the hooks' per-step decisions would be frozen into its
    graph; beneath them they stay Python.  Also returns what was replaced,
    as ``"name: hooked path, ..."`` (the rest of such a module runs eagerly)."""
    out: list[tuple[str, nn.Module]] = []
    replaced: list[str] = []
    for name, mod in pairs:
        inner = below(mod)
        if not inner:
            out.append((name, mod))
            continue
        paths = [f"{name}.{p}" if name else p for p, _ in inner]
        out += zip(paths, (m for _, m in inner))
        replaced.append(f"{name or type(mod).__name__}: {', '.join(paths[:4])}"
                        + (f" and {len(paths) - 4} more" if len(paths) > 4 else ""))
    return _unique(out), tuple(replaced)


def _unique(pairs: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    seen: set[int] = set()
    out = []
    for name, mod in pairs:
        if id(mod) not in seen:
            seen.add(id(mod))
            out.append((name, mod))
    return out


def _resolve(root: nn.Module, targets: object) -> list[tuple[str, nn.Module]]:
    if targets is None:
        return [("", root)]
    named = dict(root.named_modules(remove_duplicate=False))
    if targets == "repeated":
        return _repeated(named)
    if isinstance(targets, str):
        raise ValueError(f"targets: unknown mode {targets!r}; use None, 'repeated', a list of "
                         "qualified names or a predicate (name, module) -> bool")
    if callable(targets):
        pred: Callable[[str, nn.Module], bool] = targets
        out = [(n, m) for n, m in named.items() if pred(n, m)]
        if not out:
            raise ValueError("targets: the predicate selected no module")
        return out
    try:
        names = list(targets)  # type: ignore[call-overload]
    except TypeError:
        raise TypeError(f"targets: expected None, 'repeated', names or a predicate, "
                        f"got {targets!r}") from None
    out = []
    for n in names:
        if not isinstance(n, str):
            raise TypeError(f"targets: expected qualified names, got {n!r}")
        if n not in named:
            close = difflib.get_close_matches(n, [k for k in named if k], n=5)
            hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
            raise ValueError(f"targets: no submodule named {n!r}{hint}")
        out.append((n, named[n]))
    return out



def held_objects(module: nn.Module, ignore: Iterable[str] = ()) -> list[object]:
    """The objects the module tree holds as attributes whose own attributes
    ``identity_of`` compares (config objects, processors and other callable
    objects), for ``watch`` to see assignments to them."""
    skip = _INTERNALS | set(ignore)
    out: list[object] = []
    for m in module.modules():
        for k, v in m.__dict__.items():
            if k in skip or isinstance(v, (*_PLAIN, enum.Enum, type, nn.Module, torch.Tensor,
                                           tuple, list, dict, set, frozenset)):
                continue
            compared = callable(v) or \
                getattr(type(v), "__eq__", object.__eq__) is not object.__eq__
            if compared and type(getattr(v, "__dict__", None)) is dict \
                    and len(out) < _MAX_ITEMS:
                out.append(v)
    return out


def _as_now(value: Any) -> Any:
    """A callable attribute as ``state_of`` records it: a callable object
    whose own attributes are all immutable values (an attention processor
    naming its backend, changed in place by a later
    ``set_attention_backend``) as a shallow copy made now, so putting it back
    restores the values the call ran with; functions, methods, partials and
    objects holding anything else as they are."""
    if isinstance(value, (types.FunctionType, types.MethodType, types.BuiltinFunctionType,
                          functools.partial)):
        return value
    own = getattr(value, "__dict__", None)
    if type(own) is not dict or not own \
            or not all(isinstance(v, (*_PLAIN, enum.Enum)) for v in own.values()):
        return value
    try:
        return copy.copy(value)
    except Exception:  # a value that refuses copying is kept as it is
        return value


def state_of(module: nn.Module, ignore: Iterable[str] = ()
             ) -> tuple[tuple[str, str, Any], ...]:
    """``(submodule path, attribute, value)`` of every plain attribute
    ``identity_of`` looks at, as capture can put it back on an isolated view
    of the member: immutable values and callables as they are, containers
    and config objects copied now (so a later change in place does not reach
    them), a callable object holding only immutable values of its own
    copied as well (``_as_now``), an ``Unrestorable`` for one that cannot
    be copied."""
    skip = _INTERNALS | set(ignore)
    out: list[tuple[str, str, Any]] = []
    for path, m in module.named_modules(remove_duplicate=False):
        budget = [4 * _MAX_ITEMS]
        for k, v in m.__dict__.items():
            if k in skip or isinstance(v, torch.Tensor) or _plain(v, budget) is _SKIP:
                continue
            if isinstance(v, (*_PLAIN, enum.Enum, type)):
                out.append((path, k, v))
                continue
            if callable(v):
                out.append((path, k, _as_now(v)))
                continue
            try:
                out.append((path, k, copy.deepcopy(v)))
            except Exception:  # a value that refuses deepcopy cannot be put back
                out.append((path, k, Unrestorable(type(v).__qualname__)))
    return tuple(out)
