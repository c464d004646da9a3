"""Fidelity checks: a capture against the live calls it stands for.

Three checks, each per member that ran the variant:

* ``signature`` -- the graph's output metadata (dtype, shape, device)
  against the member's live output;
* ``execute`` -- the artifact run with the member's own weights on fresh
  inputs, from a neutral state plus only what the capture says must be
  re-established (``neutral_replay``): never whatever the caller of
  ``finalize()`` has active.  Its outputs are compared with the live
  output's metadata (strides included) and, by value, with the member
  itself run on the same inputs under the live context;
* ``values`` -- the artifact run on retained copies of the member's first
  live call, its outputs compared with the retained live outputs by value.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import attrs
import torch

from ._json import dtype_name
from .compare import SpecMismatch, compare_specs, symbolic_dims
from .probe import ContextProbe
from .signature import SeqSpec, Spec, TensorSpec, flatten_spec, spec_of, tensor_values
from .snapshot import ContextSnapshot

__all__ = ["LEVELS", "Fidelity", "Mismatch", "check_outputs", "check_signature",
           "compare_values", "flat_tensor_spec", "hint_for", "is_neutral", "merge_mismatches",
           "neutral_replay"]

LEVELS = ("off", "signature", "execute", "values")


@attrs.frozen
class Mismatch:
    """A captured output that disagrees with a live one.

    ``level`` is the check that found it (``signature``, ``execute``,
    ``values`` or ``saved``); ``members`` the blocks whose calls show it
    (empty for a capture of a single module); ``hint`` names probes whose
    state the artifact does not carry."""

    path: str
    field: str
    live: str
    captured: str
    level: str
    hint: str | None = None
    members: tuple[str, ...] = ()

    @classmethod
    def of(cls, m: SpecMismatch, level: str, hint: str | None,
           member: str | None = None) -> Mismatch:
        return cls(m.path, m.field, m.live, m.captured, level, hint,
                   () if member is None else (member,))

    def to_json(self) -> dict[str, Any]:
        out = attrs.asdict(self)
        out["members"] = list(self.members)
        return out


def merge_mismatches(found: Iterable[Mismatch]) -> tuple[Mismatch, ...]:
    """One mismatch per distinct finding, listing every member it was seen in."""
    merged: dict[tuple[Any, ...], list[str]] = {}
    for m in found:
        key = (m.path, m.field, m.live, m.captured, m.level, m.hint)
        merged.setdefault(key, [])
        merged[key] += [n for n in m.members if n not in merged[key]]
    return tuple(Mismatch(*key, members=tuple(members))  # type: ignore[misc]
                 for key, members in merged.items())


@attrs.frozen
class Fidelity:
    """Whether a capture reproduces every live call it stands for.

    ``level``: what was asked; ``checked``: the checks that ran (a check
    that could not run is a mismatch, never silently skipped); ``members``:
    how many members' calls were checked."""


    level: str
    ok: bool
    mismatches: tuple[Mismatch, ...] = ()
    checked: tuple[str, ...] = ()
    members: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"level": self.level, "ok": self.ok, "checked": list(self.checked),
                "members": self.members,
                "mismatches": [m.to_json() for m in self.mismatches]}


def is_neutral(probe: ContextProbe[Any], state: Any) -> bool:
    """``probe.neutral(state)``; a probe that fails to say is not neutral."""
    try:
        return bool(probe.neutral(state))
    except Exception:
        return False


def flat_tensor_spec(spec: Spec) -> SeqSpec:
    """The tensor leaves of an output, in order, as one list spec: backends
    flatten outputs, so live and captured are compared leaf by leaf."""
    return SeqSpec(list, tuple(s for s in flatten_spec(spec) if isinstance(s, TensorSpec)))


def hint_for(snapshot: ContextSnapshot, carried: Iterable[str]) -> str | None:
    """Probes with a non-neutral state that the artifact does not carry."""
    carried = set(carried)
    missing = [n for n, p, s in zip(snapshot.names, snapshot.probes, snapshot.states)
               if n not in carried and not is_neutral(p, s)]
    if not missing:
        return None
    described = snapshot.describe()
    return "not carried by the artifact: " + ", ".join(f"{n}={described[n]}" for n in missing)


