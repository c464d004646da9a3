"""Ground truth for the trust tests: what really ran, recorded by
the test's own forward hooks, and each recorded call replayed through the
capture that claims to stand for it, with that member's own weights.

Nothing here asks ctxreplay whether a capture is faithful: a call is
reproduced when the artifact, run on a copy of the call's real inputs with
the member's weights (DESIGN.md fact 20: ``ep.module()`` then
``load_state_dict(..., strict=False, assign=True)``), returns the live
outputs by value.  The only engine contract used is the documented binding:
a ``"flattened"`` capture takes the call's tensor leaves positionally, in
``Capture.signature.leaves()`` order (``ctxreplay.specs.signature.tensor_values``
walks a value in that order); the shapes of those leaves are checked against
the signature before anything runs.

A call is run from the CPU generator's state it began with (a dropout in
training draws the same mask), and with ``arguments=True`` the state it
leaves in the inputs it was given counts too (a cache the live forward
appended to must end the same).  ``false_oks`` turns all of it into the
list of ``ok`` verdicts a report gives that the recorded calls contradict.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

import ctxreplay
from ctxreplay.capture.assigned import write
from ctxreplay.core.registry import resolve_probes
from ctxreplay.specs.signature import tensor_values

BF16_TOL = {"rtol": 1.6e-2, "atol": 1e-2}
_TOL = {torch.bfloat16: BF16_TOL, torch.float16: {"rtol": 1e-3, "atol": 1e-3}}


@dataclasses.dataclass
class Call:
    """One live call of one member: copies of its inputs taken before the
    forward ran (a cache it grows in place is seen as the member received
    it), its outputs, the ambient snapshot and the member's ``training``."""

    member: str
    module: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    out: tuple[torch.Tensor, ...]
    snapshot: ctxreplay.ContextSnapshot
    training: bool
    rng: torch.Tensor | None = None
    """The CPU generator's state when the call began: a random op (dropout
    in training) drew from it, so a faithful program given it draws alike."""
    after: tuple[tuple[Any, ...], dict[str, Any]] | None = None
    """Copies of the same arguments once the forward returned: what it left
    in the objects it was given (a cache it appended to, a tensor it wrote)."""

    def leaves(self) -> tuple[torch.Tensor, ...]:
        """The input tensors in capture order: positional, then keyword arguments."""
        return (*[t for a in self.args for t in tensor_values(a)],
                *[t for v in self.kwargs.values() for t in tensor_values(v)])

    def fresh_inputs(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Another copy (a forward may change its inputs in place)."""
        return _copy_call(self.args, self.kwargs)


def _copy_call(args: tuple[Any, ...], kwargs: dict[str, Any]
               ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    memo: dict[int, Any] = {}
    with torch.inference_mode(False), torch.no_grad():
        for t in tensor_values((args, kwargs)):
            if id(t) not in memo:
                c = t.detach().clone()
                if t.requires_grad:
                    c.requires_grad_(True)
                memo[id(t)] = c
    return copy.deepcopy((args, kwargs), memo)


def _clone_out(out: Any) -> tuple[torch.Tensor, ...]:
    with torch.inference_mode(False), torch.no_grad():
        return tuple(t.detach().clone() for t in tensor_values(out))


@contextmanager
def record(model: nn.Module, members: Iterable[str] | None = None,
           probes: Any = None) -> Iterator[list[Call]]:
    """Record every call of the named submodules (default: every member of
    every ``nn.ModuleList`` / stack the test cares about must be named)."""
    calls: list[Call] = []
    named = dict(model.named_modules())
    names = list(members) if members is not None else []
    pending: dict[int, list[Call]] = {}
    handles = []
    # a probe of per-model state reads this model's, as a session's does
    bound = [p.bind(model) for p in resolve_probes(probes)]
    for name in names:
        mod = named[name]

        def pre(m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                _name: str = name) -> None:
            a, k = _copy_call(args, kwargs)
            call = Call(_name, m, a, k, (), ctxreplay.snapshot(bound), m.training,
                        rng=torch.random.get_rng_state())
            pending.setdefault(id(m), []).append(call)

        def post(m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                 out: Any) -> None:
            call = pending[id(m)].pop()
            call.out = _clone_out(out)
            call.after = _copy_call(args, kwargs)
            calls.append(call)

        handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(mod.register_forward_hook(post, with_kwargs=True))
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()


def members_of(model: nn.Module, stack: str) -> list[str]:
    """Qualified names of the children of the stack ``stack``."""
    mod = dict(model.named_modules())[stack]
    return [f"{stack}.{n}" for n, _ in mod.named_children()]


def _leaf_key(ts: Iterable[Any]) -> list[tuple[tuple[int, ...], torch.dtype]]:
    return [(tuple(t.shape), t.dtype) for t in ts]


def takes(capture: ctxreplay.Capture, leaves: Iterable[Any]) -> bool:
    """Whether ``capture`` says it takes tensors of these shapes and dtypes:
    its signature's, or -- a folded capture -- the same but for its dynamic
    dimensions, each following its expression within the claimed range
    (read here from the capture's own record, evaluated independently)."""
    got = _leaf_key(leaves)
    want = _leaf_key(s for _, s in capture.signature.leaves())
    if got == want:
        return True
    folding = capture.folding
    if folding is None or len(got) != len(want):
        return False
    dynamic = {(d.leaf, d.dim): d.expr for d in folding.dims}
    values: dict[str, int] = {}
    for (leaf, dim), expr in dynamic.items():
        if expr.isidentifier() and leaf < len(got) and dim < len(got[leaf][0]):
            values[expr] = got[leaf][0][dim]
    ranges = {r.name: (r.low, r.high) for r in folding.ranges}
    if set(values) != set(ranges) or not all(lo <= values[n] <= hi
                                             for n, (lo, hi) in ranges.items()):
        return False
    for i, ((gs, gd), (ws, wd)) in enumerate(zip(got, want)):
        if gd != wd or len(gs) != len(ws):
            return False
        for d, (g, w) in enumerate(zip(gs, ws)):
            expr = dynamic.get((i, d))
            if g != (w if expr is None else eval(expr, {}, dict(values))):
                return False
    return True


def candidates(report: ctxreplay.CaptureReport, call: Call) -> list[ctxreplay.Capture]:
    """Captures that claim this call: they list its member, were observed
    under its snapshot and take inputs of its shapes and dtypes."""
    leaves = list(call.leaves())
    return [c for c in report.captures
            if call.member in c.members and c.snapshot == call.snapshot
            and takes(c, leaves)]


def program_for(capture: ctxreplay.Capture, member: nn.Module) -> nn.Module:
    """The capture's artifact as a module holding ``member``'s own weights
    (copies: running it changes nothing of the member)."""
    art = capture.artifact
    # an ExportedProgram (export), or the GraphModule itself (the dynamo and
    # symbolic backends, which hold a copy of the traced module's tensors)
    if isinstance(art, torch.export.ExportedProgram):
        gm = art.module()
    else:
        assert isinstance(art, torch.fx.GraphModule), type(art)
        gm = copy.deepcopy(art)
    own = {k: v.detach().clone() for k, v in
           [*member.named_buffers(remove_duplicate=False),
            *member.named_parameters(remove_duplicate=False)]}
    names = [n for n, _ in gm.named_parameters()]
    # a flattened capture traced a wrapper holding the member as ``inner``
    prefix = "inner." if names and all(n.startswith("inner.") for n in names) else ""
    state = {prefix + k: v for k, v in own.items()}
    # non-persistent buffers (a rotary embedding's inv_freq) are not in a
    # state dict: the program holds them as buffers, set one by one
    loose = {k: state.pop(k) for k in [k for k in state if k not in gm.state_dict()]}
    _, unexpected = gm.load_state_dict(state, strict=False, assign=True)
    assert not unexpected, unexpected
    held = dict(gm.named_buffers())
    for k, v in loose.items():
        assert k in held, f"{k!r}: not a parameter or buffer of the program"
        owner, _, leaf = k.rpartition(".")
        setattr(gm.get_submodule(owner), leaf, v)
    not_mine = [n for n in names if n not in state]
    assert not not_mine, f"parameters not loaded from {capture.weights_from!r}: {not_mine}"
    return gm


@contextmanager
def ambient_of(capture: ctxreplay.Capture) -> Iterator[None]:
    """Only what the capture says must surround the artifact where it runs."""
    snap = capture.snapshot
    keep = set(capture.ambient_only)
    with torch.no_grad(), snap.without(*[n for n in snap.names if n not in keep]).replay():
        yield


def run_call(capture: ctxreplay.Capture, call: Call, *, check_shapes: bool = True,
             ambient: bool = True, programs: dict[Any, nn.Module] | None = None
             ) -> tuple[torch.Tensor, ...]:
    """Run ``call``'s real inputs through ``capture`` with its member's weights
    (``check_shapes=False``: even inputs the capture was not made for), inside
    what ``ambient_only`` says must surround it (``ambient=False``: nothing
    but ``no_grad``, as a self-contained program).  ``programs`` keeps each
    (capture, member) program for the next call (``ep.module()`` is slow)."""
    return _run(capture, call, check_shapes=check_shapes, ambient=ambient,
                programs=programs)[0]


def _run(capture: ctxreplay.Capture, call: Call, *, check_shapes: bool, ambient: bool,
         programs: dict[Any, nn.Module] | None
         ) -> tuple[tuple[torch.Tensor, ...], tuple[tuple[Any, ...], dict[str, Any]]]:
    """The outputs, and the copies of the inputs the program was given (as
    it left them)."""
    key = (id(capture), id(call.module))
    gm = None if programs is None else programs.get(key)
    if gm is None:
        gm = program_for(capture, call.module)
        if programs is not None:
            programs[key] = gm
    args, kwargs = call.fresh_inputs()
    with torch.random.fork_rng(devices=[]), \
            ambient_of(capture) if ambient else torch.no_grad():
        if call.rng is not None:
            torch.random.set_rng_state(call.rng)
        if capture.binding == "native":
            out = gm(*args, **kwargs)
        else:
            leaves = [t for a in args for t in tensor_values(a)] + \
                [t for v in kwargs.values() for t in tensor_values(v)]
            if check_shapes:
                assert takes(capture, leaves)
            out = gm(*leaves)
    values = tuple(tensor_values(out))
    # a program returns what its forward assigns to argument objects last;
    # assigned to the inputs' objects, as an installed call does
    n = 0 if capture.assigned is None else len(capture.assigned.tensors)
    if n:
        assert capture.assigned is not None
        write(args, kwargs, capture.assigned, values[-n:])
        values = values[:-n]
    return values, (args, kwargs)


def differs(live: tuple[torch.Tensor, ...], got: tuple[torch.Tensor, ...]) -> str | None:
    """``None`` when ``got`` equals ``live`` by value (per-dtype tolerance)."""
    if len(live) != len(got):
        return f"{len(live)} live tensors, {len(got)} replayed"
    for i, (a, b) in enumerate(zip(live, got)):
        try:
            torch.testing.assert_close(b, a, **_TOL.get(a.dtype, {}))
        except AssertionError as exc:
            return f"out[{i}]: " + str(exc).splitlines()[0]
    return None


def replay_failure(capture: ctxreplay.Capture, call: Call, *, check_shapes: bool = True,
                   ambient: bool = True, programs: dict[Any, nn.Module] | None = None,
                   arguments: bool = False) -> str | None:
    """``None`` when ``capture`` reproduces ``call``; else what went wrong.
    ``arguments``: the call's effects on its arguments count too -- the
    inputs the program was given must end as the live call left its own
    (a cache appended to, a tensor written in place)."""
    try:
        got, given = _run(capture, call, check_shapes=check_shapes, ambient=ambient,
                          programs=programs)
    except Exception as exc:
        return f"raised {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    why = differs(call.out, got)
    if why is None and arguments and call.after is not None:
        live = tuple(tensor_values(call.after))
        why = differs(live, tuple(tensor_values(given)))
        if why is not None:
            why = f"its arguments after the call: {why}"
    return why


def unreproduced(report: ctxreplay.CaptureReport, calls: list[Call],
                 pick: Callable[[Call, list[ctxreplay.Capture]], list[ctxreplay.Capture]]
                 | None = None, *, ambient: bool = True) -> list[str]:
    """Every call no capture reproduces: none claims it, several do, or the
    one that does returns other values.  Empty means every call is covered."""
    bad = []
    programs: dict[Any, nn.Module] = {}
    for i, call in enumerate(calls):
        found = candidates(report, call)
        if pick is not None:
            found = pick(call, found)
        where = f"call {i} of {call.member}"
        if len(found) != 1:
            bad.append(f"{where}: {len(found)} captures claim it "
                       f"{[(c.scope, c.variant) for c in found]}")
            continue
        why = replay_failure(found[0], call, ambient=ambient, programs=programs)
        if why is not None:
            bad.append(f"{where} via {found[0].scope}#{found[0].variant}: {why}")
    return bad


def _claims(capture: ctxreplay.Capture) -> list[tuple[str, int]]:
    """``(member, calls)`` the capture says it stands for."""
    if capture.member_calls:
        return list(capture.member_calls)
    assert len(capture.members) == 1, (capture.scope, capture.members)
    return [(capture.members[0], capture.calls)]


def false_oks(report: ctxreplay.CaptureReport, calls: list[Call], *,
              ambient: bool = True) -> list[str]:
    """Every ``ok`` the recorded calls contradict.  Empty means none.

    * a capture whose fidelity is ok and that claims ``n`` calls of a member
      must reproduce -- outputs by value and the state it leaves in its
      arguments -- at least ``n`` of the recorded calls of that member it
      can claim (same snapshot, same input shapes and dtypes);
    * a report that is ok must have, for every recorded call, a capture
      whose fidelity is ok that reproduces it, and must account for every
      recorded call of each member.

    ``ambient=False``: each capture runs as a self-contained program, with
    nothing of its ``ambient_only`` states re-established.
    """
    programs: dict[Any, nn.Module] = {}
    seen: dict[tuple[int, int], str | None] = {}
    claimable = [candidates(report, call) for call in calls]

    def failure(capture: ctxreplay.Capture, i: int) -> str | None:
        if (id(capture), i) not in seen:
            seen[id(capture), i] = replay_failure(capture, calls[i], programs=programs,
                                                  ambient=ambient, arguments=True)
        return seen[id(capture), i]

    found = []
    for c in (c for c in report.captures if c.fidelity.ok):
        for member, n in _claims(c):
            mine = [i for i, call in enumerate(calls)
                    if call.member == member and any(x is c for x in claimable[i])]
            why = {i: failure(c, i) for i in mine}
            good = sum(w is None for w in why.values())
            if good < n:
                first = next((f"call {i}: {w}" for i, w in why.items() if w), "none recorded")
                found.append(f"{c.scope}#{c.variant} fidelity ok over {n} call(s) of {member!r}"
                             f" reproduces {good} of the {len(mine)} it can claim ({first})")
    if report.ok:
        for i, call in enumerate(calls):
            ok = [c for c in claimable[i] if c.fidelity.ok]
            if not any(failure(c, i) is None for c in ok):
                found.append(f"report ok but call {i} of {call.member!r} is reproduced by none "
                             f"of the {len(ok)} ok capture(s) that can claim it")
        recorded: dict[str, int] = {}
        for call in calls:
            recorded[call.member] = recorded.get(call.member, 0) + 1
        claimed: dict[str, int] = {}
        for c in report.captures:
            for member, n in _claims(c):
                claimed[member] = claimed.get(member, 0) + n
        if claimed != recorded:
            found.append(f"report ok but captures claim {claimed} calls, recorded {recorded}")
    return found
