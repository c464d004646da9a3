"""No user hook runs inside ctxreplay's own runs of a module.

A module hook is the user's code, run by ``nn.Module.__call__``: a
recording hook appends what it is handed (a trace hands it FakeTensors), a
calibration hook updates its statistics, a hook may return a value that
replaces a module's inputs or output.  ``finalize()`` traces every member
and runs it (and its artifact) to check them, so none of those runs may
call one:

* the hook tables of every module of an isolated view (forward pre-hooks,
  forward hooks, backward hooks, with their ``with_kwargs`` and
  ``always_call`` marks) are emptied: the view is a copy, its tables its
  own, the functions in them the user's (``silence_view``);
* torch's global module hooks (``register_module_forward_hook`` and the
  like) are one table each per process, read by every module's
  ``__call__`` in every thread: while any view is open, each hook in them
  is replaced, under its own key, by a stand-in that runs it in every
  thread except one inside a capture or check (``gated_global_hooks``), and
  put back when the last view closes.  A stand-in under a compiler's trace
  is a no-op only in a capture's thread too: Dynamo caches what it traced.

So a member whose submodules hold hooks is traced as its forward runs
without them: what the hooks did to the live call is what the checks
against live outputs catch, and ``user_hooks`` names the hooks then
(``inert`` ones excepted: hooks known to change nothing a forward returns).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch.nn.modules.module as _module
from torch import nn

__all__ = ["GLOBAL_TABLES", "OWN_TABLES", "computing", "gated_global_hooks", "inert",
           "recording", "silence_view", "user_hooks"]

#: a module's own hook tables, and the tables that only qualify their entries
OWN_TABLES = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_MARKS = ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs",
          "_forward_hooks_always_called")
#: torch's global module hook tables (``torch.nn.modules.module``)
GLOBAL_TABLES = ("_global_forward_pre_hooks", "_global_forward_hooks",
                 "_global_backward_pre_hooks", "_global_backward_hooks")
_KINDS = dict(zip(OWN_TABLES, ("forward_pre_hook", "forward_hook", "backward_pre_hook",
                               "backward_hook")))

#: ``(module, qualified name)`` of hook functions known to change nothing a
#: forward computes: transformers' output-capturing hook returns None and
#: only appends outputs to the collector its model's forward sets up
#: (``output_hidden_states=True``); it stays installed once a model ran so
_INERT = frozenset({
    ("transformers.utils.output_capturing",
     "install_output_capuring_hook.<locals>.output_capturing_hook"),
})


def inert(hook: Any) -> bool:
    """Whether ``hook`` is known to change nothing a forward computes."""
    return (getattr(hook, "__module__", None), getattr(hook, "__qualname__", None)) in _INERT


def recording(hooks: Iterable[Any]) -> Callable[[], bool]:
    """For ``inert`` hooks: whether any of them records now.  Each records
    the output its closure's ``key`` names when the collector its model's
    forward sets (a dict of lists, by key) holds that key; a hook whose key
    cannot be read counts as recording whenever the collector holds any."""
    keys: set[Any] | None = set()
    for hook in hooks:
        code, cells = getattr(hook, "__code__", None), getattr(hook, "__closure__", None)
        names = getattr(code, "co_freevars", ())
        if keys is None or "key" not in names or not cells:
            keys = None
            continue
        try:
            keys.add(cells[names.index("key")].cell_contents)
        except (ValueError, TypeError):  # an empty cell, an unhashable key
            keys = None
    wanted = None if keys is None else frozenset(keys)

    def now() -> bool:
        capturing = sys.modules.get("transformers.utils.output_capturing")
        collector = getattr(capturing, "_active_collector", None)
        try:
            collected = collector.get()  # type: ignore[union-attr]
        except Exception:  # cannot tell: recording
            return True
        if not collected:
            return False
        return wanted is None or any(k in collected for k in wanted)

    return now


def _name(hook: Any) -> str:
    """A hook's function name (its qualified name's last part), or its type's."""
    name = getattr(hook, "__qualname__", None) or type(hook).__name__
    return str(name).rpartition(".")[2]


