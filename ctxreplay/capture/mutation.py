"""Whether a forward changed, in Python, the objects it was given.

A graph reproduces what a forward does to tensors -- an in-place update of
an input tensor (a ``StaticCache``'s ``index_copy_``) is recorded as a
mutated input and written back when the program runs -- but nothing of what
it does to Python objects: transformers' ``DynamicCache.update()`` assigns
each layer's ``keys`` a new, longer tensor, a cache's lazy initialisation
sets attributes, a forward may append to a list it was given.  A program
installed in place of such a forward leaves the live object as it was, and
the next call reads a cache that never grew.

So capture compares the arguments the (isolated) forward receives before
and after it runs -- the traced run and the checker's reference runs, on
the inputs capture materialised, never on the user's objects: a
``arguments_state`` walk records per path the structure a graph cannot change
(container lengths, attribute names, which tensor or object sits where, the
values of plain scalars), and ``changes`` names what differs, shallowest
first.  Tensor contents are not part of it: in-place tensor updates are the
graph's to reproduce.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import attrs
import torch
from torch import nn

from .._base.torchcaps import dynamo_compiling
from ..fidelity.verify import Fidelity, Mismatch
from ..specs.signature import PRIMITIVES
from .isolate import forward_wrapped
from .pystate import Reach, held_constants, reach

__all__ = ["ARGUMENT_FIELD", "HELD_FIELD", "Mutation", "MutationLog", "changes",
           "mutation_mismatches", "arguments_state", "watched", "with_mutations"]

#: ``Mismatch.field`` (and ``level``) of a change to an argument object: a
#: capture holding one is not ok, and ``install`` never dispatches it
#: (reason ``mutates_argument``)
ARGUMENT_FIELD = "argument"

# a 32-layer cache is a few hundred objects; beyond these bounds (and for
# objects keeping their state in slots) a change is not seen
_MAX_NODES = 16384
_MAX_DEPTH = 32
_MAX_REPORTED = 4
#: ``Mismatch.field`` of a write the traced forward made to Python state it
#: keeps between calls (a memo, a closure's counter, a step cache's hook
#: state): each call then depends on what earlier ones left there, which no
#: graph reads, so the capture stands for none of them (not ok; ``install``
#: never dispatches a capture that is not ok)
HELD_FIELD = "held_state"
#: the attribute steps of a ``pystate`` label (``Locked.log``, ``X.cache['k']``)
_ATTRIBUTE = re.compile(r"\.([A-Za-z_]\w*)")
#: ``Mismatch.captured`` of a change to an argument: the graph holds no op
#: that makes it
_NOT_IN_GRAPH = "no graph op"

#: a path: the argument (``args[0]``, ``kwargs['cache']``), then the
#: attribute and item steps below it (``.layers``, ``[0]``)
Path = tuple[str, ...]
#: what a walk records at one path: ``(kind, type name, identity, size)``;
#: plain scalars carry their value as identity
Token = tuple[str, str, Any, int]


@attrs.frozen
class Mutation:
    """One change a forward made to an argument object."""

    path: str
    """Where, from the argument: ``kwargs['cache'].layers[0].keys``."""
    where: str
    """The same, from the argument's type: ``DynamicCache.layers[0].keys``."""
    change: str
    """What the forward did: ``assigned (new Tensor)``, ``appended (0 -> 1
    items)``, ``attribute set``."""
    field: str = ARGUMENT_FIELD
    """``ARGUMENT_FIELD``, or ``HELD_FIELD``: Python state the forward
    reaches and keeps (a closure's counter, a step cache's hook state)."""

    def describe(self) -> str:
        """``DynamicCache.layers[0].keys: assigned (new Tensor)``."""
        return f"{self.where}: {self.change}"


