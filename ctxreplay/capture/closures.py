"""The functions an isolated copy holds, pointed at the copy.

``copy.deepcopy`` keeps a function as it is, so a function held as an
attribute (a replacement ``forward``, a hook registry's partial) reaches
the original's objects through its closure cells.  ``follow_closures``
rebuilds each such function of a copy with cells holding the copies;
``held_objects`` walks the objects a module tree holds (both bounded).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["MODULE_DICTS", "follow_closures", "held_objects"]

#: objects walked at most
_MAX_OBJECTS = 4096


def follow_closures(view: nn.Module, memo: dict[int, Any]) -> None:
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
            slots = [(k, v) for k, v in table.items() if k not in MODULE_DICTS]
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


#: what ``follow_closures`` rebuilds, and what it never walks into
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


def held_objects(module: nn.Module, leaf: Callable[[Any], bool] = lambda obj: False
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
            stack.extend(v for k, v in d.items() if k not in MODULE_DICTS)
        elif isinstance(obj, nn.Module):
            stack.extend(v for k, v in obj.__dict__.items() if k not in MODULE_DICTS)


# a module's parameter / buffer / submodule tables: walked through modules()
MODULE_DICTS = frozenset({"_parameters", "_modules"})
