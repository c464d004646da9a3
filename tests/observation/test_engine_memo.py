"""The hit path: a repeat of a member's last variant is answered by its memo
(``observe._Member.forward``) -- one check of the ambient state, one of the
inputs.  Whatever that path skips must still split variants and count calls
exactly as observing every call from scratch would."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

import ctxreplay
from ctxreplay.probes.mode_stack import ModeStackProbe


class Attn(nn.Module):
    """Calls SDPA, so the attention-backend flags shape its graph."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        q = self.lin(x).view(1, 2, -1, 4) * scale
        return F.scaled_dot_product_attention(q, q, q).reshape(x.shape)


class Shift(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


STATES: dict[str, Callable[[], AbstractContextManager[Any]]] = {
    "no_grad": torch.no_grad,
    "inference_mode": torch.inference_mode,
    "cpu_autocast_bf16": lambda: torch.autocast("cpu", dtype=torch.bfloat16),
    "sdpa_math": lambda: sdpa_kernel([SDPBackend.MATH]),
    "torch_function_mode": lambda: _SHIFT,  # one instance, re-entered
}
_SHIFT = Shift()


class Parent(nn.Module):
    """Calls its block under ``outer`` for the first and last three calls and
    under ``inner`` for the middle three -- inside one forward, where only the
    per-call check can tell."""

    def __init__(self, inner: Callable[[], AbstractContextManager[Any]],
                 with_scalar: bool) -> None:
        super().__init__()
        self.block = Attn()
        self.inner = inner
        self.with_scalar = with_scalar

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        args: tuple[Any, ...] = (x, 0.5) if self.with_scalar else (x,)
        out = x
        for i in range(9):
            with self.inner() if 3 <= i < 6 else nullcontext():
                out = out + self.block(*args)
        return out


@pytest.mark.parametrize("with_scalar", [False, True], ids=["tensors", "tensor+float"])
@pytest.mark.parametrize("state", sorted(STATES))
def test_a_state_entered_between_repeats_splits_the_variant(state: str,
                                                            with_scalar: bool) -> None:
    """Same inputs, same member; only the ambient state differs for calls 4-6.
    A float argument makes the memo check the Python key, not TensorGuards."""
    model = Parent(STATES[state], with_scalar).eval()
    x = torch.rand(4, 8)
    # torch function modes are the opt-in mode_stack probe's (here re-entered)
    probes = [*ctxreplay.probes.default_probes(), ModeStackProbe(replay_instances=True)]
    outer = torch.no_grad() if state == "inference_mode" else nullcontext()
    with outer, ctxreplay.capture_with(model, targets=["block"], backend="export",
                                       probes=probes) as session:
        model(x)
        model(x)
    report = session.finalize()
    assert sorted(c.calls for c in report.captures) == [6, 12], (state, report.captures)
    assert report.ok, report.failures


def test_two_members_alternating_count_every_call_once() -> None:
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = Attn(), Attn()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for _ in range(5):
                x = self.b(self.a(x))
            return x

    model = Two().eval()
    # each size its own graph (fold=False), so each is a variant counted apart
    with torch.no_grad(), ctxreplay.capture_with(model, targets=["a", "b"],
                                                  backend="export", fold=False) as session:
        for _ in range(3):
            model(torch.rand(4, 8))
        model(torch.rand(2, 4, 8).view(8, 8))  # another shape: a second variant
    report = session.finalize()
    assert report.ok, report.failures
    assert sorted(c.calls for c in report.captures) == [10, 30]  # per-member calls, by value


def test_a_held_wrapper_observes_nothing_after_close() -> None:
    """Closing drops the memo: a wrapper that another tool still calls (it
    took ``block.forward`` while the session was open) records no call."""
    model = Parent(nullcontext, False).eval()
    with torch.no_grad():
        session = ctxreplay.capture_with(model, targets=["block"], backend="export")
        model(torch.rand(4, 8))
        held = model.block.forward
        held(torch.rand(4, 8))
        session.close()
        for _ in range(3):
            held(torch.rand(4, 8))
    report = session.finalize()
    assert [c.calls for c in report.captures] == [10]


def test_another_argument_count_is_another_variant_on_both_memo_kinds() -> None:
    """The memo keeps no argument count: its input check must fail on one."""

    class Optional(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor, y: Any = None) -> torch.Tensor:
            out = self.lin(x)
            return out if y is None else out * y

    model = Optional().eval()
    x = torch.rand(4, 8)
    with torch.no_grad(), ctxreplay.capture_with(model, backend="export") as session:
        for args in [(x,), (x,), (x, x), (x, x), (x, x), (x,), (x, 2.0), (x, 2.0), (x,)]:
            model(*args)
    report = session.finalize()
    assert report.ok, report.failures
    assert sorted(c.calls for c in report.captures) == [2, 3, 4]
