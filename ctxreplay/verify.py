"""Fidelity checks: captured outputs against the live call."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .report import Fidelity, Mismatch
from .signature import (
    SeqSpec,
    Spec,
    SpecMismatch,
    TensorSpec,
    compare_specs,
    flatten_spec,
    spec_of,
    symbolic_dims,
)
from .snapshot import ContextSnapshot

__all__ = ["LEVELS", "flat_tensor_spec", "hint_for", "verify"]

LEVELS = ("off", "signature", "execute")


def flat_tensor_spec(spec: Spec) -> SeqSpec:
    """The tensor leaves of an output, in order, as one list spec: backends
    flatten outputs, so live and captured are compared leaf by leaf."""
    return SeqSpec(list, tuple(s for s in flatten_spec(spec) if isinstance(s, TensorSpec)))


def hint_for(snapshot: ContextSnapshot, carried: tuple[str, ...]) -> str | None:
    """Probes with a non-neutral state that the artifact did not carry."""
    missing = [n for n, p, s in zip(snapshot.names, snapshot.probes, snapshot.states)
               if n not in carried and not _neutral(p, s)]
    if not missing:
        return None
    described = snapshot.describe()
    return "not carried by the artifact: " + ", ".join(
        f"{n}={described[n]}" for n in missing)


def _neutral(probe: Any, state: Any) -> bool:
    try:
        return bool(probe.neutral(state))
    except Exception:
        return False


def verify(
    level: str,
    live: Spec | None,
    captured: Spec | None,
    *,
    snapshot: ContextSnapshot,
    applied: tuple[str, ...],
    embedded: tuple[str, ...],
    execute: Callable[[], Any] | None,
) -> Fidelity:
    """Compare at ``level``.  ``applied``: probes replayed during capture;
    ``embedded``: probes the artifact carries by itself (for ``execute``)."""
    if level == "off" or live is None:
        return Fidelity(level, True, (), ())
    live_flat = flat_tensor_spec(live)
    mismatches: list[Mismatch] = []
    checked = ["signature"]
    free = symbolic_dims(flat_tensor_spec(captured)) if captured is not None else {}
    if captured is None:
        mismatches.append(Mismatch("out", "graph", "outputs", "no output metadata",
                                   "signature"))
    else:
        found = compare_specs(live_flat, flat_tensor_spec(captured), requires_grad=False)
        mismatches += _with_hints(found, "signature", snapshot, applied)
    if level == "execute" and execute is not None:
        checked.append("execute")
        try:
            produced = spec_of(execute())
        except Exception as exc:
            # e.g. a bfloat16 input meeting float32 weights once autocast is
            # gone: the probes the artifact did not carry are the likely cause
            mismatches.append(Mismatch("out", "execution", "ran", type(exc).__name__,
                                       "execute", hint_for(snapshot, embedded)))
        else:
            # a data-dependent size differs on other inputs by nature
            found = compare_specs(live_flat, flat_tensor_spec(produced), free_dims=free)
            mismatches += _with_hints(found, "execute", snapshot, embedded)
    return Fidelity(level, not mismatches, tuple(mismatches), tuple(checked))


def _with_hints(found: list[SpecMismatch], level: str, snapshot: ContextSnapshot,
                carried: tuple[str, ...]) -> list[Mismatch]:
    hint = hint_for(snapshot, carried) if found else None
    return [Mismatch.of(m, level, hint) for m in found]
