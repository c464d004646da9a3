"""What capture is asked to do: the session's options, validated once, and
the per-variant request (the calls of each member, what they returned, the
live copies ``verify="values"`` keeps).

Records only: they import no behaviour above them.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from ..backends import Backend
from ..core.probe import ContextProbe
from ..core.snapshots import ContextSnapshot
from ..fidelity.levels import DEFAULT as DEFAULT_LEVEL
from ..fidelity.levels import level
from ..specs.baked import Source
from ..specs.signature import CallSpec, Spec, is_native

__all__ = ["NO_ATTRIBUTE", "REPLAY_MODES", "RETAIN_BYTES", "WATCH_MODES", "CaptureOptions",
           "MemberCall", "RetainedCall", "Unrestorable", "VariantRequest"]

REPLAY_MODES = ("embedded", "ambient", "off")
#: the default cap on retained copies of live calls: 1 GiB of CPU memory
RETAIN_BYTES = 1 << 30
WATCH_MODES = ("forward", "call")


@attrs.frozen
class CaptureOptions:
    """Every setting of a session, validated once, read by capture, explain
    and the report (``to_json``: the report's ``settings``)."""

    probes: tuple[ContextProbe[Any], ...]
    backend: Backend
    targets: str = "None"
    replay: str = attrs.field(default="embedded", validator=attrs.validators.in_(REPLAY_MODES))
    verify: str = attrs.field(default=DEFAULT_LEVEL, validator=lambda _i, _a, v: level(v))
    max_variants: int = 8
    max_scopes: int = 64
    profile_ranges: bool = False
    capture_timeout: float | None = None
    pin_factories: bool = True
    watch: str = attrs.field(default="forward", validator=attrs.validators.in_(WATCH_MODES))
    retain_bytes: int = RETAIN_BYTES
    ignore_attributes: tuple[str, ...] = ()
    #: the capture cache directory (``None``: no cache)
    cache: str | None = None
    #: variants that differ in sizes only are captured as one graph with
    #: dynamic sizes where the backend can (``capture.fold``)
    fold: bool = True
    #: a ``torch.distributed`` process group (``None``: the default group
    #: when one is initialised); ``finalize()`` is then a collective over it
    group: Any = attrs.field(default=None, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        for name in ("max_variants", "max_scopes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive integer, got {value!r}")
        if isinstance(self.retain_bytes, bool) or not isinstance(self.retain_bytes, int) \
                or self.retain_bytes < 0:
            raise ValueError(f"retain_bytes: expected a byte count >= 0, got "
                             f"{self.retain_bytes!r}")
        t = self.capture_timeout
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float))
                              or not t > 0):
            raise ValueError(f"capture_timeout: expected seconds > 0, got {t!r}")

    @property
    def probe_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.probes)

    def to_json(self) -> dict[str, Any]:
        return {"replay": self.replay, "verify": self.verify, "max_variants": self.max_variants,
                "max_scopes": self.max_scopes, "targets": self.targets,
                "backend": self.backend.name, "pin_factories": self.pin_factories,
                "watch": self.watch, "retain_bytes": self.retain_bytes,
                "capture_timeout": self.capture_timeout,
                "ignore_attributes": list(self.ignore_attributes), "cache": self.cache,
                "fold": self.fold}


@attrs.frozen(eq=False)
class RetainedCall:
    """CPU copies of one live call (``verify="values"``): the input tensors in
    ``CallSpec.leaves()`` order, the output tensors in output order."""

    inputs: tuple[torch.Tensor, ...] = attrs.field(repr=False)
    outputs: tuple[torch.Tensor, ...] = attrs.field(repr=False)
    nbytes: int = 0


@attrs.frozen(eq=False)
class MemberCall:
    """One member's share of a variant: its calls, its first live output and
    (``verify="values"``) the calls retained, checked by value one by one."""

    name: str
    calls: int
    outputs: Spec | None
    completed: bool
    retained: tuple[RetainedCall, ...] = attrs.field(default=(), repr=False)
    #: what the member's repeat live calls wrote in the Python state its
    #: forward keeps (``where: what``, as ``pystate.Reach.changes`` says it)
    writes: tuple[str, ...] = ()
    #: calls due to be retained that the ``retain_bytes`` budget did not
    #: keep (not copied, or given up to make room): never compared by value
    not_retained: int = 0
    #: the places the member's code reads beside its arguments and weights
    #: (``cfg``, ``global knobs.MODE``) seen holding something else from one
    #: call to the next, and how often (``observation.places``)
    moved: tuple[tuple[Source, int], ...] = ()


@attrs.frozen
class Unrestorable:
    """A recorded attribute value that could not be copied when it was
    observed: a capture that needs it back fails (``state_not_restorable``)
    instead of running with the value finalize() finds."""

    type_name: str


#: in ``VariantRequest.state``: the attribute did not exist when the variant ran
NO_ATTRIBUTE = Unrestorable("<absent>")


@attrs.frozen(eq=False)
class VariantRequest:
    """One variant to capture: the first completed member is traced (its
    weights are the artifact's); every member's calls are verified."""

    scope: str
    variant: int
    snapshot: ContextSnapshot
    inputs: CallSpec
    members: tuple[MemberCall, ...]
    #: ``(submodule path, training)`` the members had when the variant ran:
    #: capture and checks put every view in that mode, whatever the model is
    #: in by finalize()
    training: tuple[tuple[str, bool], ...] = ()
    #: ``targets.identity_digest`` of the members' identity when it ran
    identity: str = ""
    #: ``(submodule path, attribute, value)``: the plain attributes (callables
    #: included) the members held when the variant ran; capture and checks
    #: put back on every view those that differ now
    state: tuple[tuple[str, str, Any], ...] = attrs.field(default=(), repr=False)
    #: the number of the members' identity in its scope (``-1``: not known):
    #: two identities may share a digest (callables are keyed by ``id()``,
    #: which no digest holds), never a number
    identity_number: int = -1

    @property
    def traced(self) -> MemberCall:
        for m in self.members:
            if m.completed:
                return m
        return self.members[0]

    @property
    def outputs(self) -> Spec | None:
        return self.traced.outputs

    @property
    def calls(self) -> int:
        return sum(m.calls for m in self.members)

    @property
    def flatten_out(self) -> bool:
        """Whether its graph returns the tensor leaves of its output: an
        output torch's pytree does not know cannot be returned whole."""
        return not (self.outputs is None or is_native(self.outputs))

    @property
    def binding(self) -> str:
        """How its call is bound: ``"native"`` (the module's own arguments)
        where torch's pytree knows its inputs and outputs, else
        ``"flattened"`` (the call's tensor leaves, positionally)."""
        return "native" if self.inputs.is_pytree_native() and not self.flatten_out \
            else "flattened"
