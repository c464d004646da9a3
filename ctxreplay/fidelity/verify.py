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
* ``values`` -- the artifact run on retained copies of the member's live
  calls (its first and a sample of the others), its outputs compared with
  the retained live outputs by value.  A call the level meant to compare
  that the budget did not keep is a mismatch, never a silent skip: an
  unkept call may be exactly the one that differs.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import attrs
import torch

from .._base.jsonread import dtype_name, read_bool, read_list, read_mapping
from ..core.probe import ContextProbe
from ..core.snapshots import ContextSnapshot, describe_state
from ..specs.signature import SeqSpec, Spec, TensorSpec, flatten_spec, spec_of, tensor_values
from .compare import SpecMismatch, compare_specs, symbolic_dims

__all__ = ["UNOBSERVED", "UNOBSERVED_HELP", "Fidelity", "Mismatch", "check_outputs",
           "check_signature",
           "compare_values", "flat_tensor_spec", "hint_for", "is_neutral", "merge_mismatches",
           "neutral_replay"]



@attrs.frozen
class Mismatch:
    """A captured output that disagrees with a live one.

    ``level`` is the check that found it (``signature``, ``execute``,
    ``values``, ``saved`` or ``argument``); ``members`` the blocks whose calls show it
    (empty for a capture of a single module); ``hint`` names probes whose
    state the artifact does not carry."""

    path: str
    """Where in the output it is: ``out`` for the whole output, ``out[0]``, ``out['k']`` for a
    leaf."""
    field: str
    """What disagrees: ``dtype``, ``shape``, ``stride``, ``device``, ``requires_grad``,
    ``structure``, ``values``, ``graph`` (no output metadata), ``execution`` (the artifact did not
    run), ``argument`` (the forward changed an argument object in Python, which no graph op does;
    ``path`` names the argument, ``live`` its type and the change), ``hooks`` (user hooks inside
    the member ran in its live calls, never in the capture, and no live output was compared by
    value to show they changed nothing; ``live`` names them) or ``retained`` (calls of the member
    that its level compares by value were not kept within ``retain_bytes``, so they were never
    compared; ``Fidelity.not_retained`` counts them) or ``read_state`` (a place the member's
    code reads beside its arguments and weights -- a dict it holds, a module global, an object's
    field -- held something else on some of its live calls; ``path`` names it)."""
    live: str
    """What the live call had, in words."""
    captured: str
    """What the capture has, in words."""
    level: str
    """The check that found it: ``signature``, ``execute``, ``values``, ``saved``, or ``argument``
    (the comparison of the arguments around the traced and reference runs)."""
    hint: str | None = None
    """Probes whose non-neutral state the artifact does not carry, when one of them may explain it
    (``None``: no such probe)."""
    members: tuple[str, ...] = ()
    """The members whose calls show it (empty for a capture of a single module)."""

    @classmethod
    def of(cls, m: SpecMismatch, level: str, hint: str | None,
           member: str | None = None) -> Mismatch:
        """A mismatch found by ``level`` from a spec comparison's finding."""
        return cls(m.path, m.field, m.live, m.captured, level, hint,
                   () if member is None else (member,))

    def to_json(self) -> dict[str, Any]:
        """Metadata only."""
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
    """The verification level asked for (``capture_with(verify=...)``)."""
    ok: bool
    """True when no check that ran found a mismatch in any member: the artifact alone reproduces
    the live calls.  Also True when no check ran (``verify="off"``): ``status`` then says
    ``"unchecked"``."""
    mismatches: tuple[Mismatch, ...] = ()
    """Every disagreement found, merged across members."""
    checked: tuple[str, ...] = ()
    """The checks that ran (``signature``, ``execute``, ``values``); empty when none did."""
    members: int = 0
    """How many members' calls were checked."""
    ok_with_needs: bool | None = None
    """When ``ok`` is False and the capture has ``ambient_only`` states: the same checks run again
    with those states re-established around the artifact, as the guard of a loaded capture requires
    (``None``: not run)."""
    by_value: int = 0
    """Live calls the artifact was run on and compared with by value (``verify="values"``: every
    retained call, over all members); the other checks compare metadata or fresh inputs."""
    calls: int = 0
    """Live calls the checked members ran, of which ``by_value`` were compared by value (0 where
    not counted: a record built by hand or read from an older file)."""
    not_retained: int = 0
    """Calls the level retains to compare by value (``"sampled"``: those sampled; ``"values"``:
    the first, the last and a sample between) that the ``retain_bytes`` budget did not keep -- not
    copied, or given up to make room for another.  More than 0 at a level that retains is a
    ``retained`` mismatch: those calls were never compared, so the capture is not ok."""

    def verdict(self, calls: int) -> str:
        """What was checked and what came of it, in words, for a capture
        standing for ``calls`` live calls."""
        words = {"ok": "ok", "ok_with_needs": "ok where its needs hold", "failed": "NOT OK",
                 "unchecked": "not checked"}[self.status]
        if not self.checked:
            return words
        lost = f", {self.not_retained} not kept (retain_bytes)" if self.not_retained else ""
        return (f"{words} ({'+'.join(self.checked)}; {self.by_value} of {calls} "
                f"call{'' if calls == 1 else 's'} checked by value{lost})")

    @property
    def status(self) -> str:
        """``"ok"``; ``"ok_with_needs"`` (reproduces the call only where its
        ``ambient_only`` states are re-established); ``"failed"``; or
        ``"unchecked"`` (``verify="off"``, or a file saved unverified)."""
        return _status(self.ok, bool(self.checked), self.ok_with_needs)

    def to_json(self) -> dict[str, Any]:
        """Metadata only (``status`` included)."""
        return {"level": self.level, "ok": self.ok, "checked": list(self.checked),
                "members": self.members, "ok_with_needs": self.ok_with_needs,
                "by_value": self.by_value, "calls": self.calls,
                "not_retained": self.not_retained,
                "status": self.status,
                "mismatches": [m.to_json() for m in self.mismatches]}


