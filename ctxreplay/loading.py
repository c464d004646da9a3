"""Using saved captures: ``load`` a manifest directory or one saved capture,
``check`` what it needs against this process, call it guarded.

What a capture needs where it runs is what its files were verified under
(``verify.neutral_replay``): every probe it does not carry (``ambient_only``)
at the state the live call had, every other probe either neutral or at that
same state; the torch it was made with; the accelerator its tensors live on
(and that accelerator's capability); torch's autocast op policy for those
devices; and a fidelity check that passed.  ``check()`` says, per probe or
field, what differs (empty when all holds).  A probe this process does not
have cannot be checked: when the capture needs its state re-established,
that is a difference too -- never a silent pass.

The guarded call checks on every call through the observation fast path: a
snapshot cached behind ``GlobalStateGuard().check()`` plus the probes'
watched getters (``observer.Observer``), compared by identity with the last
snapshot that passed.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import attrs
import torch
from torch import nn

from ._environment import autocast_policy, capability, device_available
from ._json import loads, read_int, read_list, read_mapping, read_str
from .artifact import (
    SIDECAR_SCHEMA,
    ArtifactError,
    ArtifactSidecar,
    read_sidecar,
    sidecar_path,
    warn_unknown,
)
from .manifest import MANIFEST_NAME, MANIFEST_SCHEMA, ManifestEntry, entry_devices, read_manifest
from .observer import Observer
from .probe import ContextProbe
from .signature import CallSpec, Spec, TensorSpec, tensor_leaves
from .snapshot import (
    ContextSnapshot,
    UnknownProbe,
    UnknownState,
    Unresolved,
    describe_state,
)
from .specjson import resolve_opaque, spec_from_json
from .verify import combined_status, fidelity_status, is_neutral

__all__ = ["DIFFERENCE_KINDS", "ENVIRONMENT_FIELDS", "EXPECTED_FILES", "GUARD_MODES", "Difference",
           "GuardError", "GuardWarning", "GuardedCapture", "LoadedCapture", "LoadedManifest",
           "Needs", "WeightsError", "bind_weights", "check_needs", "detect", "load",
           "merge_differences", "needs_from_document", "needs_of", "state_differences",
           "static_differences"]

GUARD_MODES = ("raise", "warn", "fallback")

#: ``Difference.kind``: a probe's state, the environment, or the fidelity check
DIFFERENCE_KINDS = ("state", "environment", "fidelity")
#: ``Difference.field`` of an ``environment`` difference
ENVIRONMENT_FIELDS = ("torch", "device", "capability", "autocast_policy")

#: what ``load`` and the command line accept, in words
EXPECTED_FILES = ("a manifest directory or its manifest.json (report.save_all), a .pt2 "
                  "with its .pt2.json sidecar (Capture.save), a sidecar, or a report JSON "
                  "(report.save)")

Probes = Iterable[ContextProbe[Any]] | Mapping[str, ContextProbe[Any]] | None


# -- differences ------------------------------------------------------------------

@attrs.frozen
class Difference:
    """One thing that differs between now and what a capture needs.

    ``kind``: ``"state"`` (a probe: ``field`` is its name), ``"environment"``
    (``torch``, ``device``, ``capability``, ``autocast_policy``) or
    ``"fidelity"``; ``needed`` / ``found`` say it in words; ``captures`` lists
    the ``scope#variant`` labels it concerns.  ``str()`` is one line."""

    field: str
    """What differs: a probe's name, an environment field (``torch``, ``device``, ``capability``,
    ``autocast_policy``) or ``fidelity``."""
    needed: str
    """What the capture needs, in words."""
    found: str
    """What this process has now, in words."""
    kind: str = "state"
    """One of ``DIFFERENCE_KINDS``: ``state``, ``environment`` or ``fidelity``."""
    captures: tuple[str, ...] = ()
    """The ``scope#variant`` labels it concerns."""

    @property
    def text(self) -> str:
        """The difference as one line of words."""
        if self.kind == "environment":
            line = f"{self.field}: made with {self.needed}, now {self.found}"
        elif self.kind == "fidelity":
            line = f"fidelity: {self.found}"
        else:
            line = f"{self.field}: needs {self.needed}, now {self.found}"
        if self.captures:
            shown = ", ".join(self.captures[:4]) + (", ..." if len(self.captures) > 4 else "")
            line += f" [{shown}]"
        return line

    def __str__(self) -> str:
        return self.text


