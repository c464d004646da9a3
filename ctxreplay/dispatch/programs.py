"""The captures as ``install`` uses them, and the program each member runs.

An ``Entry`` is one capture with what dispatch decides once: its context key
(the snapshot less the probes ignored), and why it cannot be used here at
all (``unusable``: a reason code of ``dispatch.MISS_REASONS``).
``Programs`` makes, once per capture and member, the program bound to that
member's own weights, assigned (``program.module()`` shares the program's
tensors: loading into them would write into every member's module) -- when
the member is what it was
when it ran the variant (its identity) and its weights fit -- and compiles
it on first use; a ``Target`` runs it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.utils._pytree as pytree
from torch import nn

from ..artifacts.formats import get_format
from ..artifacts.saving import collector_paused
from ..capture.assigned import Assigned, split, write
from ..capture.mutation import ARGUMENT_FIELD
from ..capture.offload import Held, weight_hooks
from ..capture.results import Capture
from ..capture.sharded import gathered_forms
from ..core.snapshots import ContextSnapshot, UnknownProbe, UnknownState, Unresolved
from ..loading.compiled import CompiledProgram
from ..loading.load import LoadedCapture, LoadedManifest
from ..loading.needs import Needs, needs_of, static_differences
from ..loading.weights import WeightsError, bind_weights
from ..observation.targets import identity_digest, identity_of
from ..report.capture_report import CaptureReport
from ..specs.baked import Baked
from ..specs.dims import Folding
from ..specs.frozen import is_object
from ..specs.materialize import build
from ..specs.signature import (
    CallSpec,
    ConstSpec,
    DataclassSpec,
    ObjectSpec,
    PytreeSpec,
    Spec,
    call_tensors,
    children,
    is_native,
)
from ..specs.specjson import call_to_json, holds_objects
from ..specs.storage import member_tensors, unwrapped_name
from .aot import compiled_flat
from .baked import BakedGuard
from .bound import Bound
from .flat import Flat, flatten

_log = logging.getLogger("ctxreplay")

__all__ = ["REFUSED", "STALE", "UNFIT", "Call", "Entry", "Programs", "Target", "entry", "sources"]

#: what ``Target.run`` returns when a folded graph's own guard refuses the
#: call's sizes (the call then runs eagerly)
REFUSED: Any = object()
#: what ``Target.run`` returns when the member's tensors no longer fit the
#: program: a shape, dtype or device changed in place since it was bound
#: (``module.to(torch.float64)`` keeps the parameter objects); the call runs eagerly
UNFIT: Any = object()

#: what ``Target.run`` returns where a place its program read state from
#: holds something else now (``BakedGuard``): the call runs eagerly
STALE: Any = object()

Compiler = Callable[[nn.Module], Callable[..., Any]]


@attrs.define(eq=False)
class Entry:
    """One capture, as dispatch uses it."""

    label: str
    members: tuple[str, ...]
    binding: str
    program: Any
    signature: CallSpec | None
    outputs: Spec | None
    flatten_out: bool
    match: ContextSnapshot
    unusable: str | None
    #: member -> identity digest when it ran, and the attributes left out
    identities: dict[str, str] = attrs.field(factory=dict)
    ignore_attributes: tuple[str, ...] = ()
    hits: int = 0
    #: a folded capture's dynamic sizes (``None``: the signature's sizes only)
    folding: Folding | None = None
    #: a loaded capture's signature as its document writes it, where the
    #: document does not rebuild it (an object argument, a string constant)
    #: but keys every part of it (``LoadedCapture.call_document``)
    document: Any = None
    #: what the forward assigns to its argument objects: the program
    #: returns the tensors after its outputs, and a call writes them back
    assigned: Assigned | None = None
    #: its ahead-of-time compiled program (a loaded capture ``ctxreplay compile``
    #: compiled), the directory holding its package, and why it is not used
    #: (``(reason code, words)``: the uncompiled program runs instead)
    compiled: CompiledProgram | None = None
    directory: Path | None = None
    uncompiled: tuple[str, str] | None = None
    #: the state its trace read beside its arguments and weights (``None``: not known)
    baked: Baked | None = None

    @property
    def comparable(self) -> bool:
        """Whether a live call can be compared with the captured one."""
        return self.signature is not None or self.document is not None

    def matches(self, call: Call) -> bool:
        """Whether ``call`` is the captured call (its input signature)."""
        if self.signature is not None:
            if self.signature == call.spec:
                return True
            # folded: the same but for sizes within the ranges it was verified over
            return self.folding is not None and self.folding.accepts(self.signature,
                                                                     call.spec)
        return self.document is not None and self.document == call.document()


class Call:
    """A live call's signature, and its document (``call_to_json``) made at
    most once: a loaded capture the document does not rebuild is compared in
    that form -- classes by import path, constants by key digest -- which a
    fresh process computes alike."""

    __slots__ = ("_document", "spec")

    def __init__(self, spec: CallSpec) -> None:
        self.spec = spec
        self._document: dict[str, Any] | None = None

    def document(self) -> dict[str, Any]:
        if self._document is None:
            self._document = call_to_json(self.spec)
        return self._document


def _has_objects(spec: Spec) -> bool:
    if isinstance(spec, (DataclassSpec, ObjectSpec, PytreeSpec)):
        return True
    if isinstance(spec, ConstSpec):
        # a plain object kept as a constant (a cache that holds no tensor
        # yet) is an object all the same: the forward may fill it
        return is_object(spec.value)
    return any(_has_objects(c) for _, c in children(spec) or ())


def entry(source: Capture | LoadedCapture, ignore: tuple[str, ...],
          object_args: str, model: nn.Module | None = None) -> Entry:
    """``source`` as dispatch uses it; ``model``: where a capture another
    rank made is rebuilt with its members' weights (``shared``)."""
    needs: Needs
    document = None
    elsewhere: str | None = None
    if isinstance(source, LoadedCapture):
        needs = source.needs
        # a capture that runs its compiled program needs its uncompiled one only
        # for calls autograd records: read it then (torch's deserialiser alone
        # takes ~1.5 s to import in a fresh process)
        program: Any = _Deferred(source) if _compiled_alone(source) else source.program
        signature, outputs = source.signature(), source.outputs()
        if signature is None:
            document = source.call_document()
        backend_ok = True
    else:
        needs = needs_of(source)
        program, elsewhere = _program_here(source, model)
        signature, outputs = source.signature, source.outputs
        backend_ok = isinstance(program, torch.export.ExportedProgram)
    snap = needs.snapshot.without(*ignore)
    binding = source.binding
    flatten_out = binding == "flattened" and outputs is not None and not is_native(outputs)
    form = _CallForm(signature, document, outputs, flatten_out)
    unusable = elsewhere or _unusable(needs, snap, form, backend_ok=backend_ok, ignore=ignore,
                                      object_args=object_args)
    if _mutates_argument(source):  # whatever the policy
        unusable = "mutates_argument"
    made = Entry(needs.label, tuple(source.members), binding, program, signature, outputs,
                 flatten_out, snap, unusable, dict(source.identities),
                 tuple(source.ignore_attributes), document=document, folding=source.folding,
                 assigned=None if isinstance(source, LoadedCapture) else source.assigned,
                 baked=source.meta.baked)
    if isinstance(source, LoadedCapture) and source.compiled is not None:
        made.compiled, made.directory = source.compiled, source.path.parent
        made.uncompiled = source.compiled.unusable(made.directory, source.fingerprint)
    return made


