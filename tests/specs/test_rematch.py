"""A generated rematch says a later call has the first call's key only when it has.

``specs.rematch.rematcher`` stands in for ``call_key`` on dispatch's hot
path, so the property that matters is one-sided and absolute: whenever it
accepts a call, ``call_key`` of that call equals the first call's.  The
oracle is ``call_key`` itself, on calls built from random structures
(tensors, primitives, containers, plain objects holding tensors) and on
every single-place change of them.  Accepting the first call again (and
calls with other tensor values of the same metadata) is what makes it
worth having; ``None`` for what it cannot state exactly (a constant keyed
by its content) is the safe answer.
"""

from __future__ import annotations

import copy
import enum
import types
from typing import Any

import attrs
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ctxreplay.specs.rematch import Rematcher, rematcher
from ctxreplay.specs.signature import (
    DictSpec,
    ObjectSpec,
    SeqSpec,
    TensorSpec,
    call_key,
    call_tensors,
    map_leaves,
)


class Color(enum.Enum):
    RED = 1
    BLUE = 2


class Holder:
    """A plain object holding tensors (as a KV cache does)."""

    def __init__(self, **attrs: Any) -> None:
        self.__dict__.update(attrs)


_SHAPES = st.sampled_from([(2,), (2, 3), (3, 2), (1, 4)])
_DTYPES = st.sampled_from([torch.float32, torch.float64, torch.int64])


@st.composite
def _tensor(draw: Any) -> torch.Tensor:
    t = torch.zeros(draw(_SHAPES), dtype=draw(_DTYPES))
    return t.t() if t.dim() == 2 and draw(st.booleans()) else t


_PRIMITIVE = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.sampled_from([0.5, 1.0]),
                       st.sampled_from(["a", "b"]), st.sampled_from(list(Color)),
                       st.sampled_from([torch.float32, torch.device("cpu")]))


def _value(depth: int = 2) -> Any:
    leaf = st.one_of(_tensor(), _PRIMITIVE)
    if depth == 0:
        return leaf
    inner = _value(depth - 1)
    return st.one_of(
        leaf,
        st.lists(inner, max_size=3),
        st.lists(inner, max_size=3).map(tuple),
        st.dictionaries(st.sampled_from(["k", "v", "w"]), inner, max_size=3),
        st.tuples(_tensor(), st.dictionaries(st.sampled_from(["n", "m"]), inner, max_size=2))
        .map(lambda p: Holder(t=p[0], **p[1])),
    )


_CALLS = st.tuples(st.lists(_value(), max_size=3).map(tuple),
                   st.dictionaries(st.sampled_from(["x", "y", "cache"]), _value(), max_size=3))


def _changes(value: Any) -> list[Any]:
    """``value`` changed in one place each: a tensor of another shape, dtype or
    layout, a primitive of another value or type, a container one longer or
    shorter, an object with an attribute more."""
    out: list[Any] = []
    if isinstance(value, torch.Tensor):
        out += [torch.zeros(5, dtype=value.dtype), value.to(torch.float16),
                value.clone().requires_grad_(True) if value.is_floating_point() else value + 0.0]
    elif isinstance(value, Holder):
        for k in vars(value):
            for c in _changes(getattr(value, k)):
                h = copy.copy(value)
                setattr(h, k, c)
                out.append(h)
        h = copy.copy(value)
        h.extra = 1
        out.append(h)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            for c in _changes(item):
                out.append(type(value)([*value[:i], c, *value[i + 1:]]))
        out += [type(value)([*value, 0]), list(value) if isinstance(value, tuple) else tuple(value)]
    elif isinstance(value, dict):
        for k, item in value.items():
            for c in _changes(item):
                out.append({**value, k: c})
        out.append({**value, "z": 0})
    else:
        out += [1 if value is None else None, str(value) + "!"]
        if isinstance(value, bool):
            out.append(int(value))
    return out


def _sizes_out(key: Any) -> Any:
    """A ``call_key`` with every tensor's sizes and strides left out (its
    dimension count kept)."""
    if type(key) is tuple:
        if len(key) == 5 and type(key[0]) is torch.dtype and type(key[1]) is torch.Size:
            dtype, shape, _stride, device, grad = key
            return ("tensor", dtype, len(shape), device, grad)
        return tuple(_sizes_out(k) for k in key)
    if isinstance(key, (ObjectSpec, SeqSpec, DictSpec, TensorSpec)):  # inside an object
        return map_leaves(key, lambda leaf: attrs.evolve(
            leaf, shape=(0,) * len(leaf.shape), stride=(0,) * len(leaf.shape))
            if isinstance(leaf, TensorSpec) else leaf)
    return key


