"""Copies of live calls for ``verify="values"``: CPU copies of a variant's
first call -- its inputs taken before the forward can change them in place,
its outputs when it returns -- within one byte budget for the session."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

import torch

from ..capture.options import RetainedCall
from ..specs.signature import tensor_values

__all__ = ["Retention"]


def _nbytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _copies(tensors: Iterable[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    with torch.no_grad():
        return tuple(t.detach().to("cpu", copy=True) for t in tensors)


class Retention:
    """The session's byte budget for retained copies (``limit`` ``None``:
    values are not retained); ``held`` bytes are held now, ``skipped``
    variants were not retained for the budget."""

    __slots__ = ("held", "limit", "lock", "skipped")

    def __init__(self, limit: int | None, lock: threading.Lock) -> None:
        self.limit = limit
        self.lock = lock
        self.held = 0
        self.skipped = 0

    def summary(self) -> dict[str, int] | None:
        """The report's ``retained``: the cap, bytes held, variants not
        retained (``None`` without ``verify="values"``)."""
        if self.limit is None:
            return None
        return {"retain_bytes": self.limit, "retained_bytes": self.held,
                "not_retained": self.skipped}

    def inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any]
               ) -> tuple[torch.Tensor, ...] | None:
        """CPU copies of a call's input tensors, or ``None`` past the budget."""
        tensors = [t for a in (*args, *kwargs.values()) for t in tensor_values(a)]
        need = _nbytes(tensors)
        with self.lock:
            if self.limit is None or self.held + need > self.limit:
                self.skipped += 1
                return None
            self.held += need
        return _copies(tensors)

    def release(self, inputs: tuple[torch.Tensor, ...]) -> None:
        """Give back the budget of copies no longer kept."""
        with self.lock:
            self.held -= _nbytes(inputs)

    def call(self, inputs: tuple[torch.Tensor, ...], out: Any) -> RetainedCall | None:
        """The retained call once it returned ``out``; ``None`` (and the
        inputs' budget given back) when its outputs do not fit."""
        outs = tuple(tensor_values(out))
        need, have = _nbytes(outs), _nbytes(inputs)
        with self.lock:
            ok = self.held + need <= (self.limit or 0)
            if ok:
                self.held += need
            else:
                self.skipped += 1
                self.held -= have
        if not ok:
            return None
        return RetainedCall(inputs, _copies(outs), need + have)