@contextmanager
def neutral_replay(snapshot: ContextSnapshot, baseline: Iterable[ContextProbe[Any]] = (),
                   *, full: bool = False, only_neutral: bool = False) -> Iterator[None]:
    """The state a fresh process has -- every probe of ``snapshot`` and of
    ``baseline`` at its ``neutral_state()`` (a probe that does not know it is
    left as it is) -- plus, from ``snapshot``, what no artifact can carry:
    the part of each probe's replay that must surround the captured callable
    (``split_replay``'s *around*: inference mode, a framework's live
    context, determinism flags), except pinnable states (default dtype and
    device), which a capture writes into its graph.  So an artifact run here
    shows whether it carries what it can carry.  ``full=True`` replays the
    whole snapshot instead (the live call's context); ``only_neutral=True``
    nothing of it (the state a capture starts from, whatever the caller of
    ``finalize()`` has active).  Restores exactly on exit."""
    probes: dict[str, ContextProbe[Any]] = {p.name: p for p in baseline}
    probes.update(zip(snapshot.names, snapshot.probes))
    with ExitStack() as stack:
        for name in sorted(probes):
            neutral = probes[name].neutral_state()
            if neutral is not None:
                stack.enter_context(probes[name].replay(neutral))
        if only_neutral:
            pass
        elif full:
            stack.enter_context(snapshot.replay())
        else:
            for probe, state in zip(snapshot.probes, snapshot.states):
                if probe.pinnable:
                    continue
                around = probe.split_replay(state)[1]
                if around is not None:
                    stack.enter_context(around)
        yield


def check_signature(live: Spec | None, captured: Spec | None, snapshot: ContextSnapshot,
                    applied: Iterable[str], member: str | None = None) -> list[Mismatch]:
    """The graph's output metadata against one live call's outputs."""
    if live is None:
        return []
    if captured is None:
        return [Mismatch("out", "graph", "outputs", "no output metadata", "signature",
                         None, _m(member))]
    # Strides are compared where the artifact runs (execute): a graph's
    # metadata strides are what torch's meta kernels say, which for composite
    # ops (scaled_dot_product_attention under sdpa_kernel) is not what the
    # kernel the flags pick returns.
    found = compare_specs(flat_tensor_spec(live), flat_tensor_spec(captured),
                          requires_grad=False, strides=False)
    hint = hint_for(snapshot, applied) if found else None
    return [Mismatch.of(m, "signature", hint, member) for m in found]


def check_outputs(live: Spec, produced: Any, snapshot: ContextSnapshot,
                  carried: Iterable[str], level: str, *, captured: Spec | None = None,
                  member: str | None = None) -> list[Mismatch]:
    """What an executed artifact returned against a live call's output metadata.
    Dimensions the captured graph left symbolic are not compared."""
    free = symbolic_dims(flat_tensor_spec(captured)) if captured is not None else {}
    found = compare_specs(flat_tensor_spec(live), flat_tensor_spec(spec_of(produced)),
                          free_dims=free)
    hint = hint_for(snapshot, carried) if found else None
    return [Mismatch.of(m, level, hint, member) for m in found]


# absolute / relative tolerance per dtype, a little looser than
# torch.testing's defaults: an artifact may run other (equivalent) kernels
_TOLERANCES = {
    torch.float64: (1e-7, 1e-7), torch.float32: (1e-5, 1e-4), torch.complex64: (1e-5, 1e-4),
    torch.complex128: (1e-7, 1e-7), torch.bfloat16: (1e-2, 1.6e-2),
    torch.float16: (1e-3, 1e-3),
}


def compare_values(expected: Any, produced: Any, level: str, *,
                   hint: str | None = None, member: str | None = None) -> list[Mismatch]:
    """Tensor leaves of ``produced`` against ``expected`` by value, with a
    per-dtype tolerance (exact for integers and bools).  A mismatch says how
    many elements differ -- never the values themselves."""
    want = list(tensor_values(expected))
    got = list(tensor_values(produced))
    if len(want) != len(got):
        return [Mismatch("out", "structure", f"{len(want)} tensors", f"{len(got)} tensors",
                         level, hint, _m(member))]
    out = []
    for i, (a, b) in enumerate(zip(want, got)):
        path = f"out[{i}]"
        if a.shape != b.shape or a.dtype != b.dtype:
            out.append(Mismatch(path, "values", f"{dtype_name(a.dtype)}{list(a.shape)}",
                                f"{dtype_name(b.dtype)}{list(b.shape)}", level, hint,
                                _m(member)))
            continue
        a_, b_ = a.detach().cpu(), b.detach().cpu()
        if a.dtype.is_floating_point or a.dtype.is_complex:
            atol, rtol = _TOLERANCES.get(a.dtype, (1e-2, 1e-2))
            a_, b_ = a_.to(torch.complex128 if a.dtype.is_complex else torch.float64), \
                b_.to(torch.complex128 if a.dtype.is_complex else torch.float64)
            bad = ~torch.isclose(a_, b_, rtol=rtol, atol=atol, equal_nan=True)
            where = f"within {dtype_name(a.dtype)} tolerance (rtol={rtol:g}, atol={atol:g})"
        else:
            bad = a_ != b_
            where = "equal"
        n = int(bad.sum())
        if n:
            share = n / max(bad.numel(), 1)
            out.append(Mismatch(path, "values", where,
                                f"{n} of {bad.numel()} elements differ ({share:.0%})",
                                level, hint, _m(member)))
    return out


def _m(member: str | None) -> tuple[str, ...]:
    return () if member is None else (member,)