def _judged(again: Rematcher, first: Any, args: Any, kwargs: Any) -> None:
    """What the rematch says of a changed call holds of its key: accepted
    only with the first call's key, ``Resized`` only with a key that
    differs in tensor sizes and strides alone."""
    got = again(args, kwargs)
    if got is None:
        return
    key = call_key(args, kwargs)
    if type(got) is list:
        assert key == first
        return
    assert type(got) is tuple and len(got) == 1
    (tensors,) = got
    assert [id(t) for t in tensors] == [id(t) for t in call_tensors(args, kwargs)]
    assert key != first and _sizes_out(key) == _sizes_out(first)


@settings(max_examples=150, deadline=None)
@given(_CALLS)
def test_an_accepted_call_always_has_the_first_calls_key(call: tuple[Any, Any]) -> None:
    args, kwargs = call
    again = rematcher(args, kwargs)
    if again is None:
        return
    first = call_key(args, kwargs)
    # the same call, and the same structure with fresh tensors: accepted
    same = again(args, kwargs)
    assert type(same) is list and [id(t) for t in same] == [id(t) for t in
                                                            call_tensors(args, kwargs)]
    fresh = copy.deepcopy((args, kwargs))
    assert type(again(*fresh)) is list
    # every change in one place: accepted only with the same key, found
    # resized only where nothing but sizes differs
    for i, a in enumerate(args):
        for c in _changes(a):
            _judged(again, first, (*args[:i], c, *args[i + 1:]), kwargs)
    for k, v in kwargs.items():
        for c in _changes(v):
            _judged(again, first, args, {**kwargs, k: c})
    if kwargs:  # the keywords in another order: another key, never accepted
        flipped = dict(reversed(list(kwargs.items())))
        if list(flipped) != list(kwargs):
            assert again(args, flipped) is None


def test_a_cache_like_object_is_rematched_and_its_changes_are_not() -> None:
    layer = Holder(keys=torch.zeros(1, 2, 8, 4), values=torch.zeros(1, 2, 8, 4),
                   is_initialized=True, max_cache_len=8, length=torch.tensor(3))
    cache = Holder(layers=[layer], offloading=False)
    x = torch.rand(1, 1, 4)
    again = rematcher((x,), {"cache": cache, "use_cache": True})
    assert again is not None
    got = again((x,), {"cache": cache, "use_cache": True})
    assert got is not None and len(got) == 4
    layer.is_initialized = False  # an attribute assigned: another key
    assert again((x,), {"cache": cache, "use_cache": True}) is None
    layer.is_initialized = True
    cache.layers.append(layer)  # a list grown in place
    assert again((x,), {"cache": cache, "use_cache": True}) is None
    cache.layers.pop()
    layer.keys = torch.zeros(1, 2, 9, 4)  # one token longer: the same but for sizes
    grown = again((x,), {"cache": cache, "use_cache": True})
    assert type(grown) is tuple and grown[0][1] is layer.keys
    layer.keys = torch.zeros(1, 2, 9, 4, dtype=torch.float16)  # another dtype: another key
    assert again((x,), {"cache": cache, "use_cache": True}) is None
    layer.keys = torch.zeros(1, 2, 9)  # another dimension count: another key
    assert again((x,), {"cache": cache, "use_cache": True}) is None


def test_what_it_cannot_state_exactly_has_no_rematch() -> None:
    x = torch.rand(2)
    # a constant keyed by its content, a tensor subclass, a sparse tensor
    assert rematcher((x, types.SimpleNamespace(a=1)), {}) is None
    assert rematcher((torch.nn.Parameter(x),), {}) is None
    assert rematcher((torch.eye(2).to_sparse(),), {}) is None
    assert rematcher((x, float("nan")), {}) is None
    # a tensor passed twice: the same object again, not another one like it
    again = rematcher((x, x), {})
    assert again is not None and again((x, x), {}) is not None
    assert again((x, x.clone()), {}) is None
