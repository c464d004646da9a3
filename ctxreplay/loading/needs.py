"""What a saved or live capture needs where it runs, and what differs now.

What a capture needs is what its files were verified under
(``verify.neutral_replay``): every probe it does not carry (``ambient_only``)
at the state the live call had, every other probe either neutral or at that
same state; the torch it was made with; the accelerator its tensors live on
(and that accelerator's capability); torch's autocast op policy for those
devices; and a fidelity check that passed.  ``check_needs`` says, per probe
or field, what differs (empty when all holds).  A probe this process does
not have cannot be checked: when the capture needs its state re-established,
that is a difference too -- never a silent pass.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch

from .._base.environment import autocast_policy, capability, device_available
from .._base.jsonread import read_int, read_list, read_mapping, read_str
from ..core.probe import ContextProbe
from ..core.snapshots import ContextSnapshot, UnknownProbe, UnknownState, Unresolved, describe_state
from ..fidelity.verify import fidelity_status, is_neutral
from ..report.manifest import entry_devices
from ..specs.signature import TensorSpec, tensor_leaves

__all__ = ["DIFFERENCE_KINDS", "ENVIRONMENT_FIELDS", "Difference", "Needs", "Probes",
           "check_needs", "devices_of", "document_fidelity", "merge_differences",
           "needs_from_document", "needs_of", "observe_all", "probe_map", "state_differences",
           "static_differences"]

#: ``Difference.kind``: a probe's state, the environment, the fidelity check,
#: why ``install`` can never dispatch the capture (``field``: the reason code),
#: a call's sizes outside a folded capture's ranges, or its files (``field``:
#: a file name, unverified or not what the manifest recorded)
DIFFERENCE_KINDS = ("state", "environment", "fidelity", "dispatch", "sizes", "files")
#: ``Difference.field`` of an ``environment`` difference
ENVIRONMENT_FIELDS = ("torch", "device", "capability", "autocast_policy")

#: probe instances for names the registry does not hold
Probes = Iterable[ContextProbe[Any]] | Mapping[str, ContextProbe[Any]] | None


def probe_map(probes: Probes) -> dict[str, ContextProbe[Any]] | None:
    """``probes`` as ``name -> probe`` (``None`` stays ``None``)."""
    if probes is None:
        return None
    if isinstance(probes, Mapping):
        return dict(probes)
    return {p.name: p for p in probes}


def document_fidelity(doc: Mapping[str, Any], key: str) -> str:
    """The fidelity status a document records under ``key`` (``"unchecked"``
    when it records none), checked strictly."""
    value = doc.get(key)
    if value is None:
        return "unchecked"
    return fidelity_status(value, f"$.{key}")

@attrs.frozen
class Difference:
    """One thing that differs between now and what a capture needs.

    ``kind``: ``"state"`` (a probe: ``field`` is its name), ``"environment"``
    (``torch``, ``device``, ``capability``, ``autocast_policy``),
    ``"fidelity"``, or ``"dispatch"`` (``field`` is the reason ``install``
    gives for never dispatching it: ``mutates_argument``,
    ``not_rebuildable``); ``needed`` / ``found`` say it in words;
    ``captures`` lists the ``scope#variant`` labels it concerns.  ``str()``
    is one line."""

    field: str
    """What differs: a probe's name, an environment field (``torch``, ``device``, ``capability``,
    ``autocast_policy``), ``fidelity``, or a dispatch reason code."""
    needed: str
    """What the capture needs, in words."""
    found: str
    """What this process has now, in words."""
    kind: str = "state"
    """One of ``DIFFERENCE_KINDS``: ``state``, ``environment``, ``fidelity``, ``dispatch``,
    ``sizes`` (a call's sizes outside the ranges a folded capture was verified over) or
    ``files`` (a file its manifest records no digest of, or one that does not hold what it
    recorded)."""
    captures: tuple[str, ...] = ()
    """The ``scope#variant`` labels it concerns."""

    @property
    def text(self) -> str:
        """The difference as one line of words."""
        if self.kind == "environment":
            line = f"{self.field}: made with {self.needed}, now {self.found}"
        elif self.kind in ("fidelity", "dispatch", "files"):
            line = f"{self.field}: {self.found}"
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



def devices_of(specs: Iterable[TensorSpec]) -> frozenset[str]:
    """The device types of ``specs``."""
    return frozenset(s.device.split(":")[0] for s in specs)


def needs_of(capture: Any) -> Needs:
    """The needs of a live ``ctxreplay.Capture`` (made in this process)."""
    specs = [s for _, s in capture.signature.leaves()]
    if capture.outputs is not None:
        specs += [s for _, s in tensor_leaves(capture.outputs)]
    return Needs(f"{capture.scope}#{capture.variant}", capture.snapshot,
                 tuple(capture.ambient_only), capture.snapshot.describe(), None,
                 devices_of(specs), capture.fidelity.status)


def needs_from_document(capture: Any, environment: Mapping[str, Any] | None, path: str,
                        probes: Probes = None) -> Needs:
    """The needs of a capture record in a report or manifest
    (``Capture.to_json()``), checked strictly where used; unknown probes
    load as opaque states (``.snapshot.unknown``)."""
    doc = read_mapping(capture, path, required={"scope", "variant", "snapshot",
                                                "ambient_only", "fidelity", "inputs"})
    snap = ContextSnapshot.from_json(doc["snapshot"], probe_map(probes),
                                     path=f"{path}.snapshot", unknown="opaque")
    ambient = tuple(read_str(v, f"{path}.ambient_only[{i}]")
                    for i, v in enumerate(read_list(doc["ambient_only"], f"{path}.ambient_only")))
    context = doc.get("context")
    label = f"{read_str(doc['scope'], f'{path}.scope', max_len=4096)}#" \
            f"{read_int(doc['variant'], f'{path}.variant', lo=0)}"
    return Needs(label, snap, ambient, dict(context) if isinstance(context, Mapping) else {},
                 environment if environment is not None else {"torch": "unknown"},
                 frozenset(entry_devices([doc["inputs"], doc.get("outputs")])),
                 document_fidelity(doc, "fidelity"))


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


def observe_all(probes: Iterable[ContextProbe[Any]]) -> dict[str, Any]:
    """``name -> state`` of each probe now; an exception for one that cannot observe."""
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
    current = observe_all(needs.observable(ignore))
    return tuple(static_differences(needs, ignore) + state_differences(needs, current, ignore))
