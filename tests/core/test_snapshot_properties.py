"""Property tests: any combination of states, set with torch's own API, is
reproduced exactly by replaying its snapshot; replays nest and follow each
other without leaking."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
import torchstate as ts
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ctxreplay
from ctxreplay.testing import GlobalState, global_state, leak_check

# Every dtype torch.set_default_dtype accepts (float8 and complex are refused).
DEFAULT_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]

SPECS = st.fixed_dictionaries({
    "autocast": st.sampled_from([None, torch.bfloat16, torch.float16]),
    "autocast_cache": st.booleans(),
    "grad": st.sampled_from(["grad", "no_grad", "inference", "inference_grad"]),
    "deterministic": st.booleans(),
    "warn_only": st.booleans(),
    "cudnn_deterministic": st.booleans(),
    "cudnn_benchmark": st.booleans(),
    "fill": st.booleans(),
    "dtype": st.sampled_from(DEFAULT_DTYPES),
    "precision": st.sampled_from(["highest", "high", "medium"]),
    "cudnn_tf32": st.booleans(),
    "device": st.sampled_from(["cpu", "meta"]),
})
SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


@contextmanager
def entered(spec: dict[str, Any]) -> Iterator[None]:
    """The state ``spec`` describes, entered with torch's API; restored on exit."""
    with ExitStack() as stack:
        enter = stack.enter_context
        if spec["autocast"] is not None:
            enter(torch.autocast("cpu", dtype=spec["autocast"],
                                 cache_enabled=spec["autocast_cache"]))
        else:
            enter(ts.autocast_cache(spec["autocast_cache"]))
        if spec["grad"] == "no_grad":
            enter(torch.no_grad())
        elif spec["grad"] == "inference":
            enter(torch.inference_mode())
        elif spec["grad"] == "inference_grad":
            enter(ts.inference_with_grad())
        enter(ts.deterministic(spec["deterministic"], warn_only=spec["warn_only"]))
        enter(ts.setting(torch._C._get_cudnn_deterministic, torch._C._set_cudnn_deterministic,
                         spec["cudnn_deterministic"]))
        enter(ts.setting(torch._C._get_cudnn_benchmark, torch._C._set_cudnn_benchmark,
                         spec["cudnn_benchmark"]))
        enter(ts.fill_uninitialized_memory(spec["fill"]))
        enter(ts.default_dtype(spec["dtype"]))
        enter(ts.cudnn_allow_tf32(spec["cudnn_tf32"]))
        enter(ts.matmul_precision(spec["precision"]))
        if spec["device"] != "cpu":
            enter(torch.device(spec["device"]))
        yield


def effective(g: GlobalState) -> GlobalState:
    """The state as it acts: without the mode-stack depth (a replay of the
    "cpu" default device inside a "meta" one pushes a mode where the original
    pushed none) and without the autocast dtype of devices whose autocast is
    off (the probe does not carry it; ``leak_check`` still compares it)."""
    return g._replace(
        torch_function_modes=0,
        autocast=tuple((d, on, dtype if on else None) for d, on, dtype in g.autocast),
    )


def observed(spec: dict[str, Any]) -> tuple[ctxreplay.ContextSnapshot, GlobalState]:
    with entered(spec):
        snap = ctxreplay.snapshot()
        # The cached default observer must agree with a fresh one.
        assert snap == ctxreplay.snapshot(ctxreplay.probes.default_probes())
        return snap, effective(global_state())


@SETTINGS
@given(spec=SPECS)
def test_replay_reproduces_any_combination(spec: dict[str, Any]) -> None:
    with leak_check("property example"):
        neutral = ctxreplay.snapshot()
        snap, live = observed(spec)
        assert ctxreplay.snapshot() == neutral
        with snap.replay():
            assert ctxreplay.snapshot() == snap
            assert ctxreplay.snapshot(ctxreplay.probes.default_probes()) == snap
            assert effective(global_state()) == live  # blind spots included
        assert ctxreplay.snapshot() == neutral

        back = ctxreplay.ContextSnapshot.from_json(snap.to_json())
        assert back == snap
        with back.replay():
            assert effective(global_state()) == live


class Boom(Exception):
    pass


@SETTINGS
@given(a=SPECS, b=SPECS)
def test_nested_and_sequential_replays_leak_nothing(a: dict[str, Any],
                                                    b: dict[str, Any]) -> None:
    neutral = ctxreplay.snapshot()
    sa, ga = observed(a)
    sb, gb = observed(b)
    with leak_check("nested and sequential replays"):
        with sa.replay():
            assert ctxreplay.snapshot() == sa
            with sb.replay():
                assert ctxreplay.snapshot() == sb
                assert effective(global_state()) == gb
            assert ctxreplay.snapshot() == sa
            assert effective(global_state()) == ga
            try:
                with sb.replay():
                    raise Boom
            except Boom:
                pass
            assert ctxreplay.snapshot() == sa
            assert effective(global_state()) == ga
        assert ctxreplay.snapshot() == neutral
        for snap, g in ((sb, gb), (sa, ga), (sb, gb)):
            with snap.replay():
                assert ctxreplay.snapshot() == snap
                assert effective(global_state()) == g
            assert ctxreplay.snapshot() == neutral