class _Deferred:
    """A loaded capture's program, read from its file when first needed."""

    __slots__ = ("source",)

    def __init__(self, source: LoadedCapture) -> None:
        self.source = source


def _compiled_alone(source: LoadedCapture) -> bool:
    """Whether the capture's compiled program can run without its uncompiled
    one at hand: its record holds here and carries the program's structure,
    and no size guard of the uncompiled program must run first (not folded)."""
    rec = source.compiled
    return rec is not None and source.folding is None and rec.specs is not None and \
        len(rec.state_meta) == len(rec.state) and \
        rec.unusable(source.path.parent, source.fingerprint) is None


def _resolved(e: Entry) -> Any:
    """``e``'s program, read now where it was deferred."""
    if isinstance(e.program, _Deferred):
        e.program = e.program.source.program
    return e.program


def _record_flat(e: Entry) -> Flat | None:
    """A flat function for ``e`` from its compiled record alone, or ``None``:
    its function reads and flattens the uncompiled program on first use."""
    rec = e.compiled
    if rec is None or rec.specs is None:
        return None
    try:
        in_spec, out_spec = (pytree.treespec_loads(json.dumps(x)) for x in rec.specs)
        meta = tuple((shape, getattr(torch, dtype), torch.device(device))
                     for shape, dtype, device in rec.state_meta)
        if not all(isinstance(m[1], torch.dtype) for m in meta):
            return None
    except Exception:  # a record this torch cannot read back: read the program
        return None
    return Flat(_uncompiled_later(e), "", tuple(rec.state), meta, in_spec, out_spec)