#: what ``Fidelity.status`` can say
FIDELITY_STATUSES = ("ok", "ok_with_needs", "failed", "unchecked")


def _status(ok: bool, checked: bool, ok_with_needs: bool | None) -> str:
    if not checked:
        return "unchecked"
    if ok:
        return "ok"
    return "ok_with_needs" if ok_with_needs else "failed"


def combined_status(live: str, saved: str | None) -> str:
    """One status for a capture checked live and (``saved``) as its file:
    failed if either failed, unchecked if the live check did not run."""
    both = (live,) if saved is None else (live, saved)
    if "failed" in both:
        return "failed"
    if live == "unchecked":
        return "unchecked"
    return "ok_with_needs" if "ok_with_needs" in both else "ok"


def fidelity_status(value: object, path: str) -> str:
    """``Fidelity.status`` of a fidelity record in a document, read strictly
    (a record without ``checked`` is taken as checked)."""
    doc = read_mapping(value, path, required={"ok"})
    ok = read_bool(doc["ok"], f"{path}.ok")
    checked = True
    if "checked" in doc:
        checked = bool(read_list(doc["checked"], f"{path}.checked"))
    needs = doc.get("ok_with_needs")
    return _status(ok, checked, None if needs is None else
                   read_bool(needs, f"{path}.ok_with_needs"))


def is_neutral(probe: ContextProbe[Any], state: Any) -> bool:
    """``probe.neutral(state)``; a probe that fails to say is not neutral."""
    try:
        return bool(probe.neutral(state))
    except Exception:  # a user's probe may raise anything: not neutral
        return False


def flat_tensor_spec(spec: Spec) -> SeqSpec:
    """The tensor leaves of an output, in order, as one list spec: backends
    flatten outputs, so live and captured are compared leaf by leaf."""
    return SeqSpec(list, tuple(s for s in flatten_spec(spec) if isinstance(s, TensorSpec)))


#: the hint of a value mismatch that remains with every observed probe state
#: re-established around the artifact: its cause is state no probe observes (a
#: module-level setting, a cache or memo the forward keeps, a framework's own
#: context), never a probe whose state agreed.  ``UNOBSERVED_HELP`` says how to
#: find it.
UNOBSERVED = "state no probe observes"
UNOBSERVED_HELP = ("values differ with every observed probe state re-established: the "
                   "cause is state no probe observes (a module-level setting, a cache or "
                   "memo the forward keeps); report.explain() shows what each probe saw, and "
                   "a ContextProbe for that state (docs: Writing probes) makes it part of "
                   "the key")


def hint_for(snapshot: ContextSnapshot, carried: Iterable[str]) -> str | None:
    """Probes with a non-neutral state that the artifact does not carry."""
    carried = set(carried)
    missing = [(n, p, s) for n, p, s in zip(snapshot.names, snapshot.probes, snapshot.states)
               if n not in carried and not is_neutral(p, s)]
    if not missing:
        return None
    return "not carried by the artifact: " + ", ".join(f"{n}={describe_state(p, s)}"
                                                        for n, p, s in missing)


@contextmanager
def neutral_replay(snapshot: ContextSnapshot,
                   neutral_probes: Iterable[ContextProbe[Any]] = (), *, full: bool = False,
                   only_neutral: bool = False, needs: Iterable[str] = ()) -> Iterator[None]:
    """The state a fresh process has -- every probe of ``snapshot`` and of
    ``neutral_probes`` at its ``neutral_state()`` (a probe that does not know it is
    left as it is) -- plus, from ``snapshot``, what no artifact can carry:
    the part of each probe's replay that must surround the captured callable
    (``split_replay``'s *around*: inference mode, a framework's live
    context, determinism flags), except pinnable states (default dtype and
    device), which a capture writes into its graph, and baked ones, which
    its graph holds as the function the forward chose.  So an artifact run here
    shows whether it carries what it can carry.  ``full=True`` replays the
    whole snapshot instead (the live call's context); ``only_neutral=True``
    nothing of it (the state a capture starts from, whatever the caller of
    ``finalize()`` has active).  ``needs``: probes whose whole state is
    replayed, not only its *around* part -- a capture's ``ambient_only``,
    which a loaded capture's guard requires to hold where it runs.
    Restores exactly on exit."""
    needed = set(needs)
    probes: dict[str, ContextProbe[Any]] = {p.name: p for p in neutral_probes}
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
            for name, probe, state in zip(snapshot.names, snapshot.probes, snapshot.states):
                if name in needed:
                    stack.enter_context(probe.replay(state))
                    continue
                if probe.pinnable or getattr(probe, "baked", False):
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
