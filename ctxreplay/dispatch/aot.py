"""A capture's ahead-of-time compiled program in place of its flat function.

``ctxreplay compile`` compiles each capture's graph with the member's
tensors lifted to inputs, in the flat function's order (``Flat``): the
compiled program takes ``(*member tensors, *call leaves)`` and returns the
flat outputs, so it stands in for ``Flat.fn`` and everything around it --
the member's tensors read on every call, their metadata check, rebuilding
the outputs -- stays as it is.  One package serves every member.

The package is opened through torch's C++ loader
(``torch._C._aoti.AOTIModelPackageLoader``), which extracts it and loads
its shared library: no Python compiler runs (``aoti_load_package`` would
first compile the CPU-probe programs Inductor's Python side builds, ~11 s
on an empty cache, measured).  A folded program runs torch's own input
guard of the uncompiled program first: the compiled code checks no sizes,
and a size its ranges take may still be one the trace specialised away.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .._base.torchcaps import aoti_package_loader, guards_fn_body
from ..loading.compiled import CompiledProgram
from .flat import Flat

__all__ = ["compiled_flat"]

_log = logging.getLogger("ctxreplay")


def compiled_flat(flat: Flat, program: Any, record: CompiledProgram, directory: Path,
                  *, guarded: bool, on_autograd: Callable[[], None] | None = None
                  ) -> Flat | tuple[str, str]:
    """``flat`` with its function replaced by the compiled program, or why
    not (``(reason code, words)``).  ``guarded``: run the uncompiled
    program's input guard before each call (a folded capture);
    ``on_autograd``: called when a call runs the uncompiled function because
    autograd records it."""
    if tuple(record.state) != tuple(flat.state_names):
        return "compiled_mismatch", "it takes other member tensors than the capture's program"
    # its digest read again now, just before its native code is loaded
    refused = record.package_refused(directory)
    if refused is not None:
        return refused
    device = str(record.environment.get("device") or "cpu")
    try:
        loader = aoti_package_loader(str(directory / record.package), device)
    except Exception as exc:  # a package this torch cannot open
        _log.debug("loading %s failed: compiled_load_failed", record.package, exc_info=True)
        return "compiled_load_failed", f"{type(exc).__name__}: {str(exc)[:300]}"
    try:
        guard = _user_guard(program) if guarded else None
    except _Unguarded as exc:
        return "compiled_mismatch", str(exc)
    uncompiled = flat.fn
    if on_autograd is not None:
        told = on_autograd

        def uncompiled(*inputs: Any) -> Any:
            told()
            return flat.fn(*inputs)
    fn = _runner(loader.run, guard, uncompiled, len(flat.state_names), record.leaves)
    return Flat(fn, flat.source, flat.state_names, flat.state_meta, flat.in_spec,
                flat.out_spec)


def _runner(run: Callable[[list[Any]], list[Any]], guard: Callable[..., Any] | None,
            uncompiled: Callable[..., Any], n_state: int,
            keep: tuple[int, ...] | None) -> Callable[..., Any]:
    """The compiled call.  A compiled program computes no gradients (AOTInductor
    compiles for inference): where autograd would record the call -- grad
    mode on and a tensor that requires grad -- the uncompiled function runs.
    ``keep``: the leaves the program takes, where the call also passes
    constants its graph holds (equal to the captured ones: the call matched
    its signature)."""
    is_grad = torch.is_grad_enabled
    if keep is not None:
        run = _taking(run, n_state, keep)

    if guard is None:
        def compiled(*inputs: Any) -> Any:
            if is_grad() and any(getattr(t, "requires_grad", False) for t in inputs):
                return uncompiled(*inputs)
            return run(list(inputs))
        return compiled

    def guarded(*inputs: Any) -> Any:
        if is_grad() and any(getattr(t, "requires_grad", False) for t in inputs):
            return uncompiled(*inputs)  # (its own guard runs inside)
        guard(*inputs[n_state:])  # raises AssertionError("Guard failed ...") on a refused size
        return run(list(inputs))
    return guarded


def _taking(run: Callable[[list[Any]], list[Any]], n_state: int,
            keep: tuple[int, ...]) -> Callable[[list[Any]], list[Any]]:
    """``run`` given the member's tensors and only the leaves at ``keep``."""
    def taking(inputs: list[Any]) -> list[Any]:
        return run(inputs[:n_state] + [inputs[n_state + i] for i in keep])
    return taking


class _Unguarded(Exception):
    """The uncompiled program's input guard cannot be run on its own."""


def _user_guard(program: Any) -> Callable[..., Any] | None:
    """The input guard torch's module of ``program`` runs on the call's leaves
    (``_guards_fn``), or ``None`` where it has none; ``_Unguarded`` where it
    has one this cannot call alone."""
    try:
        gm: Any = program.module()
    except Exception as exc:  # torch's unlifting may raise anything: unguarded (logged)
        _log.debug("reading the input guard failed", exc_info=True)
        raise _Unguarded(f"its program's input guard cannot be read ({type(exc).__name__})") \
            from None
    calls = list(gm.graph.find_nodes(op="call_module", target="_guards_fn"))
    if not calls:
        return None
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    if len(calls) != 1 or list(calls[0].args) != placeholders:
        raise _Unguarded("its program's input guard takes other values than the call's leaves")
    forward = gm.get_submodule("_guards_fn").forward
    found: Callable[..., Any] = guards_fn_body(forward) or forward
    return found
