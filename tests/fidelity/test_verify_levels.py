"""The verification levels are ordered: each checks what the one below it
does, and an unknown name lists the known ones."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ctxreplay
from ctxreplay.fidelity import levels


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def test_the_levels_are_ordered_and_each_checks_what_the_one_below_does() -> None:
    assert levels.level_names() == ("off", "signature", "execute", "sampled", "values")
    assert levels.checked_by("values") == ("signature", "execute", "sampled", "values")
    assert levels.checked_by("signature") == ("signature",)
    assert levels.at_least("values", "execute") and not levels.at_least("signature", "execute")
    assert [levels.level(n).executes for n in levels.level_names()] == [
        False, False, True, True, True]
    # the default compares values, on a sample chosen before each call runs
    assert levels.DEFAULT == "sampled" and levels.level("sampled").samples
    assert not levels.level("values").samples and levels.level("values").retains
    with ctxreplay.capture_with(Block()) as s:
        pass
    assert s.options.verify == "sampled"
    with pytest.raises(ctxreplay.Error, match=r"unknown verification level 'exact'.*'values'"):
        levels.level("exact")
    with pytest.raises(ValueError, match="unknown verification level"):
        ctxreplay.capture_with(Block(), verify="exact")