def _token(value: Any) -> tuple[Token, Iterator[tuple[str, Any]] | None]:
    """The token of ``value`` and its children (``None``: a leaf)."""
    t = type(value)
    name = t.__qualname__
    if t in PRIMITIVES or isinstance(value, enum.Enum):
        return ("value", name, value, 0), None
    if isinstance(value, torch.Tensor):
        return ("tensor", "Tensor", id(value), 0), None  # a tracer's fake too
    if t in (list, tuple) or (isinstance(value, tuple) and hasattr(value, "_fields")):
        return ("seq", name, id(value), len(value)), \
            ((f"[{i}]", v) for i, v in enumerate(value))
    if isinstance(value, dict):
        return ("dict", name, id(value), len(value)), \
            ((f"[{k!r}]", v) for k, v in list(value.items()))
    if isinstance(value, (set, frozenset)):
        return ("set", name, id(value), len(value)), None
    d = getattr(value, "__dict__", None)
    if type(d) is dict and not callable(value) and not isinstance(value, (nn.Module, type)):
        return ("object", name, id(value), 0), ((f".{k}", v) for k, v in list(d.items()))
    return ("ref", name, id(value), 0), None


def arguments_state(args: tuple[Any, ...], kwargs: dict[str, Any]
             ) -> tuple[dict[Path, Token], list[Any]]:
    """``(path -> token, the objects seen)`` of a call's arguments, bounded;
    the caller keeps the objects alive while it compares, so no identity
    recorded is reused by another object in between."""
    tokens: dict[Path, Token] = {}
    held: list[Any] = []
    seen: set[int] = set()
    roots = [(f"args[{i}]", a) for i, a in enumerate(args)]
    roots += [(f"kwargs[{k!r}]", v) for k, v in kwargs.items()]
    stack: list[tuple[Path, Any]] = [((p,), v) for p, v in reversed(roots)]
    while stack and len(tokens) < _MAX_NODES:
        path, value = stack.pop()
        try:
            token, kids = _token(value)
            below = None if kids is None else [((*path, step), v) for step, v in kids]
        except Exception:  # an object whose attributes refuse to be read: by identity
            token, below = ("ref", type(value).__qualname__, id(value), 0), None
        tokens[path] = token
        held.append(value)
        if below is None or id(value) in seen or len(path) > _MAX_DEPTH:
            continue
        seen.add(id(value))
        stack.extend(reversed(below))
    return tokens, held


def _words(before: Token | None, after: Token | None, step: str) -> str:
    """The change, tersely (reports hold metadata, not sentences)."""
    if before is None:
        assert after is not None
        return "attribute set" if step.startswith(".") else f"item {step} added"
    if after is None:
        return "attribute deleted" if step.startswith(".") else f"item {step} removed"
    if before[0] == after[0] and before[2] == after[2] and before[0] in ("seq", "dict", "set"):
        verb = "appended" if before[0] == "seq" else "added"
        if after[3] < before[3]:
            verb = "removed"
        return f"{verb} ({before[3]} -> {after[3]} items)"
    return f"assigned (new {after[1]})"


def changes(before: dict[Path, Token], after: dict[Path, Token],
            limit: int | None = _MAX_REPORTED) -> list[Mutation]:
    """What differs between two walks of the same arguments, shallowest
    first (the first ``limit``; ``None``: all): a change below a changed
    path is part of that change."""
    found: list[Mutation] = []
    changed: set[Path] = set()
    order = list(before) + [p for p in after if p not in before]
    for path in order:
        b, a = before.get(path), after.get(path)
        if b == a or any(path[:i] in changed for i in range(1, len(path))):
            continue
        changed.add(path)
        root = before.get(path[:1]) or after.get(path[:1])
        where = (root[1] if root else path[0]) + "".join(path[1:])
        found.append(Mutation("".join(path), where, _words(b, a, path[-1])))
        if limit is not None and len(found) >= limit:
            break
    return found