def merge_differences(found: Iterable[Difference]) -> tuple[Difference, ...]:
    """One difference per distinct finding, listing every capture it concerns."""
    merged: dict[tuple[str, str, str, str], list[str]] = {}
    for d in found:
        labels = merged.setdefault((d.field, d.needed, d.found, d.kind), [])
        labels += [c for c in d.captures if c not in labels]
    return tuple(Difference(f, n, o, k, tuple(c)) for (f, n, o, k), c in merged.items())


class GuardError(RuntimeError):
    """A guarded call found that the current process differs from what the
    capture needs (``on_mismatch="raise"``).  ``differences`` lists them."""

    def __init__(self, label: str, differences: tuple[Difference, ...]) -> None:
        self.label = label
        """The ``scope#variant`` of the guarded capture."""
        self.differences = differences
        """What differs, one ``Difference`` each."""
        super().__init__(f"{label}: this process differs from what the capture needs, so it "
                         "would not reproduce its live call:\n  "
                         + "\n  ".join(d.text for d in differences))


class GuardWarning(UserWarning):
    """A guarded call ran although the process differs from what the capture
    needs (``on_mismatch="warn"``); once per distinct state."""


@attrs.frozen(eq=False)
class Needs:
    """What a capture needs where it runs (see the module docstring).
    ``environment`` ``None``: the capture was made in this process."""

    label: str
    snapshot: ContextSnapshot
    ambient_only: tuple[str, ...]
    context: Mapping[str, str]
    environment: Mapping[str, Any] | None
    devices: frozenset[str]
    #: ``Fidelity.status`` of its checks (live and saved file together)
    fidelity: str

    def observable(self, ignore: Iterable[str] = ()) -> tuple[ContextProbe[Any], ...]:
        """The probes whose current state can be observed and compared."""
        skip = set(ignore)
        return tuple(p for n, p, s in zip(self.snapshot.names, self.snapshot.probes,
                                          self.snapshot.states)
                     if n not in skip and not isinstance(p, UnknownProbe)
                     and not isinstance(s, UnknownState))


def _devices(specs: Iterable[TensorSpec]) -> frozenset[str]:
    return frozenset(s.device.split(":")[0] for s in specs)


def needs_of(capture: Any) -> Needs:
    """The needs of a live ``ctxreplay.Capture`` (made in this process)."""
    specs = [s for _, s in capture.signature.leaves()]
    if capture.outputs is not None:
        specs += [s for _, s in tensor_leaves(capture.outputs)]
    return Needs(f"{capture.scope}#{capture.variant}", capture.snapshot,
                 tuple(capture.ambient_only), capture.snapshot.describe(), None,
                 _devices(specs), capture.fidelity.status)


def needs_from_document(capture: Any, environment: Mapping[str, Any] | None, path: str,
                        probes: Probes = None) -> Needs:
    """The needs of a capture record in a report or manifest
    (``Capture.to_json()``), checked strictly where used; unknown probes
    load as opaque states (``.snapshot.unknown``)."""
    doc = read_mapping(capture, path, required={"scope", "variant", "snapshot",
                                                "ambient_only", "fidelity", "inputs"})
    snap = ContextSnapshot.from_json(doc["snapshot"], _probe_map(probes),
                                     path=f"{path}.snapshot", unknown="opaque")
    ambient = tuple(read_str(v, f"{path}.ambient_only[{i}]")
                    for i, v in enumerate(read_list(doc["ambient_only"], f"{path}.ambient_only")))
    context = doc.get("context")
    label = f"{read_str(doc['scope'], f'{path}.scope', max_len=4096)}#" \
            f"{read_int(doc['variant'], f'{path}.variant', lo=0)}"
    return Needs(label, snap, ambient, dict(context) if isinstance(context, Mapping) else {},
                 environment if environment is not None else {"torch": "unknown"},
                 frozenset(entry_devices([doc["inputs"], doc.get("outputs")])),
                 _fidelity(doc, "fidelity"))


_FIDELITY_WORDS = {
    "failed": "the capture did not reproduce its live call when it was checked",
    "unchecked": "the capture was never checked against its live call (verify='off', or "
                 "saved with verify=False)",
}


