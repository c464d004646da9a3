"""CUDA: autocast to float16 and bfloat16, and TF32 / float32 matmul precision,
observed during the live forward and replayed at capture.

Skipped cleanly without a CUDA device.  Every test restores the flags it sets
(the leak oracle in conftest.py checks).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch import nn

import ctxreplay
from ctxreplay.fidelity.verify import flat_tensor_spec

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]


class Block(nn.Module):
    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # no residual: adding the (float32) input would promote the output
        out: torch.Tensor = self.down(nn.functional.gelu(self.up(self.norm(x))))
        return out


class Net(nn.Module):
    def __init__(self, depth: int = 2, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList([Block(dim) for _ in range(depth)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return x


def _dtypes(spec: Any) -> list[torch.dtype]:
    return [s.dtype for s in flat_tensor_spec(spec).items]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
def test_cuda_autocast_is_replayed_and_carried(dtype: torch.dtype) -> None:
    if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        pytest.skip("this CUDA device has no bfloat16 support")
    torch.manual_seed(0)
    model = Net().cuda().eval()
    with ctxreplay.capture_with(model, targets="repeated", verify="execute") as session, \
            torch.autocast("cuda", dtype=dtype), torch.inference_mode():
        live = model(torch.rand(2, 8, 32, device="cuda"))
    assert live.dtype == dtype
    report = session.finalize()
    assert report.ok, [(c.scope, c.fidelity.mismatches) for c in report.captures]
    assert not report.failures
    assert report.captures
    for c in report.captures:
        assert c.snapshot["autocast"].dtype_for("cuda") == dtype
        assert c.snapshot["autocast"].dtype_for("cpu") is None
        assert c.snapshot.describe()["autocast"].startswith("cuda:")
        assert "autocast" in c.embedded
        assert c.fidelity.checked == ("signature", "execute")
        assert _dtypes(c.outputs) == _dtypes(c.graph_outputs)
        assert torch.device(flat_tensor_spec(c.graph_outputs).items[0].device).type == "cuda"  # type: ignore[union-attr]
        # the artifact alone, outside autocast, on fresh CUDA inputs
        assert not torch.is_autocast_enabled("cuda")
        spec = c.signature.args[0]
        out = c.artifact.module()(torch.rand(spec.shape, device="cuda",  # type: ignore[union-attr]
                                             dtype=spec.dtype))  # type: ignore[union-attr]
        assert out.dtype == _dtypes(c.outputs)[0]
    # the blocks compute in the autocast dtype
    assert any(d == str(dtype).removeprefix("torch.") for c in report.captures for _, d in c.ops)


def test_cuda_autocast_without_replay_is_a_mismatch() -> None:
    torch.manual_seed(0)
    model = Net().cuda().eval()
    with ctxreplay.capture_with(model, targets="repeated", replay="off",
                                verify="signature") as session, \
            torch.autocast("cuda", dtype=torch.float16):
        model(torch.rand(2, 8, 32, device="cuda"))
    report = session.finalize()
    assert not report.ok
    for c in report.captures:
        (m,) = c.fidelity.mismatches
        assert (m.field, m.live, m.captured) == ("dtype", "float16", "float32")
        assert m.hint is not None and "autocast=cuda:float16" in m.hint


class Recording:
    """A backend that records the matmul flags in force while it captures:
    the replayed state, which the test compares with the live one."""

    name = "recording"

    def __init__(self) -> None:
        self.seen: list[tuple[bool, str]] = []

    def capture(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.seen.append((torch.backends.cuda.matmul.allow_tf32,
                          torch.get_float32_matmul_precision()))
        return torch.export.export(module, args, kwargs or None, strict=False)


@contextmanager
def _legacy_tf32(enabled: bool) -> Iterator[None]:
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


@contextmanager
def _precision(value: str) -> Iterator[None]:
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(value)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def _capture_under(flags: Any) -> tuple[Recording, ctxreplay.CaptureReport]:
    torch.manual_seed(0)
    model = Net().cuda().eval()
    backend = Recording()
    with ctxreplay.capture_with(model, targets="repeated", backend=backend,
                                verify="execute") as session, flags, torch.no_grad():
        model(torch.rand(2, 8, 32, device="cuda"))
    assert not torch.backends.cuda.matmul.allow_tf32  # back to the default at finalize
    return backend, session.finalize()


def test_tf32_flag_is_observed_and_replayed() -> None:
    assert not torch.backends.cuda.matmul.allow_tf32, "expects the default (TF32 off)"
    backend, report = _capture_under(_legacy_tf32(True))
    assert report.captures and not report.failures
    assert backend.seen and all(tf32 for tf32, _ in backend.seen)
    for c in report.captures:
        assert dict(c.snapshot["matmul_precision"].flags)["cuda_matmul_tf32"] is True
        assert "cuda_matmul_tf32" in c.snapshot.describe()["matmul_precision"]
        # a matmul flag cannot be embedded in a graph: the capture says so
        assert "matmul_precision" in c.ambient_only
        assert c.fidelity.ok, c.fidelity.mismatches
    assert not torch.backends.cuda.matmul.allow_tf32  # the replay restored it


def test_float32_matmul_precision_high_is_observed_and_replayed() -> None:
    assert torch.get_float32_matmul_precision() == "highest"
    backend, report = _capture_under(_precision("high"))
    assert report.captures and not report.failures
    assert backend.seen and all(p == "high" and tf32 for tf32, p in backend.seen)
    for c in report.captures:
        state = c.snapshot["matmul_precision"]
        assert state.float32_matmul_precision == "high"
        assert c.snapshot.describe()["matmul_precision"].startswith("high")
        assert "matmul_precision" in c.ambient_only
    assert torch.get_float32_matmul_precision() == "highest"
    # and the state travels through JSON to another process
    doc = report.captures[0].snapshot.to_json()
    again = ctxreplay.ContextSnapshot.from_json(doc)
    assert again["matmul_precision"] == report.captures[0].snapshot["matmul_precision"]
    with again.replay():
        assert torch.get_float32_matmul_precision() == "high"
    assert torch.get_float32_matmul_precision() == "highest"