def _uncompiled_later(e: Entry) -> Callable[..., Any]:
    made: list[Flat] = []

    def uncompiled(*inputs: Any) -> Any:
        if not made:
            flat = flatten(_resolved(e), keep_guards=False)
            if not isinstance(flat, Flat) or e.compiled is None or \
                    flat.state_names != tuple(e.compiled.state):
                raise RuntimeError(f"ctxreplay: {e.label}'s program cannot run uncompiled "
                                   f"here ({flat if isinstance(flat, str) else 'its tensors'})")
            made.append(flat)
        return made[0].fn(*inputs)
    return uncompiled


def _program_here(source: Capture, model: nn.Module | None) -> tuple[Any, str | None]:
    """The capture's program in this process, and why there is none.

    In a distributed report a capture's artifact stays with the rank that
    made it; the others hold its graph without weights (``shared``) and
    rebuild it here with the weights of the member it was traced on -- the
    same module on every rank -- so that every rank dispatches every
    capture.  ``not_rebuildable``: the graph came but cannot be rebuilt
    here (the member lacks a tensor it names); ``not_on_this_rank``: an
    exported program whose graph could not be sent."""
    program = source.artifact
    if program is not None or source.rank is None:
        return program, None
    shared = source.shared
    if shared is None:
        return None, None if source.backend in ("dynamo", "symbolic") else "not_on_this_rank"
    try:
        member = model.get_submodule(source.weights_from) if model is not None else None
    except AttributeError:
        member = None
    if member is None:
        return None, "not_rebuildable"
    try:
        fmt = get_format(shared[0])
        with collector_paused():  # torch's deserialiser makes many small objects
            return fmt.program_from_bytes(shared[1], _state(member, source.binding)), None
    except Exception:  # torch's deserialiser may raise anything: logged
        _log.debug("rebuilding %s failed: not_rebuildable", source.weights_from, exc_info=True)
        return None, "not_rebuildable"


def _state(member: nn.Module, binding: str) -> dict[str, torch.Tensor]:
    """The member's tensors by the names its program gives them; an inner
    tensor of a wrapper parameter (a DTensor's local shard) as a parameter
    over the same storage, which torch's program verifier requires.  A
    parameter FSDP2 holds as its shard between calls stands as the whole
    parameter FSDP gathers for a call (its policy's dtype), with no memory
    of its own (one element, expanded): the program was traced on that, and
    a dispatched call takes the one FSDP put in place for it."""
    out = member_tensors(member, _prefix(binding))
    forms = gathered_forms(member)
    if forms:
        for k, v in out.items():
            if id(v) in forms:
                shape, dtype = forms[id(v)]
                blank = torch.zeros((), dtype=dtype, device=v.device).expand(shape)
                out[k] = nn.Parameter(blank, requires_grad=False)
    for k, v in out.items():
        if unwrapped_name(k) is not None and not isinstance(v, nn.Parameter):
            out[k] = nn.Parameter(v, requires_grad=v.requires_grad)
    return out


