"""The check of a compiled program against its uncompiled one: the error
measure and the tolerance each output is held to (no compiling here)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ctxreplay.compiling import TOLERANCES
from ctxreplay.compiling.verify import compare, compute_tolerance


class _Lin(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.lin(x).float()


def _program(autocast: bool) -> torch.export.ExportedProgram:
    class Wrapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = _Lin()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                out: torch.Tensor = self.inner(x)
            return out
    return torch.export.export(Wrapped(), (torch.rand(2, 8),))


def test_a_float32_output_of_a_bf16_computation_is_held_to_bf16s_tolerance() -> None:
    assert compute_tolerance(_program(autocast=True)) == TOLERANCES[torch.bfloat16]
    assert compute_tolerance(_program(autocast=False)) == TOLERANCES[torch.float32]
    want = torch.ones(4)
    got = want + 1.6e-3  # a bf16 rounding's worth, seen on a float32 residual stream
    (strict,) = compare([got], [want])
    (floored,) = compare([got], [want], TOLERANCES[torch.bfloat16])
    assert not strict.ok and strict.tolerance == TOLERANCES[torch.float32]
    assert floored.ok and floored.error == pytest.approx(1.6e-3, rel=1e-3)


def test_the_error_is_relative_to_the_uncompiled_peak() -> None:
    want = torch.tensor([0.0, 10.0, -20.0], dtype=torch.bfloat16)
    got = torch.tensor([0.25, 10.0, -20.0], dtype=torch.bfloat16)
    (o,) = compare([got], [want])
    assert o.error == pytest.approx(0.25 / 20) and o.dtype == "bfloat16" and o.ok


@pytest.mark.parametrize(("got", "want"), [
    (torch.tensor([1.0, float("nan")]), torch.tensor([1.0, 2.0])),  # a NaN that eager lacks
    (torch.ones(3), torch.ones(4)),  # another shape
    (torch.ones(3, dtype=torch.float64), torch.ones(3)),  # another dtype
    (torch.tensor([1, 2]), torch.tensor([1, 3])),  # integers must be equal
])
def test_what_cannot_be_compared_fails(got: torch.Tensor, want: torch.Tensor) -> None:
    (o,) = compare([got], [want])
    assert not o.ok


def test_a_missing_output_fails() -> None:
    assert not all(o.ok for o in compare([torch.ones(2)], [torch.ones(2), torch.ones(2)]))


def test_equal_outputs_have_no_error() -> None:
    x = torch.rand(5, dtype=torch.float16)
    assert [o.error for o in compare([x, torch.tensor([3])], [x.clone(), torch.tensor([3])])] \
        == [0.0, 0.0]
