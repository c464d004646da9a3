"""The leak oracle: every test must leave global torch state (and the probe
registry) exactly as it found it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.utils.deterministic as det
from torch._C._dynamo.guards import GlobalStateGuard

import ctxreplay
from ctxreplay.testing import GlobalState, global_state, state_changes


@pytest.fixture(autouse=True)
def _leak_oracle(request: pytest.FixtureRequest) -> Iterator[None]:
    registered = dict(ctxreplay.available_probes())
    before = global_state()
    # Explicit names: a fresh observer, so no cached snapshot can hide a change.
    snap = ctxreplay.snapshot(ctxreplay.default_probes())
    guard = GlobalStateGuard()
    yield
    problems = state_changes(guard, before, snap)
    now_registered = dict(ctxreplay.available_probes())
    if now_registered != registered:
        added = sorted(set(now_registered) - set(registered))
        removed = sorted(set(registered) - set(now_registered))
        changed = sorted(n for n in set(registered) & set(now_registered)
                         if registered[n] != now_registered[n])
        problems.append(f"probe registry: added {added}, removed {removed}, changed {changed}")
    if problems:
        _restore(before)
        pytest.fail(
            f"{request.node.nodeid} leaked global state:\n  - " + "\n  - ".join(problems),
            pytrace=False,
        )


def _restore(s: GlobalState) -> None:
    """Best effort, so that one leaking test does not fail every later one."""
    torch.set_default_dtype(s.default_dtype)
    torch.use_deterministic_algorithms(s.deterministic_algorithms,
                                       warn_only=s.deterministic_warn_only)
    det.fill_uninitialized_memory = s.fill_uninitialized_memory  # type: ignore[attr-defined]
    torch.backends.cudnn.enabled = s.cudnn_enabled
    torch.backends.cudnn.benchmark = s.cudnn_benchmark
    torch.backends.cudnn.deterministic = s.cudnn_deterministic
    torch.backends.cudnn.allow_tf32 = s.cudnn_allow_tf32
    torch.set_float32_matmul_precision(s.float32_matmul_precision)
    for device, enabled, dtype in s.autocast:
        torch.set_autocast_enabled(device, enabled)
        torch.set_autocast_dtype(device, dtype)
    torch.set_autocast_cache_enabled(s.autocast_cache_enabled)
    torch.set_grad_enabled(s.grad_enabled)