def _mutates_argument(source: Capture | LoadedCapture) -> bool:
    """Whether the capture's forward changes an argument object where no
    run of its graph does (its check found a ``Mismatch`` of that field)."""
    if isinstance(source, LoadedCapture):
        return source.mutates_argument
    return any(m.field == ARGUMENT_FIELD for m in source.fidelity.mismatches)


@attrs.frozen
class _CallForm:
    """How dispatch rebuilds a capture's call: its input signature -- or, for
    a loaded capture whose document does not rebuild it, that document,
    which keys every part of it -- and its outputs' structure, which a
    program that returns them flattened (``flatten_out``) needs."""

    signature: CallSpec | None
    document: Any
    outputs: Spec | None
    flatten_out: bool

    @property
    def rebuildable(self) -> bool:
        """Whether a call and its outputs can be rebuilt from the capture."""
        return (self.signature is not None or self.document is not None) and \
            not (self.flatten_out and self.outputs is None)

    def holds_objects(self) -> bool:
        """Whether the call's arguments hold Python objects (a KV cache, a dataclass)."""
        if self.signature is not None:
            return any(_has_objects(s) for _, s in self.signature.items())
        return any(holds_objects(s) for s in [*self.document["args"],
                                              *(v for _, v in self.document["kwargs"])])


def _unusable(needs: Needs, snap: ContextSnapshot, form: _CallForm, *, backend_ok: bool,
              ignore: tuple[str, ...], object_args: str) -> str | None:
    """Why the capture cannot be used in this process at all (a reason code),
    or ``None``."""
    if not backend_ok:
        return "backend_not_dispatchable"
    static = static_differences(needs, ignore)
    if static:
        return static[0].kind if static[0].kind != "state" else "unknown_probe"
    if any(isinstance(s, UnknownState) or isinstance(p, UnknownProbe)
           for _, p, s in zip(snap.names, snap.probes, snap.states)):
        return "unknown_probe"
    if any(isinstance(s, Unresolved) for s in snap.states):
        return "live_state"
    if not form.rebuildable:
        return "not_rebuildable"
    if object_args != "dispatch" and form.holds_objects():
        return "object_arguments"
    return None


def _identity(module: nn.Module, ignore: tuple[str, ...]) -> str:
    try:
        return identity_digest(identity_of(module, ignore))
    except Exception:  # an attribute that cannot be read: not the same member
        return "unreadable"


def sources(source: object) -> list[Capture | LoadedCapture]:
    if isinstance(source, (CaptureReport, LoadedManifest)):
        return list(source.captures)
    if isinstance(source, (Capture, LoadedCapture)):
        return [source]
    if isinstance(source, (str, bytes)) or not isinstance(source, Iterable):
        raise TypeError("install: source must be a CaptureReport, a loaded manifest or "
                        "capture (ctxreplay.load), a Capture, or an iterable of them; got "
                        f"{type(source).__name__}")
    out: list[Capture | LoadedCapture] = []
    for s in source:
        out += sources(s)
    return out

