"""What this machine's torch can run, asked of torch itself, without ctxreplay.

A case that depends on what the CPU (or the torch build) can do asks here
once, and where torch alone cannot do it the case is marked as that torch
limit: a strict xfail whose reason says what torch raised and what it needs,
so it passes again the day torch (or the machine) can.

Measured with torch 2.7.0 and 2.13.0 (CPU builds), by capping the ISA torch
may use on an AVX-512 + AMX machine (``ATEN_CPU_CAPABILITY`` for ATen's
kernels, ``ONEDNN_MAX_CPU_ISA`` for oneDNN's) and on an AVX2-only machine:
of every op CPU autocast casts (tests/capture/test_op_coverage.py), only nn.LSTM's
bfloat16 path depends on the CPU: oneDNN's bf16 LSTM primitive needs its
``AVX512_CORE`` ISA or wider.  ``torch.backends.cpu.get_cpu_capability()``
does not tell: it reports ATen's dispatch level, which can say ``AVX512``
while oneDNN is capped at ``AVX2`` -- so the op itself is run.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from ctxreplay._base.torchcaps import CAPS

# what each CPU-dependent case needs, as measured (see the module docstring)
BF16_LSTM_NEEDS = "oneDNN's AVX512_CORE ISA or wider (AVX-512: F, BW, VL, DQ)"


def cpu_description() -> str:
    """The capabilities torch reports for this CPU, for a reason text."""
    mkldnn = torch.backends.mkldnn.is_available()
    return (f"torch {torch.__version__}, ATen CPU capability "
            f"{torch.backends.cpu.get_cpu_capability()}, oneDNN {'on' if mkldnn else 'off'}")


def refusal(run: Callable[[], Any]) -> str | None:
    """``None`` when ``run()`` works here; else the RuntimeError torch raised."""
    try:
        run()
    except RuntimeError as exc:
        return str(exc).splitlines()[0]
    return None


def _bf16_lstm() -> None:
    torch.manual_seed(0)
    lstm = nn.LSTM(3, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lstm(torch.rand(5, 2, 3))


@functools.cache
def bf16_lstm_refusal() -> str | None:
    """Why nn.LSTM cannot run under CPU bfloat16 autocast here, or ``None``."""
    return refusal(_bf16_lstm)


def torch_limit(error: str, needs: str) -> pytest.MarkDecorator:
    """The strict xfail of a case torch alone cannot run on this machine."""
    return pytest.mark.xfail(
        strict=True, raises=RuntimeError,
        reason=f"torch limit on this CPU ({cpu_description()}): torch alone raises "
               f"{error!r} (reproduced without ctxreplay); it needs {needs}")


#: whether ctxreplay folds sizes on this torch: folding needs a program that
#: checks its trace's size guards on every call (``CAPS.export_guards_sizes``);
#: where torch's do not (2.7), a test of folds asserts what a user meets
#: instead -- no capture folded, each observed size its own capture
FOLDS = CAPS.export_guards_sizes


class _Holder:
    """What ctxreplay's wrapper is to Dynamo: a plain slotted object, bound as
    a module's instance ``forward``, that reads its own attributes."""

    __slots__ = ("flag", "orig")

    def __init__(self, orig: Any) -> None:
        self.orig = orig
        self.flag = False

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.orig(*args, **kwargs)


@functools.cache
def dynamo_breaks_on_a_bound_holder() -> bool:
    """Whether Dynamo, with no ctxreplay involved, graph-breaks on a module
    whose forward is a method bound to a plain object (measured: torch 2.7.0
    breaks -- "Unexpected type in sourceless builder builtins.method" -- and
    2.9.1-2.14.1 do not)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    try:
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
        lin = model[0]
        lin.forward = types.MethodType(_Holder.forward, _Holder(lin.forward))
        torch.compile(model, backend="eager")(torch.rand(2, 8))
        return bool(torch._dynamo.utils.counters["graph_break"])
    finally:
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
