"""A forward's assignments to its argument objects, carried as program outputs.

A graph reproduces in-place updates of its input tensors, but not a Python
assignment: transformers' ``DynamicCache`` layer ``update()`` sets ``keys``
and ``values`` to new, longer tensors (``torch.cat``), and its lazy
initialisation sets ``is_initialized`` and ``device``.  Where every change a
forward makes to its arguments is such an assignment -- a tensor, or a plain
constant (``PRIMITIVES``: bools, ints, dtypes, devices) -- the traced
function reads the assigned tensors back from the argument objects after
the forward and returns them beside its outputs, so the graph computes
them; the checks compare them with what the member itself assigns on the
same inputs, and an installed call writes them (and the constants) to the
same paths of the live call's objects, as the eager forward does.

A path is the ``mutation.arguments_state`` one: the argument (``args[0]``,
``kwargs['cache']``), then attribute and item steps (``.layers``, ``[0]``).
"""

from __future__ import annotations

import ast
import functools
from typing import Any

import attrs
import torch

from .mutation import Path, arguments_state, changes

__all__ = ["Assigned", "assigned_by", "collect", "joined", "joined_result", "read", "split",
           "write"]

#: the kinds of ``arguments_state`` token an assignment may leave at a path
_ASSIGNABLE = ("tensor", "value")


@attrs.frozen
class Assigned:
    """What a forward assigns to its argument objects, in path order."""

    tensors: tuple[Path, ...]
    """Where it assigns a tensor: the program's last outputs, in this order."""
    constants: tuple[tuple[Path, Any], ...] = ()
    """Where it assigns a plain constant, and the value (the same on every
    call of the variant: the checks compare it)."""
    named: tuple[str, ...] = ()
    """``tensors`` from their argument's type (``DynamicCache.layers[0].keys``)."""

    def paths(self) -> set[str]:
        """Every path it covers, joined as mutations name them."""
        return {joined(p) for p in self.tensors} | {joined(p) for p, _ in self.constants}

    def to_json(self) -> dict[str, Any]:
        """Metadata only: paths, and the constants' values as text."""
        return {"tensors": [joined(p) for p in self.tensors], "named": list(self.named),
                "constants": [[joined(p), _shown(v)] for p, v in self.constants]}


def _shown(value: Any) -> str:
    """A constant as metadata: text a user's input may hold by its type only."""
    return type(value).__name__ if isinstance(value, (str, bytes)) else repr(value)


def joined(path: Path) -> str:
    return "".join(path)


def assigned_by(args: tuple[Any, ...], kwargs: dict[str, Any],
                before: dict[Path, Any]) -> Assigned | None:
    """What a run changed in ``args``/``kwargs`` since ``before`` (their
    ``arguments_state`` walk, whose objects the caller kept alive), when every
    change is an assignment of a tensor or a plain constant; ``None`` when
    nothing changed or some change is not (an append, a new object, a
    deletion): the caller leaves those to the watch, which reports them."""
    after, held = arguments_state(args, kwargs)
    found = changes(before, after, limit=None)
    del held
    if not found:
        return None
    tensors: list[Path] = []
    named: list[str] = []
    constants: list[tuple[Path, Any]] = []
    for m in found:
        path = _path_of(m.path, after)
        token = after.get(path) if path is not None else None
        if path is None or token is None or token[0] not in _ASSIGNABLE or len(path) < 2:
            return None
        if token[0] == "tensor":
            tensors.append(path)
            named.append(m.where)
        else:
            constants.append((path, token[2]))
    return Assigned(tuple(tensors), tuple(constants), tuple(named))


def _path_of(text: str, tokens: dict[Path, Any]) -> Path | None:
    for path in tokens:
        if joined(path) == text:
            return path
    return None


def collect(assigned: Assigned, args: tuple[Any, ...],
            kwargs: dict[str, Any]) -> tuple[torch.Tensor, ...]:
    """The tensors at ``assigned.tensors`` in the call's objects."""
    return tuple(read(args, kwargs, p) for p in assigned.tensors)


#: a parsed step: ``(True, attribute name)`` or ``(False, item key)``
_Step = tuple[bool, Any]


@functools.lru_cache(maxsize=4096)
def _parsed(path: Path) -> tuple[bool, Any, tuple[_Step, ...]]:
    """``(positional, root index or keyword, steps)``: parsed once per path
    (an installed call writes the same paths on every call)."""
    root = path[0]
    steps = tuple((True, s[1:]) if s.startswith(".") else (False, ast.literal_eval(s[1:-1]))
                  for s in path[1:])
    if root.startswith("args["):
        return True, int(root[5:-1]), steps
    return False, ast.literal_eval(root[7:-1]), steps


def _walk(args: tuple[Any, ...], kwargs: dict[str, Any], path: Path) -> tuple[Any, _Step]:
    """The object holding the last step of ``path``, and that step."""
    positional, root, steps = _parsed(path)
    value = args[root] if positional else kwargs[root]
    for attr, key in steps[:-1]:
        value = getattr(value, key) if attr else value[key]
    return value, steps[-1]


def read(args: tuple[Any, ...], kwargs: dict[str, Any], path: Path) -> Any:
    """The value at ``path`` of a call's arguments."""
    if len(path) == 1:
        positional, root, _ = _parsed(path)
        return args[root] if positional else kwargs[root]
    holder, (attr, key) = _walk(args, kwargs, path)
    return getattr(holder, key) if attr else holder[key]


def write(args: tuple[Any, ...], kwargs: dict[str, Any], assigned: Assigned,
          tensors: tuple[Any, ...] | list[Any]) -> None:
    """Assign ``tensors`` (the program's extra outputs) and the constants
    to their paths of a live call's objects, as the eager forward does."""
    for path, value in assigned.constants:
        _assign(args, kwargs, path, value)
    for path, value in zip(assigned.tensors, tensors):
        _assign(args, kwargs, path, value)


def _assign(args: tuple[Any, ...], kwargs: dict[str, Any], path: Path, value: Any) -> None:
    holder, (attr, key) = _walk(args, kwargs, path)
    if attr:
        setattr(holder, key, value)
    else:
        holder[key] = value


def split(raw: Any, assigned: Assigned | None, flatten_out: bool) -> tuple[Any, tuple[Any, ...]]:
    """A program's result as ``(outputs, assigned tensors)``: the traced
    function returned ``(*leaves, *tensors)`` for a flattened output, else
    ``(outputs, *tensors)``."""
    n = 0 if assigned is None else len(assigned.tensors)
    if not n:
        return raw, ()
    raw = tuple(raw)
    if flatten_out:
        return raw[:-n], raw[-n:]
    return raw[0], raw[1:]


def joined_result(out: Any, tensors: tuple[Any, ...], flatten_out: bool) -> Any:
    """What the traced function returns: ``split``'s inverse."""
    if not tensors:
        return out
    if flatten_out:
        return (*out, *tensors)
    return (out, *tensors)