class Programs:
    """Each capture's program per member, made once: bound to the member's
    weights, or the reason it cannot be (``unfit``), and compiled with
    ``compile`` on first use.

    Without ``compile`` a capture's program is flattened once (``flat``) and
    every member runs that one function with its own tensors (``Bound``);
    a program that cannot be flattened -- and every program to be compiled
    -- runs as ``program.module()`` with the member's tensors assigned,
    one module per member."""

    def __init__(self, compile: Compiler | None) -> None:
        self.compile = compile
        self._built: dict[tuple[int, str], tuple[nn.Module | None, Bound] | None] = {}
        self._flat: dict[int, Flat | None] = {}
        #: ``label@member`` -> why that member cannot run that capture
        self.unfit: dict[str, str] = {}
        #: ``label@member`` compiled so far
        self.compiled: list[str] = []
        #: label -> why its program runs as ``program.module()`` (slower)
        self.unflattened: dict[str, str] = {}
        #: member -> the hooks that put its weights in place around a forward
        self.held: dict[str, Held] = {}
        #: ``id(entry)`` of the captures whose flat function is their compiled program
        self.ahead: set[int] = set()

    def flat(self, e: Entry) -> Flat | None:
        """``e``'s program flattened (once) -- its compiled program in place of
        the function where it has a usable one --, or ``None``: ``compile``
        is set, or it cannot be flattened."""
        if self.compile is not None:
            if e.compiled is not None and e.uncompiled is None:
                e.uncompiled = ("compiled_overridden", "install(compile=...) compiles the "
                                "programs itself")
            return None
        key = id(e)
        if key not in self._flat and isinstance(e.program, _Deferred):
            alone = _record_flat(e)
            if alone is not None:
                self._flat[key] = self._ahead(e, alone)
                return self._flat[key]
        if key not in self._flat:
            try:
                made = flatten(_resolved(e), keep_guards=e.folding is not None)
            except Exception as exc:  # torch's module of another form: the general path
                _log.debug("flattening %s failed", e.label, exc_info=True)
                made = f"{type(exc).__name__}: {exc}"
            self._flat[key] = made if isinstance(made, Flat) else None
            if not isinstance(made, Flat):
                self.unflattened[e.label] = made
                if e.compiled is not None and e.uncompiled is None:
                    e.uncompiled = ("compiled_mismatch", f"its program cannot be flattened "
                                    f"here ({made})")
            elif e.compiled is not None and e.uncompiled is None:
                self._flat[key] = self._ahead(e, made)
        return self._flat[key]

    def _ahead(self, e: Entry, flat: Flat) -> Flat:
        """``flat`` running ``e``'s compiled program, or ``flat`` itself where
        that cannot be loaded (``e.uncompiled`` then says why)."""
        assert e.compiled is not None and e.directory is not None
        def autograd() -> None:
            if e.uncompiled is None:
                e.uncompiled = ("compiled_autograd", "a call autograd records runs the "
                                "uncompiled program (compiled programs compute no gradients)")

        made = compiled_flat(flat, e.program, e.compiled, e.directory,
                             guarded=e.folding is not None, on_autograd=autograd)
        if isinstance(made, Flat):
            self.ahead.add(id(e))
            return made
        e.uncompiled = made
        _log.warning("install: %s runs its uncompiled program: %s (%s)", e.label, made[1],
                     made[0])
        return flat

    def fits(self, e: Entry, name: str, module: nn.Module) -> str | None:
        """Whether member ``name`` can run ``e``'s program (``None``), or why not: it is
        what the member was when it ran the variant (its identity) and its weights fit."""
        key = (id(e), name)
        if key not in self._built:
            where = f"{e.label}@{name}"
            flat = self.flat(e)
            built: tuple[nn.Module | None, Bound] | None
            held = weight_hooks(module)
            try:
                if held is not None and held.unknown:
                    raise _Unfollowed
                with held.loaded() if held is not None else contextlib.nullcontext():
                    built = (None, Bound.of(flat, module, _prefix(e.binding))) \
                        if flat is not None else _bind_module(e, module)
            except _Unfollowed:
                built = None
                self.unfit[where] = "hooked_weights"
            except WeightsError:
                built = None
                self.unfit[where] = "structure"
            if held is not None and built is not None:
                self.held[name] = held
            if built is not None and e.identities.get(name, "") not in (
                    "", _identity(module, e.ignore_attributes)):
                built = None
                self.unfit[where] = "identity"
            if built is not None and id(e) in self.ahead:
                built = self._served(where, built)
            self._built[key] = built
        if self._built[key] is not None:
            return None
        return self.unfit.get(f"{e.label}@{name}", "structure")

    def _served(self, where: str, built: tuple[nn.Module | None, Bound]
                ) -> tuple[nn.Module | None, Bound] | None:
        """A member bound to a compiled program: its tensors must be laid out as
        the program was compiled for (contiguous: the compiled code indexes them
        with the strides it was built with)."""
        if not all(t.is_contiguous() for t in built[1].first):
            self.unfit[where] = "weights"
            return None
        built[1].contiguous = True  # (and on every call: ``Bound.holds``)
        if where not in self.compiled:
            self.compiled.append(where)
        return built

    def bound(self, e: Entry, name: str) -> tuple[Flat | None, Bound | None]:
        """``e``'s flat program (``None``: it runs as a module) and member ``name``'s
        tensors for it."""
        built = self._built.get((id(e), name))
        return self._flat.get(id(e)), None if built is None else built[1]

    def make(self, e: Entry, name: str) -> Callable[..., Any] | None:
        """The callable member ``name`` runs for ``e`` (compiled where asked)."""
        built = self._built.get((id(e), name))
        gm = None if built is None else built[0]
        if gm is None:
            return None
        if self.compile is None:
            return gm
        try:
            fn = self.compile(gm)
        except Exception:  # a compiler may raise anything: recorded, logged
            self.compile_failed(e, name)
            return None
        self.compiled.append(f"{e.label}@{name}")
        return fn

    def compile_failed(self, e: Entry, name: str) -> None:
        """Member ``name`` runs ``e`` eagerly from now on, and the user is told."""
        where = f"{e.label}@{name}"
        self.unfit[where] = "compile_failed"
        _log.debug("compiling %s failed: compile_failed", where, exc_info=True)
        warnings.warn(f"ctxreplay.install: compiling {where} failed; its calls run eagerly",
                      RuntimeWarning, stacklevel=4)

    def forget(self, name: str) -> None:
        """Member ``name``'s tensors or submodules were replaced: bind again."""
        for key in [k for k in self._built if k[1] == name]:
            del self._built[key]
        self.held.pop(name, None)
        for where in [w for w in self.unfit if w.endswith(f"@{name}")]:
            del self.unfit[where]

    def clear(self) -> None:
        """Drop every program (``remove()``)."""
        self._built.clear()
        self._flat.clear()
        self.ahead.clear()


