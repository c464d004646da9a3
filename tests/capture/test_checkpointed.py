"""Activation-checkpointed training: blocks run through
``torch.utils.checkpoint.checkpoint`` in training steps (forward, loss,
backward) are captured, and served after install with eager's gradients.

Non-reentrant checkpointing runs each block again in backward and stops
that rerun as soon as the tensors it needs are recomputed (torch raises
inside the block to stop it), so half the block calls never complete; the
reentrant form runs the block under ``no_grad`` and then again, whole, with
grad enabled.  The oracles are the test's own: forward hooks on each block
count the calls that started and the calls that completed, and the
gradients and outputs of the same steps run without ctxreplay.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import ctxreplay

DIM = 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=self.reentrant)
        return self.head(x)


@contextmanager
def block_calls(model: Checkpointed) -> Iterator[dict[str, int]]:
    """Block calls that started and that completed, counted by hooks."""
    seen = {"started": 0, "completed": 0}

    def started(*_: object) -> None:
        seen["started"] += 1

    def completed(*_: object) -> None:
        seen["completed"] += 1

    handles = [h for b in model.blocks
               for h in (b.register_forward_pre_hook(started), b.register_forward_hook(completed))]
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


def _step(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One training step's output and gradients (the parameters', the input's)."""
    model.zero_grad()
    x.grad = None
    out = model(x)
    out.pow(2).mean().backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    assert x.grad is not None and len(grads) == len(list(model.parameters()))
    return out.detach(), [*grads, x.grad.clone()]


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_checkpointed_training_is_captured_and_served_with_eager_gradients(
        reentrant: bool) -> None:
    torch.manual_seed(0)
    model = Checkpointed(reentrant).train()
    x = torch.rand(2, 4, DIM, requires_grad=True)
    with block_calls(model) as live, ctxreplay.capture_with(model, targets="repeated") as s:
        for _ in range(2):
            _step(model, x)
    report = s.finalize()
    assert report.ok, report.problems
    # every block call that completed is in a capture; a rerun stopped
    # midway (non-reentrant) is not a call of its own
    assert sum(c.calls for c in report.captures) == live["completed"]
    assert live["started"] == 2 * 3 * 2
    assert live["completed"] == (2 * 3 * 2 if reentrant else 2 * 3)

    want_out, want_grads = _step(model, x)
    with block_calls(model) as served, ctxreplay.install(model, report) as handle:
        got_out, got_grads = _step(model, x)
        stats = handle.stats()
    # each completed block call ran a captured graph, none eagerly
    assert stats.total_hits == served["completed"] > 0
    assert sum(stats.misses.values()) == 0 and not stats.reasons
    torch.testing.assert_close(got_out, want_out)
    for got, want in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(got, want)
