"""A capture's program behind a per-call check: ``GuardedCapture``.

The guarded call checks on every call through the observation fast path: a
snapshot cached behind ``GlobalStateGuard().check()`` plus the probes'
watched getters (``observer.Observer``), compared by identity with the last
snapshot that passed.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ..core.observer import Observer
from ..core.snapshots import ContextSnapshot
from ..errors import Error, Warning
from ..specs.dims import Folding
from ..specs.signature import call_tensors
from .needs import (
    Difference,
    Needs,
    check_needs,
    observe_all,
    state_differences,
    static_differences,
)

__all__ = ["GUARD_MODES", "GuardError", "GuardWarning", "GuardedCapture"]

Tensor = torch.Tensor


def _shapes(args: tuple[Any, ...], kwargs: dict[str, Any],
            order: tuple[str, ...] = ()) -> tuple[Any, ...]:
    """The shapes of a call's tensor leaves, in the captured call's order
    (``CallSpec.leaves()``): keyword arguments in the order the capture
    recorded them (``order``), whatever order this call passes them in."""
    if not kwargs:
        for a in args:
            if type(a) is not Tensor:
                break
        else:  # positional tensors only: the common case, read directly
            return tuple([a.shape for a in args])
    if kwargs:
        names = [n for n in order if n in kwargs] + [n for n in kwargs if n not in order]
        kwargs = {n: kwargs[n] for n in names}
    return tuple([t.shape for t in call_tensors(args, kwargs)])


def _fixed_dims(shapes: tuple[tuple[int, ...], ...] | None,
                folding: Folding | None) -> tuple[tuple[int, ...], ...] | None:
    """The captured shapes with each size a call may change (a folded
    dimension, or a nested tensor's ``-1``) as ``-1``; ``None`` when the
    shapes are not known."""
    if shapes is None:
        return None
    free = {(d.leaf, d.dim) for d in folding.dims} if folding is not None else set()
    return tuple(tuple(-1 if (i, j) in free else n for j, n in enumerate(shape))
                 for i, shape in enumerate(shapes))


def _takes(fixed: tuple[tuple[int, ...], ...] | None, shapes: tuple[Any, ...]) -> bool:
    """Whether a call's leaf ``shapes`` keep every fixed size."""
    if fixed is None:
        return True
    if len(fixed) != len(shapes):
        return False
    return all(len(want) == len(got) and all(w == -1 or w == g for w, g in zip(want, got))
               for want, got in zip(fixed, shapes))


def _listed(shapes: Iterable[Any]) -> str:
    """Leaf shapes in words: ``(2, 7, 8), (7,)``."""
    return ", ".join(str(tuple(s)) for s in shapes) or "(no tensors)"


#: ``on_mismatch``: what a guarded call does on a difference
GUARD_MODES = ("raise", "warn", "fallback")


class GuardError(Error, RuntimeError):
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


class GuardWarning(Warning):
    """A guarded call ran although the process differs from what the capture
    needs (``on_mismatch="warn"``); once per distinct state."""


class GuardedCapture:
    """A capture's program behind a per-call check (made by
    :meth:`LoadedCapture.guarded`).  ``mismatches`` counts calls that found
    a difference; ``check()`` is the check now."""

    __slots__ = ("_fallback", "_fits", "_fixed", "_folding", "_label", "_mode", "_needs",
                 "_observer", "_ok", "_order", "_run", "_shapes", "_static", "_verdicts",
                 "ignore", "mismatches")

    def __init__(self, needs: Needs, run: Callable[..., Any], *, on_mismatch: str = "raise",
                 fallback: Callable[..., Any] | None = None,
                 ignore: Iterable[str] = (), folding: Folding | None = None,
                 kwarg_order: tuple[str, ...] = (),
                 shapes: tuple[tuple[int, ...], ...] | None = None) -> None:
        if on_mismatch not in GUARD_MODES:
            raise ValueError(f"on_mismatch: {on_mismatch!r} is not one of {list(GUARD_MODES)}")
        if on_mismatch == "fallback" and not callable(fallback):
            raise ValueError("on_mismatch='fallback' needs fallback=<a callable taking the "
                             "same arguments>")
        self._needs, self._run, self._mode, self._fallback = needs, run, on_mismatch, fallback
        self._label = needs.label
        #: a folded capture's sizes: each call's are checked against its ranges
        #: (keyword arguments read in the captured order, ``kwarg_order``)
        self._folding = folding
        self._order = kwarg_order
        #: the captured call's leaf shapes (``None``: not known, not checked);
        #: a dimension the folding makes dynamic, or ``-1``, takes any size
        self._shapes = shapes
        self._fixed = _fixed_dims(shapes, folding)
        #: shapes of the calls seen -> whether the program takes them
        self._fits: dict[tuple[Any, ...], bool] = {}
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
            return self._sized(args, kwargs)
        return self._slow(snap, args, kwargs)

    def _sized(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run the program on a call whose state passed, if it takes the call's
        sizes: a fixed-size program takes its captured shapes alone (torch's
        own input check would raise on any other), a folded one the sizes in
        its ranges."""
        if self._folding is None and self._shapes is None:
            return self._run(*args, **kwargs)
        try:
            shapes = _shapes(args, kwargs, self._order)
        except Exception:  # a leaf with no single size (a nested tensor): not read
            return self._run(*args, **kwargs)
        fits = self._fits.get(shapes)
        if fits is None:
            fits = self._fit(shapes)
        if not fits:
            return self._mismatch(self._sizes(shapes), args, kwargs, True)
        if self._folding is None:
            return self._run(*args, **kwargs)
        return self._folded(args, kwargs)

    def _fit(self, shapes: tuple[Any, ...]) -> bool:
        """Whether the program takes ``shapes``, remembered (bounded: sizes
        that change on every call are looked at anew)."""
        fits = _takes(self._fixed, shapes) and (self._folding is None
                                                 or self._folding.within(shapes))
        if len(self._fits) >= 4096:
            self._fits.clear()
        self._fits[shapes] = fits
        return fits

    def _folded(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A folded program on sizes in its ranges: its own guard may still
        refuse them (torch.export's input guards, e.g. ``x.size()[1] != 7``
        where the trace took one side of a branch) -- a sizes difference."""
        try:
            return self._run(*args, **kwargs)
        except AssertionError as exc:
            if not str(exc).startswith("Guard failed"):
                raise
            assert self._folding is not None
            refused = (Difference("sizes", "; ".join(self._folding.describe()),
                                  f"refused by the graph's own guard ({str(exc)[:200]})",
                                  "sizes", (self._label,)),)
        return self._mismatch(refused, args, kwargs, True)

    def _sizes(self, shapes: tuple[Any, ...]) -> tuple[Difference, ...]:
        """A call's sizes the program does not take, as a difference."""
        folding = self._folding
        if folding is not None and not folding.within(shapes):
            needed = "; ".join(folding.describe())
            found = ", ".join(f"{d.path}[{d.dim}] = {shapes[d.leaf][d.dim]}"
                              if d.leaf < len(shapes) and d.dim < len(shapes[d.leaf])
                              else f"{d.path}[{d.dim}] missing" for d in folding.dims)
        else:  # a size the capture holds fixed
            needed = "the captured shapes " + _listed(self._shapes or ())
            if folding is not None:
                needed += " outside its folded dimensions"
            found = _listed(shapes)
        return (Difference("sizes", needed, found, "sizes", (self._label,)),)

    def check(self) -> tuple[Difference, ...]:
        """What differs now (as :meth:`LoadedCapture.check`)."""
        return check_needs(self._needs, self.ignore)

    def _slow(self, snap: ContextSnapshot | None, args: tuple[Any, ...],
              kwargs: dict[str, Any]) -> Any:
        found = self._verdicts.get(snap) if snap is not None else None
        first = found is None
        if found is None:
            current = dict(snap.items()) if snap is not None else \
                observe_all(self._needs.observable(self.ignore))
            found = self._static + tuple(state_differences(self._needs, current, self.ignore))
            if snap is not None:
                if len(self._verdicts) >= 256:  # a state that changes every call
                    self._verdicts.clear()
                self._verdicts[snap] = found
        if not found:
            self._ok = snap
            return self._sized(args, kwargs)
        return self._mismatch(found, args, kwargs, first)

    def _mismatch(self, found: tuple[Difference, ...], args: tuple[Any, ...],
                  kwargs: dict[str, Any], first: bool) -> Any:
        self.mismatches += 1
        if self._mode == "raise":
            raise GuardError(self._label, found)
        if self._mode == "warn":
            if first:
                warnings.warn(str(GuardError(self._label, found)), GuardWarning, stacklevel=3)
            return self._run(*args, **kwargs)
        assert self._fallback is not None
        return self._fallback(*args, **kwargs)