def user_hooks(member: nn.Module, *, with_inert: bool = False) -> list[str]:
    """The hooks that ``nn.Module.__call__`` runs inside ``member``'s forward
    -- its submodules' and torch's global ones; not the member's own, which
    run around it -- each as ``path.kind[name]`` (``global.kind[name]`` for
    a global one; metadata: a path, a kind, a function name)."""
    found: list[str] = []
    for table_name in GLOBAL_TABLES:
        table = getattr(_module, table_name, None) or {}
        kind = _KINDS[table_name.replace("_global", "")]
        found += [f"global.{kind}[{_name(_inner(h))}]" for h in table.values()
                  if with_inert or not inert(_inner(h))]
    for path, m in member.named_modules(remove_duplicate=False):
        if m is member:
            continue
        for table_name in OWN_TABLES:
            table = getattr(m, table_name, {})
            if isinstance(table, dict) and not table:  # most modules hold none
                continue
            found += [f"{path}.{_KINDS[table_name]}[{_name(h)}]" for h in table.values()
                      if (with_inert or not inert(h)) and not computing(h)]
    return found


#: modules whose hooks are part of what a forward computes, not the user's
#: code: torch's tensor parallelism (``distribute_module``'s input and output
#: functions make and unmake the DTensors its parallel styles compute with).
#: A view keeps them: without them a TP linear meets a plain input
#: ("aten.addmm.default got mixed torch.Tensor and DTensor").  FSDP's are
#: not here: a graph traced through them would skip their gathering
_COMPUTING = ("torch.distributed.tensor.",)


def computing(hook: Any) -> bool:
    """Whether ``hook`` is one of torch's own parallelism hooks (``_COMPUTING``)."""
    fn = getattr(hook, "func", hook)  # a functools.partial
    fn = getattr(fn, "__func__", fn)  # a bound method
    module = getattr(fn, "__module__", None) or ""
    return module.startswith(_COMPUTING)


def silence_view(view: nn.Module) -> None:
    """Empty the hook tables of every module of ``view`` (a copy: the tables
    are its own; emptied in place, as an empty table is what torch checks),
    but for torch's own parallelism hooks (``computing``)."""
    for m in view.modules():
        dropped: set[Any] = set()
        for name in OWN_TABLES:
            table = m.__dict__.get(name)
            if isinstance(table, dict) and table:
                dropped.update(k for k, h in table.items() if not computing(h))
                for key in dropped.intersection(table):
                    del table[key]
        for name in _MARKS:
            table = m.__dict__.get(name)
            if isinstance(table, dict) and table:
                for key in dropped.intersection(table):
                    del table[key]


class _Gate:
    """The stand-ins in torch's global tables, while any view is open."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.open = 0
        #: (table, key) -> (the user's hook, its stand-in)
        self.replaced: dict[tuple[int, Any], tuple[dict[Any, Any], Any, Any]] = {}


_gate = _Gate()


def _inner(hook: Any) -> Any:
    """The user's hook behind a stand-in (the hook itself otherwise)."""
    return getattr(hook, "__ctxreplay_hook__", hook)


def _stand_in(hook: Any, silent: Callable[[], bool]) -> Callable[..., Any]:
    def stand_in(*args: Any, **kwargs: Any) -> Any:
        if silent():
            return None  # "no change" for every kind of module hook
        return hook(*args, **kwargs)

    stand_in.__ctxreplay_hook__ = hook  # type: ignore[attr-defined]
    return stand_in


@contextmanager
def gated_global_hooks(silent: Callable[[], bool]) -> Iterator[None]:
    """Inside, torch's global module hooks run in every thread where
    ``silent()`` is false, and nowhere else.  Nested and concurrent uses
    share the stand-ins; the last one out puts every hook back under its
    key (one removed meanwhile stays removed)."""
    with _gate.lock:
        _gate.open += 1
        for table_name in GLOBAL_TABLES:
            table = getattr(_module, table_name, None)
            if not isinstance(table, dict):
                continue
            for key, hook in list(table.items()):
                if (id(table), key) not in _gate.replaced:
                    standin = _stand_in(hook, silent)
                    _gate.replaced[id(table), key] = (table, hook, standin)
                    table[key] = standin  # the same key keeps its place in the order
    try:
        yield
    finally:
        with _gate.lock:
            _gate.open -= 1
            if _gate.open == 0:
                for (_, key), (table, hook, standin) in _gate.replaced.items():
                    if table.get(key) is standin:
                        table[key] = hook
                _gate.replaced.clear()