def _bind_module(e: Entry, module: nn.Module) -> tuple[nn.Module, Bound]:
    """``program.module()`` with the member's tensors assigned, and those tensors."""
    program = _resolved(e)
    gm = bind_weights(program, module, e.binding)
    sig = program.graph_signature
    return gm, Bound((*sig.parameters, *sig.buffers), None, module, _prefix(e.binding))


class _Unfollowed(Exception):
    """The member's weights are put in place by hooks ctxreplay cannot follow."""


def _prefix(binding: str) -> str:
    """A flattened capture's program names the member's tensors under ``inner.``."""
    return "inner." if binding == "flattened" else ""


class Target:
    """One capture's program for one member: built (and compiled) on first use.

    ``run`` returns the call's outputs, ``REFUSED`` (a folded graph's guard
    refused the sizes), ``UNFIT`` (the member's tensors no longer have the
    shapes, dtypes or devices the program takes), or ``None`` with
    ``failed`` set (compiling failed)."""

    __slots__ = ("bound", "direct", "entry", "failed", "flat", "fn", "guard", "held", "name",
                 "programs")

    def __init__(self, entry: Entry, programs: Programs, name: str, module: nn.Module) -> None:
        self.entry, self.programs, self.name = entry, programs, name
        baked = entry.baked
        #: what holds the member to the state its program baked in
        self.guard = BakedGuard(baked, module) if baked is not None and baked.sources \
            else None
        self.fn: Callable[..., Any] | None = None
        self.failed = False
        self.flat, self.bound = programs.bound(entry, name)
        self.held = programs.held.get(name)
        #: how many positional arguments a call that passes them as the
        #: program's leaves has (a native capture of plain leaves), else -1
        self.direct = self.flat.positional if self.flat is not None and \
            entry.binding == "native" else -1

    def run(self, args: tuple[Any, ...], kwargs: dict[str, Any],
            tensors: list[Any] | None = None) -> Any:
        """``tensors``: the call's tensors in ``call_tensors`` order, where known.
        A member whose weights hooks put in place (offloading) has them put in
        place for the call and taken away after, by those hooks, as its eager
        forward does."""
        guard = self.guard
        if guard is not None and not guard.holds():
            return STALE
        held = self.held
        if held is None:
            return self._run(args, kwargs, tensors)
        held.onload()
        try:
            return self._run(args, kwargs, tensors)
        finally:
            held.offload()

    def _run(self, args: tuple[Any, ...], kwargs: dict[str, Any],
             tensors: list[Any] | None) -> Any:
        flat, bound = self.flat, self.bound
        try:
            state = bound.state() if bound is not None else ()
        except KeyError:  # a tensor deleted from its module without an assignment
            return UNFIT
        if bound is not None and not bound.holds(state):
            return UNFIT
        if flat is None:
            # the module holds the tensors bound: one replaced since runs eagerly
            if bound is not None and not bound.same(state):
                return UNFIT
            return self._run_module(args, kwargs)
        e = self.entry
        call = args
        if kwargs or len(args) != self.direct:
            if e.binding != "flattened":
                args = tuple(flat.leaves(args, kwargs))
            else:
                args = tuple(tensors if tensors is not None else call_tensors(args, kwargs))
        try:
            out = flat.fn(*state, *args)
        except AssertionError as exc:
            if e.folding is not None and str(exc).startswith("Guard failed"):
                return REFUSED
            raise
        if e.assigned is not None:
            out = _written(e, flat.rebuild(out) if not e.flatten_out else out, call, kwargs)
            if not e.flatten_out:
                return out
        if e.flatten_out:
            it = iter(out)
            assert e.outputs is not None
            return build(e.outputs, lambda _s: next(it))
        return flat.rebuild(out)

    def _run_module(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        e = self.entry
        fn = self.fn
        first = fn is None
        if fn is None:
            fn = self.programs.make(e, self.name)
            if fn is None:
                self.failed = True
                return None
            self.fn = fn
        try:
            if e.binding == "flattened":
                out = fn(*call_tensors(args, kwargs))
            else:
                out = fn(*args, **kwargs)
        except AssertionError as exc:
            # a folded graph checks the sizes it takes before it runs
            # (torch.export's input guards, e.g. ``x.size()[1] % 2 == 0``):
            # a size in range that another guard refuses runs eagerly
            if e.folding is not None and str(exc).startswith("Guard failed"):
                return REFUSED
            raise
        except Exception:  # a compiler failing at its first call: recorded, logged
            if not first or self.programs.compile is None:
                raise
            # torch.compile compiles on the first call: a compiler that fails
            # there costs this capture, not the user's forward
            self.programs.compile_failed(e, self.name)
            self.failed = True
            return None
        if e.assigned is not None:
            out = _written(e, out, args, kwargs)
        if e.flatten_out:
            it = iter(out)
            assert e.outputs is not None
            return build(e.outputs, lambda _s: next(it))
        return out


def _written(e: Entry, raw: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The program's outputs, the tensors it returns after them assigned
    (with the constants) to the live call's argument objects, as the eager
    forward assigns them."""
    assert e.assigned is not None
    out, tensors = split(raw, e.assigned, e.flatten_out)
    write(args, kwargs, e.assigned, tensors)
    return out
