"""CPU numerics switches that change what kernels compute, never the graph:
the floating-point unit's denormal handling (``torch.set_flush_denormal``)
and oneDNN's (``torch.backends.mkldnn``) ``enabled`` and ``deterministic``
flags.

A probe of its own, not part of ``determinism`` or ``matmul_precision``:
flushing denormals is neither a determinism switch nor a matmul precision --
it is the CPU's floating-point environment, and it changes every float op
(a denormal input through a ``Linear`` comes out 0 instead of 1e-39).
oneDNN's two switches sit beside it because they too pick how CPU kernels
compute (oneDNN's or torch's native kernels; oneDNN's deterministic
algorithms), and because ``determinism``'s documents require exactly its
five fields, so a sixth would make every document written before unreadable.
oneDNN's float32 precision (``torch.backends.mkldnn.fp32_precision``,
``.matmul``, ``.conv``, ``.rnn``, torch >= 2.9) is ``matmul_precision``'s,
with every other per-backend value; oneDNN's ``allow_tf32`` acts on Intel
GPUs only (on a CPU build of torch 2.13 its getter returns ``None`` and its
setter only warns), so it is not observed.

**Reading the denormal mode.** Torch has no getter: ``set_flush_denormal``
returns only whether the CPU supports it.  It sets two bits of the FPU's
control register -- on x86 MXCSR's denormals-are-zero (a denormal operand
reads as 0) and flush-to-zero (a denormal result is written as 0); on ARM
FPCR's FZ, which does both.  That register is per thread and governs every
float operation of the thread, CPython's ``float`` arithmetic as much as
torch's CPU float32 kernels; so the probe reads the two bits from two
float multiplies -- a denormal scaled up to a normal number (0 exactly when
operands are flushed) and a normal number scaled down to a denormal (0
exactly when results are flushed, read from its bytes: under
denormals-are-zero a comparison would read a denormal as 0 too).  That is
≈ 0.3 µs, passes through no torch dispatch (no user mode, autocast or
tracer sees it), and is read once per call of the observed model
(``watch_forward``), never per block.  A CPU where ``set_flush_denormal``
returns ``False`` cannot change the mode: the probe observes the mode it
found when it was made, a constant, checks nothing per call, and
``describe`` says so.  Torch sets and clears both bits together; a state
with only one (set by other means) is observed as such, and a replay that
would have to set or restore one alone refuses before changing anything.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import attrs
import torch

from .._base.jsonread import read_bool, read_mapping
from ..core.probe import ContextProbe, applying
from ..core.registry import register_probe

__all__ = ["NumericsProbe", "NumericsState", "denormal_mode"]

# -- the denormal mode -----------------------------------------------------------

_DENORMAL = 5e-324                      # the smallest positive double: a denormal
_LIFT = 2.0 ** 60                       # scales it to a normal number (≈ 1.2e-305)
_SMALLEST_NORMAL = 2.2250738585072014e-308
_THREE = 3.0                            # divides it to a denormal (inexact)
_ZERO_BYTES = bytes(8)
_bytes_of = struct.Struct("<d").pack
_MODES = ((False, False), (True, False), (False, True), (True, True))


def denormal_mode() -> tuple[bool, bool]:
    """``(denormals_are_zero, flush_to_zero)`` of the calling thread's FPU:
    whether a denormal operand reads as 0, whether a denormal result is
    written as 0.  ``torch.set_flush_denormal(True)`` sets both (see the
    module docstring for why two float multiplies read them faithfully)."""
    return _MODES[(_DENORMAL * _LIFT == 0.0)
                  + 2 * (_bytes_of(_SMALLEST_NORMAL / _THREE) == _ZERO_BYTES)]


def _flush_settable() -> bool:
    """Whether ``torch.set_flush_denormal`` can change the mode on this CPU.
    Asked by setting the mode it is in (which changes nothing); a mode with
    one bit only was set by other means, so the unit has both."""
    daz, ftz = denormal_mode()
    if daz != ftz:
        return True
    return bool(torch.set_flush_denormal(daz))


# -- oneDNN's flags: the ones this torch has -------------------------------------

# (field, getter, setter, torch's default)
_MKLDNN_CANDIDATES = (("enabled", "_get_mkldnn_enabled", "_set_mkldnn_enabled", True),
                      ("deterministic", "_get_mkldnn_deterministic",
                       "_set_mkldnn_deterministic", False))
_MKLDNN: tuple[tuple[str, Callable[[], bool], Callable[[bool], None], bool], ...] = tuple(
    (f, getattr(torch._C, g), getattr(torch._C, s), d) for f, g, s, d in _MKLDNN_CANDIDATES
    if hasattr(torch._C, g) and hasattr(torch._C, s))
_MKLDNN_FIELDS = tuple(f for f, _, _, _ in _MKLDNN)


@attrs.frozen(cache_hash=True)
class NumericsState:
    """The denormal mode of the observing thread's FPU (both off in a fresh
    process; ``torch.set_flush_denormal(True)`` turns both on) and
    ``(flag, value)`` for each oneDNN flag this torch has
    (``torch.backends.mkldnn.enabled`` and ``.deterministic``)."""

    denormals_are_zero: bool = False
    flush_to_zero: bool = False
    mkldnn: tuple[tuple[str, bool], ...] = tuple((f, d) for f, _, _, d in _MKLDNN)

    @property
    def flush_denormal(self) -> bool | None:
        """What ``torch.set_flush_denormal`` last set: ``None`` when only one
        of the two bits is on (set by other means)."""
        return self.denormals_are_zero if self.denormals_are_zero == self.flush_to_zero else None


_NEUTRAL = NumericsState()


def _mkldnn_now() -> tuple[tuple[str, bool], ...]:
    return tuple((f, bool(get())) for f, get, _, _ in _MKLDNN)


@register_probe
class NumericsProbe(ContextProbe[NumericsState]):
    name = "numerics"
    description = ("flush-denormal mode of the CPU (torch.set_flush_denormal), oneDNN "
                   "enabled/deterministic")
    default = True

    def __init__(self) -> None:
        self.flush_settable = _flush_settable()
        """Whether ``torch.set_flush_denormal`` can change the mode on this
        CPU; ``False``: the mode is the constant found when the probe was made."""
        self._fixed = None if self.flush_settable else denormal_mode()
        self._last: NumericsState | None = None

    def _mode(self) -> tuple[bool, bool]:
        return denormal_mode() if self._fixed is None else self._fixed

    def observe(self) -> NumericsState:
        mode, mkldnn = self._mode(), _mkldnn_now()
        last = self._last
        if last is not None and (last.denormals_are_zero, last.flush_to_zero) == mode \
                and last.mkldnn == mkldnn:
            return last
        self._last = state = NumericsState(*mode, mkldnn)
        return state

    def watch(self, state: NumericsState) -> tuple[tuple[Callable[[], object], object], ...]:
        # Nothing here changes a traced graph: only what the kernels compute.
        return ()

    def watch_forward(self, state: NumericsState
                      ) -> tuple[tuple[Callable[[], object], object], ...]:
        # Invisible to torch's guard, numerics only: once per model call.  The
        # denormal mode is per thread, and this runs in the calling thread.
        want = dict(state.mkldnn)
        checks: list[tuple[Callable[[], object], object]] = [
            (get, want[f]) for f, get, _, _ in _MKLDNN if f in want]
        if self._fixed is None:
            checks.append((denormal_mode, _MODES[state.denormals_are_zero
                                                 + 2 * state.flush_to_zero]))
        return tuple(checks)

    def neutral_state(self) -> NumericsState:
        return _NEUTRAL

    def neutral(self, state: NumericsState) -> bool:
        return state == _NEUTRAL

    def replay(self, state: NumericsState) -> AbstractContextManager[None]:
        return self._replay(state)

    @contextmanager
    def _replay(self, state: NumericsState) -> Iterator[None]:
        self._refuse(self.observe(), state)
        with applying(self.observe, self._apply, state):
            yield

    def _refuse(self, now: NumericsState, target: NumericsState) -> None:
        """Raise, before anything changes, when torch cannot set the target's
        denormal mode or cannot put the current one back."""
        if (now.denormals_are_zero, now.flush_to_zero) == (target.denormals_are_zero,
                                                           target.flush_to_zero):
            return
        if not self.flush_settable:
            raise RuntimeError(f"numerics: the state needs {_describe_mode(target)}; this CPU "
                               "cannot change the denormal mode (torch.set_flush_denormal "
                               "returns False)")
        for which, s in (("set", target), ("restore", now)):
            if s.flush_denormal is None:
                raise RuntimeError(f"numerics: cannot {which} {_describe_mode(s)}: "
                                   "torch.set_flush_denormal sets both bits or neither")

    def _apply(self, state: NumericsState) -> None:
        if self._mode() != (state.denormals_are_zero, state.flush_to_zero):
            torch.set_flush_denormal(bool(state.denormals_are_zero))
        now = dict(_mkldnn_now())
        for f, _, set_, _ in _MKLDNN:
            want = dict(state.mkldnn).get(f)
            if want is not None and now[f] != want:
                set_(want)

    def encode(self, state: NumericsState) -> dict[str, Any]:
        return {"denormals_are_zero": state.denormals_are_zero,
                "flush_to_zero": state.flush_to_zero, "mkldnn": dict(state.mkldnn)}

    def decode(self, data: Any, path: str) -> NumericsState:
        fields = {"denormals_are_zero", "flush_to_zero", "mkldnn"}
        doc = read_mapping(data, path, keys=fields, required=fields)
        names = set(_MKLDNN_FIELDS)
        flags = read_mapping(doc["mkldnn"], f"{path}.mkldnn", keys=names, required=names)
        return NumericsState(
            read_bool(doc["denormals_are_zero"], f"{path}.denormals_are_zero"),
            read_bool(doc["flush_to_zero"], f"{path}.flush_to_zero"),
            tuple((f, read_bool(flags[f], f"{path}.mkldnn.{f}")) for f in _MKLDNN_FIELDS))

    def describe(self, state: NumericsState) -> str:
        parts = [f"mkldnn.{f}={v}" for f, v in state.mkldnn if (f, v) not in _NEUTRAL.mkldnn]
        if state.denormals_are_zero or state.flush_to_zero:
            parts.insert(0, _describe_mode(state))
        if not self.flush_settable:
            parts.append("denormal mode fixed: this CPU cannot flush denormals "
                         "(torch.set_flush_denormal returns False)")
        return ", ".join(parts) or "default"


def _describe_mode(state: NumericsState) -> str:
    if state.flush_denormal is not None:
        return f"flush_denormal={state.flush_denormal}"
    return ("denormals_are_zero only (flush_to_zero off)" if state.denormals_are_zero
            else "flush_to_zero only (denormals_are_zero off)")