def static_differences(needs: Needs, ignore: Iterable[str] = ()) -> list[Difference]:
    """What differs whatever the ambient state: environment, fidelity, and
    needed states of probes this process does not have."""
    label = (needs.label,)
    out: list[Difference] = []
    if needs.fidelity in _FIDELITY_WORDS:  # ok_with_needs: its needs are checked below
        out.append(Difference("fidelity", "ok", _FIDELITY_WORDS[needs.fidelity], "fidelity",
                              label))
    skip = set(ignore)
    for name, probe, state in zip(needs.snapshot.names, needs.snapshot.probes,
                                  needs.snapshot.states):
        if name in skip or name not in needs.ambient_only:
            continue  # carried by the artifact, or neutral when it was made
        if isinstance(state, UnknownState) or isinstance(probe, UnknownProbe):
            out.append(Difference(name, needs.context.get(name, "its recorded state"),
                                  "a probe that is not registered in this process, so it "
                                  "cannot be checked", "state", label))
    env = needs.environment
    if env is None:
        return out
    then, now = str(env.get("torch", "?")), str(torch.__version__)
    if then != now:
        out.append(Difference("torch", then, now, "environment", label))
    for device in sorted(needs.devices - {"cpu", "meta"}):
        if not device_available(device):
            out.append(Difference("device", device, f"no {device} device", "environment",
                                  label))
            continue
        made = env.get("capability")
        if env.get("device") == device and isinstance(made, str):
            here = capability(device)
            if here != made:
                out.append(Difference("capability", f"{device} {made}",
                                      f"{device} {here or 'unknown'}", "environment", label))
    policy = env.get("autocast_policy")
    if isinstance(policy, Mapping):
        current = autocast_policy()
        for device in sorted(needs.devices):
            recorded = policy.get(device)
            if isinstance(recorded, str) and current.get(device) != recorded:
                out.append(Difference("autocast_policy", f"{device} {recorded}",
                                      f"{device} {current.get(device, 'none')}",
                                      "environment", label))
    return out


def _needed(needs: Needs, name: str, probe: ContextProbe[Any], state: Any) -> str:
    if isinstance(state, Unresolved):
        return f"{needs.context.get(name, state.state_type)} (a live state a document " \
               "cannot carry)"
    if name in needs.ambient_only:
        return describe_state(probe, state)
    parts = []
    try:
        neutral = probe.neutral_state()
    except Exception:  # a probe that cannot say: only its own state will do
        neutral = None
    if neutral is not None:
        parts.append(describe_state(probe, neutral))
    if not is_neutral(probe, state) or neutral is None:
        parts.append(describe_state(probe, state))
    return " or ".join(dict.fromkeys(parts))


def state_differences(needs: Needs, current: Mapping[str, Any],
                      ignore: Iterable[str] = ()) -> list[Difference]:
    """What differs between the current probe states (``name -> state``; a
    ``BaseException`` for a probe that could not observe) and what the
    capture needs."""
    skip = set(ignore)
    label = (needs.label,)
    out = []
    for name, probe, state in zip(needs.snapshot.names, needs.snapshot.probes,
                                  needs.snapshot.states):
        if name in skip or isinstance(probe, UnknownProbe) or isinstance(state, UnknownState):
            continue
        now = current.get(name)
        if isinstance(now, BaseException):
            out.append(Difference(name, _needed(needs, name, probe, state),
                                  f"unobservable ({type(now).__name__})", "state", label))
            continue
        same = not isinstance(state, Unresolved) and now == state
        if same or (name not in needs.ambient_only and is_neutral(probe, now)):
            continue
        out.append(Difference(name, _needed(needs, name, probe, state),
                              describe_state(probe, now), "state", label))
    return out