@attrs.define
class MutationLog:
    """Collects the changes runs of a forward made to their arguments."""

    found: list[Mutation] = attrs.field(factory=list)
    #: attribute names whose writes ``held`` leaves out (``ignore_attributes``:
    #: the user says the forward's result does not depend on them, a log)
    ignore: tuple[str, ...] = ()
    #: the walk of the traced module's kept state before the trace
    before: Reach | None = None
    #: the runs it watched
    runs: int = 0

    def call(self, fn: Callable[..., Any], args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> Any:
        """``fn(*args, **kwargs)``, noting what it changed in its arguments."""
        before, held = arguments_state(args, kwargs)
        out = fn(*args, **kwargs)
        self.note(before, args, kwargs)
        del held
        return out

    def held(self, before: Reach) -> None:
        """Note what the runs since ``before`` (a ``pystate.reach`` of the
        module they ran) wrote in the Python state the forward keeps."""
        for change in before.changes(_MAX_REPORTED + len(self.ignore)):
            self.wrote(change)

    def wrote(self, change: str) -> None:
        """Note one write (``where: what``) to the Python state the forward
        keeps: by a run here, or by a repeat live call (``MemberCall.writes``)."""
        where, _, what = change.partition(": ")
        if self.ignore and set(_ATTRIBUTE.findall(where)) & set(self.ignore):
            return
        m = Mutation("forward", where, what, HELD_FIELD)
        if m not in self.found:
            self.found.append(m)

    def constants(self, artifact: Any, gm: Any) -> None:
        """Note each tensor constant of the traced artifact that the
        forward read from the Python state it keeps (a step cache's stored
        output): the program returns that tensor whatever the call."""
        if self.before is None:
            return
        for where in held_constants(artifact, gm, self.before)[:_MAX_REPORTED]:
            m = Mutation("forward", where, "a graph constant", HELD_FIELD)
            if m not in self.found:
                self.found.append(m)

    def note(self, before: dict[Path, Token], args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> None:
        """Note what a run changed in its arguments since ``before`` (their
        ``arguments_state`` walk, whose objects the caller kept alive)."""
        self.runs += 1
        after, _ = arguments_state(args, kwargs)
        # all of them: a program may make some (``assigned``), and a change
        # past the first few must still be seen
        for m in changes(before, after, limit=None):
            if m not in self.found:
                self.found.append(m)


@contextmanager
def watched(module: nn.Module, watch: MutationLog) -> Iterator[None]:
    """Inside, each call of ``module``'s ``forward`` (an isolated view's)
    is run through ``watch``; Dynamo tracing it sees the forward alone (it
    would graph-break on the walk, and the tracer's own arguments are not
    the call's).

    The wrapper is one frame, and its code is not named ``forward``: torch
    records each traced node's stack from the first frame named
    ``forward`` (so the graph's stack traces start at the module's own, as
    a direct export's do), walking every frame of the stack at every node."""
    def wrap(orig: Callable[..., Any]) -> Callable[..., Any]:
        def watched_forward(*args: Any, **kwargs: Any) -> Any:
            if dynamo_compiling():
                return orig(*args, **kwargs)
            before, held = arguments_state(args, kwargs)
            out = orig(*args, **kwargs)
            watch.note(before, args, kwargs)
            del held
            return out
        return watched_forward

    before = watch.before = reach(module)
    with forward_wrapped(module, wrap):
        yield
    watch.held(before)


def with_mutations(fidelity: Fidelity, found: list[Mutation]) -> Fidelity:
    """``fidelity`` with a mismatch per change found (not ok, whatever the
    outputs showed: the live object changed in a way no run of the graph
    repeats); ``fidelity`` itself when there is none.  The walk ran with the
    trace, so ``checked`` names it when no other check ran."""
    if not found:
        return fidelity
    return attrs.evolve(fidelity, ok=False,
                        mismatches=(*fidelity.mismatches, *mutation_mismatches(found)),
                        checked=fidelity.checked or (ARGUMENT_FIELD,), ok_with_needs=None)


def mutation_mismatches(found: list[Mutation]) -> tuple[Mismatch, ...]:
    """A mismatch per change found (the first few), field and level
    ``argument``: no graph op makes it."""
    return tuple(Mismatch(m.path, m.field, m.describe(), _NOT_IN_GRAPH, ARGUMENT_FIELD)
                 for m in list(dict.fromkeys(found))[:_MAX_REPORTED])
