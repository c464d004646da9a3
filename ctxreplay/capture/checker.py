"""Running one artifact against every member call it stands for.

``Checker.run(modules)`` is ``verify="signature" | "execute" | "sampled" |
"values"`` for one capture: per member that ran the variant, the graph's output
metadata against that member's live outputs; the artifact run with the
member's own weights (an isolated view of it: parameters shared, buffers
and Python state its own) from a neutral state, against the live output
metadata and against the member itself on the same inputs under the live
context; and, for ``sampled`` and ``values``, against retained copies of the
member's live calls across the session (its first and a sample of the
others), one by one.  What it compares is in ``verify``; what it runs is here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import attrs
import torch
from torch import nn

from ..backends import Backend, exception_message
from ..core.probe import ContextProbe
from ..fidelity.levels import checked_by, level, level_names
from ..fidelity.verify import (
    UNOBSERVED,
    Fidelity,
    Mismatch,
    check_outputs,
    check_signature,
    compare_values,
    flat_tensor_spec,
    hint_for,
    merge_mismatches,
    neutral_replay,
)
from ..specs.materialize import bind_call, inputs_for, materialize_leaves
from ..specs.signature import Spec, TensorSpec, tensor_values
from .assigned import Assigned, read, split
from .hookfree import user_hooks
from .isolate import isolated
from .mutation import ARGUMENT_FIELD, MutationLog
from .options import CaptureOptions, MemberCall, VariantRequest
from .restore import restore_state
from .rngguard import BookkeepingError, rng_guard

__all__ = ["GUARD_FAILED", "RETAINED_FIELD", "UNOBSERVED_HINT", "Checker", "Program", "Step"]

_log = logging.getLogger("ctxreplay")

#: the field of the mismatch of a member some of whose calls to compare by
#: value were not kept (``retain_bytes``)
RETAINED_FIELD = "retained"

#: what an execution mismatch says when a graph's own input guard refused
#: the sizes it was given (``Mismatch.captured``)
GUARD_FAILED = "Guard failed"

#: the hint of a value mismatch that remains with every observed state
#: re-established: no probe saw its cause
UNOBSERVED_HINT = UNOBSERVED


@attrs.frozen(eq=False)
class Program:
    """The artifact a ``Checker`` runs, and how it is called.

    ``graph_outputs``: the output specs its graph gives (``None``: not known,
    as for a graph run at sizes other than its trace's).  ``binding`` and
    ``flatten_out``: how it takes its inputs and gives its outputs (see
    ``capture.trace``).  ``carried``: probes the artifact carries itself (for
    hints); ``ambient_only``: the non-neutral states it needs around it.
    ``assigned``: what the forward assigns to its argument objects -- the
    program returns those tensors after its outputs.  ``artifact`` is
    ``None`` for a program checked only by its output metadata."""

    backend: Backend
    artifact: Any
    graph_outputs: Spec | None
    binding: str
    flatten_out: bool
    carried: tuple[str, ...] = ()
    ambient_only: tuple[str, ...] = ()
    assigned: Assigned | None = None


class Checker:
    """Checks one artifact against every member call it stands for.

    ``traced`` is the (isolated) module the artifact was traced from: its
    tensors identify which of the artifact's tensors are weights, so the
    artifact can run with another member's.  ``neutral_probes``: probes
    whose neutral state every run starts from, beside the snapshot's own."""

    def __init__(self, request: VariantRequest, options: CaptureOptions, program: Program,
                 traced: nn.Module, neutral_probes: tuple[ContextProbe[Any], ...] = ()) -> None:
        self.request, self.options = request, options
        self.backend, self.artifact, self.traced = program.backend, program.artifact, traced
        self.graph_outputs, self.carried = program.graph_outputs, program.carried
        self.neutral_probes = neutral_probes
        self.binding, self.flatten_out = program.binding, program.flatten_out
        self.applied = () if options.replay == "off" else request.snapshot.names
        self.hint = hint_for(request.snapshot, program.carried)
        self.ambient_only = program.ambient_only
        #: what the forward assigns to its argument objects: the program
        #: returns the tensors after its outputs
        self.assigned = program.assigned
        #: the values the member's last reference run left at those paths
        self._left: list[Any] = []
        self.needs: tuple[str, ...] = ()  # what _call re-establishes beyond the neutral state
        self.by_value = 0  # live calls run and compared by value in this pass
        #: what the reference runs changed in their arguments, and what the
        #: members' repeat live calls wrote in the state their forward keeps
        self.watch = MutationLog()
        for m in request.members:
            for change in m.writes:
                self.watch.wrote(change)
        #: the live parameters the last run wrote in place (storage -> name), put back
        self.wrote: dict[int, str] = {}
        self._fresh: tuple[Any, dict[str, str] | None] | None = None

    def run(self, modules: Mapping[str, nn.Module]) -> Fidelity:
        name = self.options.verify
        if name == "off":
            return Fidelity(name, True, (), ())
        members = [m for m in self.request.members if m.completed]
        self.by_value = 0
        found = self._check(name, members, modules)
        by_value = self.by_value
        merged = merge_mismatches(found)
        with_needs = None
        if merged and level(name).executes and self.ambient_only:
            # would it reproduce where its ambient_only states hold (as the
            # guard of a loaded capture requires)?  ok stays False: the
            # artifact alone does not reproduce the call
            self.needs = self.ambient_only
            try:
                with_needs = not self._check(name, members, modules)
            finally:
                self.needs = ()
        return Fidelity(name, not merged, merged, checked_by(name), len(members), with_needs,
                        by_value, *_counts(members, name))

    def run_steps(self, modules: Mapping[str, nn.Module], steps: tuple[str, ...]) -> Fidelity:
        """Only ``steps`` (e.g. ``("execute",)``), for every member that ran
        the variant: a graph traced at other sizes (a fold) has no output
        metadata of this variant's sizes to compare, so it is run instead --
        as the capture says it must run: where its ``ambient_only`` states
        are re-established (none for an embedded replay)."""
        members = [m for m in self.request.members if m.completed]
        self.by_value = 0
        self.needs = self.ambient_only
        try:
            found = self._steps(modules, members, steps)
        finally:
            self.needs = ()
        merged = merge_mismatches(found)
        return Fidelity(steps[-1], not merged, merged, steps, len(members), None,
                        self.by_value, *_counts(members, steps[-1]))

    def _steps(self, modules: Mapping[str, nn.Module], members: list[MemberCall],
               steps: tuple[str, ...]) -> list[Mismatch]:
        found: list[Mismatch] = []
        single = len(self.request.members) == 1
        for m in members:
            shown = None if single else m.name
            module = modules.get(m.name)
            if module is None:
                found.append(_mismatch("execution", "member", "released", steps[0], None,
                                       shown))
                continue
            for step in steps:
                found += _STEPS[step](self, m, module, shown)
        return found

    def share_program(self, other: Checker) -> None:
        """Run the program ``other`` unlifted (made on its first run) instead
        of unlifting it again: a fold checks one artifact at every observed
        size, one checker per size, and ``ExportedProgram.module()``
        recompiles every graph of the program each time it is called.  Each
        run still rebinds it to the member's own tensors by name."""
        if other.artifact is not self.artifact or other.traced is not self.traced:
            raise ValueError("share_program: another artifact or traced module")
        self._fresh = other._fresh

    def _check(self, name: str, members: list[MemberCall],
               modules: Mapping[str, nn.Module]) -> list[Mismatch]:
        """Every check step up to level ``name``, member by member; a member
        released before its module could run stops at the first step that
        runs the artifact."""
        found: list[Mismatch] = []
        single = len(self.request.members) == 1
        # ``sampled`` and ``values`` share one step: they differ in which
        # calls observation retained, not in how they are compared
        steps = list({_STEPS[step]: step for step in reversed(checked_by(name))}.values())
        steps.reverse()
        for m in members:
            shown = None if single else m.name
            module = modules.get(m.name)
            first, compared = len(found), self.by_value
            for step in steps:
                if level(step).executes and module is None:
                    found.append(_mismatch("execution", "member", "released", step, None,
                                           shown))
                    break
                found += _STEPS[step](self, m, module, shown)
            if module is not None:
                found[first:] = _hooked(found[first:], user_hooks(module),
                                        self.by_value > compared, name, shown)
        return found

    def _signature(self, m: MemberCall, module: nn.Module | None,
                   name: str | None) -> list[Mismatch]:
        return check_signature(m.outputs, self.graph_outputs, self.request.snapshot,
                               self.applied, name)

    def _program(self, view: nn.Module, member: MemberCall) -> Callable[..., Any] | None:
        """The artifact as a module running with ``view``'s tensors; for a
        backend that only runs artifacts its own way, ``backend.run`` for the
        member whose weights the artifact holds (``None`` for the others)."""
        if self._fresh is None:
            # made once per check (unlifting a program recompiles its
            # graphs), rebound to each member's tensors by name
            fresh = self.backend.module(self.artifact)
            self._fresh = (fresh, None if fresh is None else _names_of(fresh, self.traced))
        fresh, names = self._fresh
        if fresh is None or names is None:
            if member is not self.request.traced:
                return None
            backend, artifact = self.backend, self.artifact
            return lambda *args, **kwargs: backend.run(artifact, args, kwargs)
        mine = dict(_tensors(view))
        _assign(fresh, {n: mine[src] for n, src in names.items() if src in mine})
        return fresh

    def _execute(self, m: MemberCall, module: nn.Module | None,
                 name: str | None) -> list[Mismatch]:
        assert module is not None  # _check stops at a released member
        if any(s.device == "meta" for _, s in self.request.inputs.leaves()):
            # a call on ``meta`` tensors computed shapes only: there are no values
            # to compare (``verify="signature"`` checks its graph's outputs)
            return [_mismatch("execution", "inputs device=meta", "not run: values=none",
                              "execute", None, name)]
        leaves = materialize_leaves(self.request.inputs)
        with self._isolated(module) as view:
            program = self._program(view, m)
            if program is None:
                return [_mismatch("execution", "member weights",
                                  f"not possible: backend {self.backend.name!r}", "execute",
                                  None, name)]
            ran = _clone(leaves)  # the inputs the artifact updates in place, if it does
            try:
                produced, made = split(self._call(program, ran), self.assigned,
                                       self.flatten_out)
                by_program = self.wrote
            except AssertionError as exc:
                if not str(exc).startswith("Guard failed"):
                    raise
                # a graph traced with dynamic sizes checks them before it
                # runs (torch.export's input guards): it refused these
                return [_mismatch("execution", "ran", GUARD_FAILED, "execute", None, name)]
            except BookkeepingError:
                raise  # ctxreplay's own watch failed: verify_failed, not the program's fault
            except Exception as exc:  # the program may raise anything: a mismatch (logged)
                _log.debug("checking %s: a run raised", self.request.scope, exc_info=True)
                # e.g. a bfloat16 input meeting float32 weights once autocast
                # is gone: the probes the artifact did not carry are the
                # likely cause
                return [_mismatch("execution", "ran", exception_message(exc)[0], "execute",
                                  self.hint, name)]
        if m.outputs is not None:
            found = check_outputs(self._flat_live(m.outputs), produced, self.request.snapshot,
                                  self.carried, "execute", captured=self.graph_outputs,
                                  member=name)
            if found:
                return found
        updated = _clone(leaves)
        with self._isolated(module) as ref:
            try:  # the member itself, on the same inputs, under the live context
                reference = self._eager(ref, updated)
            except BookkeepingError:
                raise  # ctxreplay's own watch failed: verify_failed, not the program's fault
            except Exception as exc:  # the user's module may raise anything: a mismatch (logged)
                _log.debug("checking %s: a run raised", self.request.scope, exc_info=True)
                return [_mismatch("execution", "reference run", exception_message(exc)[0],
                                  "execute", None, name)]
        if _fake(reference):
            # values a trace left in Python state that the copy still shares
            # with the model: comparing them would guard on symbols
            return [_mismatch("execution", "reference run",
                              "FakeTensor left by trace", "execute", None, name)]
        return compare_values(reference, produced, "execute", hint=self.hint, member=name) + \
            self._updates(updated, ran, name) + self._assignments(made, name) + \
            _weight_writes(self.wrote, by_program, name)

    def _assignments(self, made: tuple[Any, ...], name: str | None) -> list[Mismatch]:
        """The tensors the program returns for the forward's assignments
        against those the member's reference run assigned (and the
        constants it set), path by path."""
        if self.assigned is None:
            return []
        found: list[Mismatch] = []
        left = iter(self._left)
        for path, value in self.assigned.constants:
            got = next(left, None)
            if got != value:
                found.append(_mismatch(ARGUMENT_FIELD, f"{''.join(path)} = {got!r}",
                                       f"{value!r}", "execute", None, name))
        for path, tensor in zip(self.assigned.tensors, made):
            live = next(left, None)
            if not isinstance(live, torch.Tensor):
                found.append(_mismatch(ARGUMENT_FIELD, f"{''.join(path)}: "
                                       f"{type(live).__name__}", "Tensor", "execute", None,
                                       name))
                continue
            found += [attrs.evolve(m, path="".join(path))
                      for m in compare_values((live,), (tensor,), "execute", hint=self.hint,
                                              member=name)]
        return found

    def watch_arguments(self, modules: Mapping[str, nn.Module]) -> list[Mismatch]:
        """One run of the traced member's forward on fresh inputs, its
        arguments watched (``self.watch``): for a variant no run of whose
        forward was watched (Dynamo traced it, and the level runs nothing
        else), a change the forward makes to an argument object would go
        unseen.  A forward that cannot run is a mismatch: its arguments
        were not watched."""
        module = modules.get(self.request.traced.name)
        if module is None:
            return [_mismatch("execution", "member", "released", ARGUMENT_FIELD, None, None)]
        leaves = materialize_leaves(self.request.inputs)
        with self._isolated(module) as view:
            try:
                self._eager(view, _clone(leaves))
            except BookkeepingError:
                raise  # ctxreplay's own watch failed: verify_failed, not the program's fault
            except Exception as exc:  # the user's module may raise anything: a mismatch (logged)
                _log.debug("checking %s: a run raised", self.request.scope, exc_info=True)
                return [_mismatch("execution", "the run watching its arguments",
                                  exception_message(exc)[0], ARGUMENT_FIELD, None, None)]
        return []

    def _updates(self, want: tuple[torch.Tensor, ...], got: tuple[torch.Tensor, ...],
                 name: str | None) -> list[Mismatch]:
        """The input tensors after the reference run against those after the
        artifact's run: an in-place update of an input (a static KV cache's
        ``index_copy_``) is part of what the program must reproduce -- it
        writes it into the live tensors when installed."""
        found: list[Mismatch] = []
        for (path, _), a, b in zip(self.request.inputs.leaves(), want, got):
            found += [attrs.evolve(m, path=path)
                      for m in compare_values((a,), (b,), "execute", hint=self.hint,
                                              member=name)]
        return found

    def _values(self, m: MemberCall, module: nn.Module | None,
                name: str | None) -> list[Mismatch]:
        """Every retained call of the member (its first and a sample of the
        others), each run through the artifact with the member's weights
        from a fresh isolated view, compared with what the live call returned.
        A member some of whose calls to compare were not retained is a
        ``retained`` mismatch: its capture was not compared with them by
        value, and says so (what was retained is still compared)."""
        assert module is not None  # _check stops at a released member
        found = self._unkept(m, name)
        if not m.retained:
            return found
        specs = [s for _, s in self.request.inputs.leaves()]
        at = self._value_level()
        for call in m.retained:
            leaves = tuple(_placed(t, s) for t, s in zip(call.inputs, specs))
            with self._isolated(module) as view:
                program = self._program(view, m)
                if program is None:
                    return []  # reported by the execute check
                try:
                    produced, _ = split(self._call(program, _clone(leaves)), self.assigned,
                                        self.flatten_out)
                except BookkeepingError:
                    raise  # ctxreplay's own watch failed: verify_failed, not the program's fault
                except AssertionError as exc:
                    if not str(exc).startswith("Guard failed"):
                        raise
                    # the graph's own input guard refused the sizes (as in
                    # ``_execute``): a fold leaves the call to another graph
                    found.append(_mismatch("execution", "ran", GUARD_FAILED, at, None, name))
                    continue
                except Exception as exc:  # the program may raise anything: a mismatch (logged)
                    _log.debug("checking %s: a run raised", self.request.scope, exc_info=True)
                    found.append(_mismatch("execution", "ran", exception_message(exc)[0],
                                           at, self.hint, name))
                    continue
                self.by_value += 1
                differ = compare_values(call.outputs, produced, at, hint=self.hint,
                                        member=name)
                if differ:
                    hint = self._value_hint(program, leaves, call.outputs)
                    differ = [attrs.evolve(d, hint=hint) for d in differ]
            found += differ
        return found

    def _unkept(self, m: MemberCall, name: str | None) -> list[Mismatch]:
        """A ``retained`` mismatch where calls of ``m`` the level compares by
        value were not kept (the budget reached, or inputs that could not be
        copied): an unkept call may be the very one the capture does not
        reproduce.  Counts stay on the ``Fidelity``, so members merge."""
        if m.retained and not m.not_retained:
            return []
        budget = f"retain_bytes={self.options.retain_bytes}"
        if m.retained:
            return [_mismatch(RETAINED_FIELD, "not all kept", budget, self._value_level(),
                              None, name)]
        return [_mismatch(RETAINED_FIELD, "none kept", f"compared_by_value=0, {budget}",
                          self._value_level(), None, name)]

    def _value_level(self) -> str:
        """The level a value mismatch is reported at: the session's, when it
        retains calls (a fold's per-size run names ``values``)."""
        verify = self.options.verify
        return verify if level(verify).retains else "values"

    def _value_hint(self, program: Callable[..., Any], leaves: tuple[torch.Tensor, ...],
                    live: tuple[torch.Tensor, ...]) -> str:
        """Why a retained call's values differ: the artifact is run once more
        with every observed state re-established (the live call's whole
        context).  Still different, the cause is state no probe observed --
        naming a probe then would blame one whose state was equal; equal
        then, the cause is what the artifact does not carry itself."""
        try:
            args, kwargs = inputs_for(self.request.inputs, self.binding, leaves=_clone(leaves))
            with rng_guard(weights=program), \
                    neutral_replay(self.request.snapshot, self.neutral_probes, full=True):
                again, _ = split(program(*args, **kwargs), self.assigned, self.flatten_out)
            replayed_differs = bool(compare_values(live, again, "values"))
        except Exception:  # cannot run that way: say what is known
            replayed_differs = True
        if replayed_differs or self.hint is None:
            return UNOBSERVED_HINT
        return self.hint

    def _left_at(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        """The constants, then the tensors, a run left at the assigned paths."""
        if self.assigned is None:
            return []
        paths = [p for p, _ in self.assigned.constants] + list(self.assigned.tensors)
        out: list[Any] = []
        for path in paths:
            try:
                out.append(read(args, kwargs, path))
            except Exception:  # the run left no such path: compared as missing
                out.append(None)
        return out

    @contextmanager
    def _isolated(self, module: nn.Module) -> Iterator[nn.Module]:
        """An isolated view of ``module`` in the state the variant ran in:
        its ``training`` flags and the attributes it held then."""
        with isolated(module, self.request.training) as view:
            restore_state(view, self.request.state)
            yield view

    def _flat_live(self, live: Spec) -> Spec:
        if self.binding == "flattened" and self.flatten_out:
            return flat_tensor_spec(live)
        return live

    def _call(self, program: Callable[..., Any], leaves: tuple[torch.Tensor, ...]) -> Any:
        """``program`` on ``leaves`` (the caller's copies: it may update them);
        the live parameters it wrote in place are put back (``self.wrote``)."""
        args, kwargs = inputs_for(self.request.inputs, self.binding, leaves=leaves)
        with rng_guard(weights=program) as self.wrote, \
                neutral_replay(self.request.snapshot, self.neutral_probes, needs=self.needs):
            return program(*args, **kwargs)

    def _eager(self, view: nn.Module, leaves: tuple[torch.Tensor, ...]) -> Any:
        """The member's forward on ``leaves`` (the caller's copies); the live
        parameters it wrote in place are put back (``self.wrote``)."""
        args, kwargs = bind_call(self.request.inputs, _taker(leaves))
        with rng_guard(weights=view) as self.wrote, \
                neutral_replay(self.request.snapshot, self.neutral_probes, full=True):
            # ``forward`` alone, as observation saw the live call: the hooks
            # ``nn.Module.__call__`` runs at the member's own level ran
            # around it (``isolate.forward_alone``), those of its
            # submodules inside it
            out = self.watch.call(view.forward, args, kwargs)
        self._left = self._left_at(args, kwargs)
        return tuple(tensor_values(out)) if self.flatten_out else out


#: a check step: ``(checker, member call, the member's module or None, the
#: member's name in mismatches or None) -> mismatches``
Step = Callable[[Checker, MemberCall, "nn.Module | None", "str | None"], list[Mismatch]]

_STEPS: dict[str, Step] = {"signature": Checker._signature, "execute": Checker._execute,
                           "sampled": Checker._values, "values": Checker._values}


def _mismatch(field: str, live: str, captured: str, level: str, hint: str | None,
              member: str | None) -> Mismatch:
    return Mismatch("out", field, live, captured, level, hint,
                    () if member is None else (member,))


def _hooked(found: list[Mismatch], hooks: list[str], compared: bool, at: str,
            member: str | None) -> list[Mismatch]:
    """``found`` for a member whose live calls ran ``hooks`` (user hooks
    inside it: its submodules', torch's global ones), which its capture and
    checks never run: the artifact does not carry them.  What was found
    against its live calls (output metadata, live values) names them in its
    hint; and where none of its live outputs was compared by value, nothing
    shows that they changed nothing (a hook that returns a value or writes a
    tensor in place changes what the call computed): a ``hooks`` mismatch
    says so."""
    if not hooks:
        return found
    # two named, each cut short: a report's strings stay short metadata
    named = ", ".join(f"hook={h[-60:]}" for h in hooks[:2]) + \
        (f", hooks={len(hooks)}" if len(hooks) > 2 else "")
    out = [attrs.evolve(f, hint=f"{f.hint}, {named}" if (f.hint or "").startswith(_CARRIED)
                        else _CARRIED + named) if _against_live(f) else f for f in found]
    if not compared:
        out.append(_mismatch("hooks", ", ".join(h[-60:] for h in hooks[:2]) + (
            f" +{len(hooks) - 2}" if len(hooks) > 2 else ""),
            "not run, compared_by_value=0", at, _CARRIED + named, member))
    return out


#: how a hint begins (``fidelity.verify.hint_for``): what the artifact lacks follows
_CARRIED = "not carried by the artifact: "


def _against_live(m: Mismatch) -> bool:
    """Whether ``m`` compares the capture with a live call (its output
    metadata, or its retained values), not with a run of the member made
    here without its hooks."""
    if m.field in ("execution", ARGUMENT_FIELD, RETAINED_FIELD) or m.level not in level_names():
        return False
    return m.level == "signature" or level(m.level).retains or m.field != "values"


def _counts(members: list[MemberCall], name: str) -> tuple[int, int]:
    """``(calls, not_retained)`` of ``members`` for a ``Fidelity`` at level
    ``name`` (calls not retained count only where the level retains)."""
    lost = sum(m.not_retained for m in members) if level(name).retains else 0
    return sum(m.calls for m in members), lost


def _weight_writes(by_forward: Mapping[int, str], by_program: Mapping[int, str],
                   member: str | None) -> list[Mismatch]:
    """The parameters the member's forward updated in place and its program
    did not, or the other way round (``torch.export`` leaves an in-place
    update of a parameter out of the graph): a live call and a dispatched
    one would leave different weights behind."""
    return [Mismatch(f"parameter {by_forward.get(ptr) or by_program[ptr]}", "execution",
                     "written in place" if ptr in by_forward else "not written",
                     "not written" if ptr in by_forward else "written in place",
                     "execute", None, () if member is None else (member,))
            for ptr in sorted(by_forward.keys() ^ by_program.keys())]


def _fake(value: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return any(isinstance(t, FakeTensor) for t in tensor_values(value))


def _placed(t: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    out = t.to(spec.device)
    if spec.requires_grad and (out.dtype.is_floating_point or out.dtype.is_complex):
        out = out.detach().requires_grad_(True)
    return out


def _clone(leaves: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    with torch.no_grad():
        return tuple(t.detach().clone().requires_grad_(t.requires_grad) for t in leaves)


def _taker(leaves: tuple[torch.Tensor, ...]) -> Callable[[TensorSpec], torch.Tensor]:
    it = iter(leaves)
    return lambda _s: next(it)


def _tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    out: list[tuple[str, torch.Tensor]] = list(module.named_parameters(remove_duplicate=False))
    out += module.named_buffers(remove_duplicate=False)
    return out


def _assign(module: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Each named parameter or buffer of ``module`` set to the given tensor, the
    object itself: ``load_state_dict(assign=True)`` makes a parameter anew
    with the module's ``requires_grad``, which torch refuses for an inference
    tensor outside inference mode (weights a ``.to()`` under inference mode
    made, as a diffusers pipeline's model offload does)."""
    for name, t in tensors.items():
        owner_name, _, leaf = name.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        if leaf in owner._parameters:
            owner._parameters[leaf] = t if isinstance(t, nn.Parameter) else \
                nn.Parameter(t, requires_grad=t.requires_grad)
        elif leaf in owner._buffers:
            owner._buffers[leaf] = t


def _names_of(fresh: nn.Module, traced: nn.Module) -> dict[str, str]:
    """For each of ``fresh``'s parameters and buffers, the name of the traced
    module's tensor it was made from (matched by identity): what points it
    at another member's tensors of the same names."""
    names: dict[int, str] = {}
    for n, t in _tensors(traced):
        names.setdefault(id(t), n)
    return {n: names[id(t)] for n, t in _tensors(fresh) if id(t) in names}