def _observe(probes: Iterable[ContextProbe[Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for p in probes:
        try:
            out[p.name] = p.observe()
        except Exception as exc:  # reported as a difference, never fatal
            out[p.name] = exc
    return out


def check_needs(needs: Needs, ignore: Iterable[str] = ()) -> tuple[Difference, ...]:
    """Every difference between now and what ``needs`` says."""
    ignore = tuple(ignore)
    current = _observe(needs.observable(ignore))
    return tuple(static_differences(needs, ignore) + state_differences(needs, current, ignore))


# -- weights ----------------------------------------------------------------------

class WeightsError(ValueError):
    """Weights given for a capture do not fit its program (a name missing, or
    another shape, dtype or device)."""


Weights = nn.Module | Mapping[str, torch.Tensor] | None


def _tensor_at(gm: nn.Module, name: str) -> tuple[nn.Module, str, torch.Tensor | None]:
    owner_name, _, leaf = name.rpartition(".")
    owner = gm.get_submodule(owner_name) if owner_name else gm
    t: torch.Tensor | None = owner._parameters.get(leaf)
    if t is None:
        t = owner._buffers.get(leaf)
    return owner, leaf, t


def bind_weights(program: Any, weights: Weights, binding: str) -> nn.Module:
    """``program.module()`` running with ``weights``: a member module (its own
    parameters and buffers, shared, not copied) or a state dict.  Only this
    module changes (DESIGN.md fact 20); buffers the graph updates in place
    are the member's own, as they are when it runs eagerly.  A flattened
    capture's program names them with an ``inner.`` prefix."""
    gm: nn.Module = program.module()
    if weights is None:
        return gm
    prefix = "inner." if binding == "flattened" else ""
    if isinstance(weights, nn.Module):
        source: dict[str, torch.Tensor] = dict(weights.named_parameters(remove_duplicate=False))
        source.update(weights.named_buffers(remove_duplicate=False))
    else:
        source = dict(weights)
    sig = program.graph_signature
    optional = set() if isinstance(weights, nn.Module) else set(sig.non_persistent_buffers)
    plan: list[tuple[nn.Module, str, torch.Tensor, bool]] = []
    problems: list[str] = []
    for name in (*sig.parameters, *sig.buffers):
        key = name[len(prefix):] if name.startswith(prefix) else name
        owner, leaf, mine = _tensor_at(gm, name)
        src = source.get(key)
        if src is None:
            if name not in optional:
                problems.append(f"{key}: missing")
            continue
        if mine is None:
            problems.append(f"{key}: not a tensor of the program")
            continue
        if tuple(src.shape) != tuple(mine.shape) or src.dtype != mine.dtype or \
                src.device != mine.device:
            problems.append(f"{key}: {str(src.dtype).removeprefix('torch.')}"
                            f"{list(src.shape)} on {src.device}, the program has "
                            f"{str(mine.dtype).removeprefix('torch.')}{list(mine.shape)} on "
                            f"{mine.device}")
            continue
        plan.append((owner, leaf, src, leaf in owner._parameters))
    if problems:
        shown = "; ".join(problems[:5]) + ("; ..." if len(problems) > 5 else "")
        raise WeightsError(f"weights do not fit the program: {shown}")
    for owner, leaf, src, is_param in plan:
        if is_param:
            owner._parameters[leaf] = src if isinstance(src, nn.Parameter) else \
                nn.Parameter(src, requires_grad=src.requires_grad)
        else:
            owner._buffers[leaf] = src
    return gm


# -- loaded captures ---------------------------------------------------------------

@attrs.frozen(eq=False)
class LoadedCapture:
    """One saved capture, opened by :func:`ctxreplay.load`.

    Its program holds the weights of ``weights_from`` -- the first member
    that ran the variant; run it for another member with
    ``module(weights=member)``.  ``check()`` says what differs between now
    and what it needs; ``guarded()`` is a callable that checks on every call;
    ``replay()`` establishes what it needs around a block of code.
    """

    path: Path
    """The ``.pt2`` file."""
    sidecar: ArtifactSidecar = attrs.field(repr=False)
    """Its sidecar, read back."""
    members: tuple[str, ...]
    """The blocks the capture stands for."""
    weights_from: str
    """The member whose weights the program holds."""
    fidelity: str
    """``Fidelity.status`` of the live check and the saved file's check together: ``"ok"``,
    ``"ok_with_needs"`` (reproduces where its ``ambient_only`` states hold), ``"failed"`` or
    ``"unchecked"``."""
    environment: Mapping[str, Any] = attrs.field(repr=False)
    """Versions, device and autocast op policy it was made with."""
    merged: tuple[int, ...] = ()
    """Variants merged into this capture (``Capture.merged``)."""
    _cache: dict[str, Any] = attrs.field(factory=dict, repr=False, alias="cache")

    @property
    def scope(self) -> str:
        """The capture's variant table."""
        return self.sidecar.scope

    @property
    def variant(self) -> int:
        """The capture's variant number."""
        return self.sidecar.variant

    @property
    def label(self) -> str:
        """``scope#variant``."""
        return f"{self.scope}#{self.variant}"

    @property
    def binding(self) -> str:
        """How the program takes its inputs: ``native`` or ``flattened``."""
        return self.sidecar.binding

    @property
    def fingerprint(self) -> str:
        """The capture's fingerprint."""
        return self.sidecar.fingerprint

    @property
    def snapshot(self) -> ContextSnapshot:
        """The context of the live call (unknown probes as opaque states)."""
        return self.sidecar.snapshot

    @property
    def embedded(self) -> tuple[str, ...]:
        """Probes whose state the program carries itself."""
        return self.sidecar.embedded

    @property
    def ambient_only(self) -> tuple[str, ...]:
        """Probes whose non-neutral state must be re-established around each call (``check()`` says
        whether it holds; ``replay()`` establishes it)."""
        return self.sidecar.ambient_only

    @property
    def identities(self) -> tuple[tuple[str, str], ...]:
        """``(member, identity digest)`` when it ran (``Capture.identities``)."""
        return self.sidecar.identities

    @property
    def ignore_attributes(self) -> tuple[str, ...]:
        """Attributes left out of the members' identities."""
        return self.sidecar.ignore_attributes

    @property
    def needs(self) -> Needs:
        """What the guard checks (see :func:`ctxreplay.load`)."""
        needs = self._cache.get("needs")
        if needs is None:
            side = self.sidecar
            specs = [s for _, s in side.inputs] + list(side.outputs or ())
            context = side.document.get("context")
            needs = Needs(self.label, side.snapshot, side.ambient_only,
                          dict(context) if isinstance(context, Mapping) else {},
                          self.environment, _devices(specs), self.fidelity)
            self._cache["needs"] = needs
        return needs

    @property
    def program(self) -> Any:
        """The ``torch.export.ExportedProgram`` (loaded once, on first use)."""
        program = self._cache.get("program")
        if program is None:
            program = self._cache["program"] = torch.export.load(self.path)
        return program

    def signature(self) -> CallSpec | None:
        """The captured call's signature, or ``None`` where the document does
        not carry it fully (an object argument, a string constant)."""
        try:
            return self.sidecar.signature()
        except ArtifactError:
            return None

    def outputs(self) -> Spec | None:
        """The live call's output structure, or ``None`` where the document
        does not carry it fully."""
        doc = self.sidecar.document.get("outputs")
        if doc is None:
            return None
        try:
            return resolve_opaque(spec_from_json(doc, "$.outputs"))
        except ValueError:
            return None

    def module(self, weights: Weights = None) -> nn.Module:
        """The program as a module: with its own weights (``weights_from``'s),
        or with another member's.

        Args:
            weights: a member module or its state dict (``None``: the
                program's own weights).

        Raises:
            WeightsError: the weights do not fit the program."""
        return bind_weights(self.program, weights, self.binding)

    def example_inputs(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Fresh inputs of the recorded signature (``ArtifactSidecar.example_inputs``)."""
        return self.sidecar.example_inputs()

    def check(self, *, ignore: Iterable[str] = ()) -> tuple[Difference, ...]:
        """What differs between now and what this capture needs, one
        :class:`Difference` per probe or field (empty when all holds).

        Args:
            ignore: probe names not to check (you vouch for them)."""
        return check_needs(self.needs, ignore)

    @contextmanager
    def replay(self) -> Iterator[None]:
        """Establish what the capture needs -- every probe at its neutral
        state, then each state it does not carry itself (``ambient_only``)
        as the live call had it -- and restore exactly on exit.  Raises
        ``ValueError`` for a needed state this process cannot establish (an
        unknown probe, a live state a document cannot carry)."""
        snap = self.snapshot
        needed = [n for n, s in snap.items() if isinstance(s, Unresolved)
                  and n in self.ambient_only]
        if needed:
            raise ValueError(f"{self.label}: cannot establish the state of "
                             f"{', '.join(needed)} here (not portable, or the probe is not "
                             "registered in this process)")
        with ExitStack() as stack:
            for name, probe, state in zip(snap.names, snap.probes, snap.states):
                if isinstance(state, Unresolved):
                    continue
                neutral = probe.neutral_state()
                if name in self.ambient_only:
                    stack.enter_context(probe.replay(state))
                elif neutral is not None:
                    stack.enter_context(probe.replay(neutral))
            yield

    def guarded(self, *, on_mismatch: str = "raise",
                fallback: Callable[..., Any] | None = None, weights: Weights = None,
                ignore: Iterable[str] = ()) -> GuardedCapture:
        """A callable that runs the program after checking, on each call,
        that the process still holds what the capture needs.

        Args:
            on_mismatch: on a difference, ``"raise"`` (:class:`GuardError`
                listing it), ``"warn"`` (:class:`GuardWarning` once per
                distinct state, then run) or ``"fallback"`` (call
                ``fallback`` with the same arguments instead).
            fallback: what to call instead, for ``on_mismatch="fallback"``.
            weights: a member module or its state dict, as for ``module()``.
            ignore: probe names not to check (you vouch for them)."""
        return GuardedCapture(self.needs, self.module(weights), on_mismatch=on_mismatch,
                              fallback=fallback, ignore=ignore)


class GuardedCapture:
    """A capture's program behind a per-call check (made by
    :meth:`LoadedCapture.guarded`).  ``mismatches`` counts calls that found
    a difference; ``check()`` is the check now."""

    __slots__ = ("_fallback", "_label", "_mode", "_needs", "_observer", "_ok", "_run",
                 "_static", "_verdicts", "ignore", "mismatches")

    def __init__(self, needs: Needs, run: Callable[..., Any], *, on_mismatch: str = "raise",
                 fallback: Callable[..., Any] | None = None,
                 ignore: Iterable[str] = ()) -> None:
        if on_mismatch not in GUARD_MODES:
            raise ValueError(f"on_mismatch: {on_mismatch!r} is not one of {list(GUARD_MODES)}")
        if on_mismatch == "fallback" and not callable(fallback):
            raise ValueError("on_mismatch='fallback' needs fallback=<a callable taking the "
                             "same arguments>")
        self._needs, self._run, self._mode, self._fallback = needs, run, on_mismatch, fallback
        self._label = needs.label
        self.ignore = tuple(ignore)
        """Probe names the guard leaves out."""
        self._static = tuple(static_differences(needs, self.ignore))
        self._observer = Observer(needs.observable(self.ignore), per_call=True)
        self._ok: ContextSnapshot | None = None
        self._verdicts: dict[ContextSnapshot, tuple[Difference, ...]] = {}
        self.mismatches = 0
        """Calls that found a difference so far."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            snap: ContextSnapshot | None = self._observer()
        except Exception:  # a probe that cannot observe: the slow path says which
            snap = None
        if snap is not None and snap is self._ok:
            return self._run(*args, **kwargs)
        return self._slow(snap, args, kwargs)

    def check(self) -> tuple[Difference, ...]:
        """What differs now (as :meth:`LoadedCapture.check`)."""
        return check_needs(self._needs, self.ignore)

    def _slow(self, snap: ContextSnapshot | None, args: tuple[Any, ...],
              kwargs: dict[str, Any]) -> Any:
        found = self._verdicts.get(snap) if snap is not None else None
        first = found is None
        if found is None:
            current = dict(snap.items()) if snap is not None else \
                _observe(self._needs.observable(self.ignore))
            found = self._static + tuple(state_differences(self._needs, current, self.ignore))
            if snap is not None:
                if len(self._verdicts) >= 256:  # a state that changes every call
                    self._verdicts.clear()
                self._verdicts[snap] = found
        if not found:
            self._ok = snap
            return self._run(*args, **kwargs)
        self.mismatches += 1
        if self._mode == "raise":
            raise GuardError(self._label, found)
        if self._mode == "warn":
            if first:
                warnings.warn(str(GuardError(self._label, found)), GuardWarning, stacklevel=3)
            return self._run(*args, **kwargs)
        assert self._fallback is not None
        return self._fallback(*args, **kwargs)


@attrs.frozen(eq=False)
class LoadedManifest:
    """A directory written by ``report.save_all``, opened by :func:`ctxreplay.load`.

    ``captures``: every saved capture; ``not_saved``: ``(scope#variant,
    reason)`` of captures the report had that could not be written;
    ``failures``: ``(scope, variant, backend, reason)`` of variants that
    failed to capture; ``problems``: the report's problem codes; ``ok``:
    the report was ok when saved.  ``unknown_probes``: probes the files
    name that this process does not have."""

    path: Path
    """The ``manifest.json``."""
    ctxreplay_version: str
    """The ctxreplay version that wrote it."""
    environment: Mapping[str, Any] = attrs.field(repr=False)
    """Versions, device and autocast op policy it was made with."""
    ok: bool
    """Whether the report was ok when it was saved."""
    probes: tuple[str, ...]
    """The probes the session observed."""
    captures: tuple[LoadedCapture, ...]
    """Every saved capture."""
    not_saved: tuple[tuple[str, str], ...] = ()
    """``(scope#variant, reason)`` of captures the report had that were not written."""
    failures: tuple[tuple[str, int, str, str], ...] = ()
    """``(scope, variant, backend, reason)`` of variants that failed to capture."""
    problems: tuple[str, ...] = ()
    """The report's problem codes."""
    unknown_probes: tuple[str, ...] = ()
    """Probes the files name that this process does not have."""

    @property
    def directory(self) -> Path:
        """The directory the manifest is in."""
        return self.path.parent

    def __iter__(self) -> Iterator[LoadedCapture]:
        return iter(self.captures)

    def __len__(self) -> int:
        return len(self.captures)

    def check(self, *, ignore: Iterable[str] = ()) -> tuple[Difference, ...]:
        """What differs between now and what the captures need, each
        difference once, listing the captures it concerns (empty when all
        holds)."""
        ignore = tuple(ignore)
        return merge_differences(d for c in self.captures for d in c.check(ignore=ignore))


# -- load ---------------------------------------------------------------------------

def detect(path: str | os.PathLike[str]) -> tuple[str, Path, Any]:
    """``(kind, file, document)``: ``kind`` is ``"manifest"``, ``"artifact"``
    (a ``.pt2``; ``file`` is it), ``"sidecar"`` or ``"report"``; ``document``
    the parsed JSON (``None`` for a ``.pt2``).  Anything else raises
    ``ValueError`` naming what was expected."""
    given = Path(os.fspath(path))
    if given.is_dir():
        manifest = given / MANIFEST_NAME
        if not manifest.is_file():
            raise ValueError(f"$: a directory without {MANIFEST_NAME}; expected "
                             f"{EXPECTED_FILES} (in {given})")
        given = manifest
    if not given.exists():
        raise FileNotFoundError(f"{given}: no such file or directory")
    with given.open("rb") as f:
        head = f.read(4)
    if head == b"PK\x03\x04":  # a zip archive: what torch.export.save writes
        side = sidecar_path(given)
        if not side.is_file():
            raise ValueError(f"$: a .pt2 archive without its sidecar {side.name} "
                             f"(Capture.save writes it beside the .pt2) (in {given})")
        return "artifact", given, None
    try:
        data = loads(given.read_bytes(), "$", source=str(given))
    except ValueError:
        raise ValueError(f"$: not a ctxreplay file (neither a .pt2 archive nor a JSON "
                         f"document); expected {EXPECTED_FILES} (in {given})") from None
    schema = data.get("schema") if isinstance(data, Mapping) else None
    # by family: a reader of the kind then names an unsupported version
    families = {MANIFEST_SCHEMA: "manifest", SIDECAR_SCHEMA: "sidecar",
                "ctxreplay.report/": "report"}
    for prefix, kind in families.items():
        if isinstance(schema, str) and schema.startswith(prefix.partition("/")[0] + "/"):
            return kind, given, data
    shown = repr(schema[:60]) if isinstance(schema, str) else "none"
    raise ValueError(f"$.schema: a JSON document that is not a ctxreplay manifest, sidecar "
                     f"or report (schema {shown}); expected {EXPECTED_FILES} (in {given})")


def _fidelity(doc: Mapping[str, Any], key: str) -> str:
    value = doc.get(key)
    if value is None:
        return "unchecked"
    return fidelity_status(value, f"$.{key}")


def _capture(side: ArtifactSidecar, members: tuple[str, ...], weights_from: str,
             fidelity: str, environment: Mapping[str, Any] | None,
             merged: tuple[int, ...] = ()) -> LoadedCapture:
    env = environment
    if env is None:
        doc_env = side.document.get("environment")
        env = doc_env if isinstance(doc_env, Mapping) else {"torch": side.torch_version}
    return LoadedCapture(side.artifact, side, members or side.members or (side.scope,),
                         weights_from or side.weights_from or
                         (members[0] if members else side.scope),
                         fidelity, env, merged)


def _load_single(path: Path, probes: Probes) -> LoadedCapture:
    side = read_sidecar(path, _probe_map(probes))
    warn_unknown(side.snapshot.unknown, side.path.name)
    doc = side.document
    saved = None if doc.get("saved_fidelity") is None else _fidelity(doc, "saved_fidelity")
    return _capture(side, (), "", combined_status(_fidelity(doc, "fidelity"), saved), None)


def _check_entry(e: ManifestEntry, side: ArtifactSidecar) -> None:
    where = f"$.captures[{e.index}]"
    for field, mine, theirs in (("scope", e.scope, side.scope),
                                ("variant", e.variant, side.variant),
                                ("fingerprint", e.fingerprint, side.fingerprint),
                                ("binding", e.binding, side.binding),
                                ("artifact", e.artifact, side.artifact.name)):
        if mine != theirs:
            raise ValueError(f"{where}.capture.{field}: does not match its sidecar "
                             f"{side.path.name}")


def _load_manifest(path: Path, data: Any, probes: Probes) -> LoadedManifest:
    try:
        doc = read_manifest(path, data)
    except ValueError as exc:
        raise ValueError(f"{exc} (in {path})") from None
    given = _probe_map(probes)
    captures = []
    unknown: list[str] = []
    not_saved = []
    for e in doc.entries:
        if e.sidecar is None:
            not_saved.append((e.label, e.not_saved or "unknown"))
            continue
        side_file = doc.directory / e.sidecar
        try:
            side = read_sidecar(side_file, given)
        except FileNotFoundError:
            raise FileNotFoundError(f"$.captures[{e.index}].sidecar: {side_file} is "
                                    "missing") from None
        except ValueError as exc:
            raise ValueError(f"{exc} (in {side_file})") from None
        _check_entry(e, side)
        if not side.artifact.is_file():
            raise FileNotFoundError(f"$.captures[{e.index}].artifact: {side.artifact} is "
                                    "missing")
        unknown += side.snapshot.unknown
        merged = e.capture.get("merged", [])
        captures.append(_capture(side, e.members, e.weights_from,
                                 combined_status(e.fidelity, e.saved),
                                 doc.environment,
                                 tuple(m for m in merged if type(m) is int)
                                 if isinstance(merged, list) else ()))
    names = tuple(sorted(set(unknown)))
    warn_unknown(names, doc.path.name)
    return LoadedManifest(doc.path, doc.ctxreplay_version, doc.environment, doc.ok,
                          doc.probes, tuple(captures), tuple(not_saved),
                          doc.failures, doc.problems, names)


def _probe_map(probes: Probes) -> dict[str, ContextProbe[Any]] | None:
    if probes is None:
        return None
    if isinstance(probes, Mapping):
        return dict(probes)
    return {p.name: p for p in probes}


def load(path: str | os.PathLike[str], *,
         probes: Probes = None) -> LoadedManifest | LoadedCapture:
    """Open a directory written by ``report.save_all`` (or its
    ``manifest.json``) as a :class:`LoadedManifest`, or one capture written
    by ``Capture.save`` (the ``.pt2`` or its ``.pt2.json`` sidecar) as a
    :class:`LoadedCapture`.

    Every document is validated strictly (a malformed field raises
    ``ValueError`` naming its JSON path; a wrong kind of file says what was
    expected).  Probes the documents name that this process does not have
    load as opaque states, with one :class:`ctxreplay.UnknownProbeWarning`
    naming them; ``probes`` supplies instances for names the registry does
    not hold (a framework's forward-context probe).  Programs are loaded on
    first use.

    Args:
        path: a manifest directory or its ``manifest.json``, a ``.pt2`` or
            its ``.pt2.json`` sidecar.
        probes: probe instances for names the registry does not hold.

    Returns:
        A :class:`LoadedManifest` for a manifest, a :class:`LoadedCapture`
        for one saved capture.

    Raises:
        ValueError: a malformed document (naming its JSON path) or a file of
            another kind.
    """
    kind, target, data = detect(path)
    if kind == "manifest":
        return _load_manifest(target, data, probes)
    if kind in ("artifact", "sidecar"):
        return _load_single(target, probes)
    raise ValueError(f"$.schema: a report holds no artifacts; write them with "
                     f"report.save_all(directory) and load that directory (in {target})")
