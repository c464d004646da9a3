"""The verification levels are ordered, and a new one is one level and one
check step: added here from outside the package, used by ``capture_with``,
reported in ``fidelity.checked``, and taken out again."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import ctxreplay
from ctxreplay.capture import checker
from ctxreplay.fidelity import levels
from ctxreplay.fidelity.verify import Mismatch


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


@pytest.fixture
def toy_level() -> Iterator[list[str]]:
    """A level above ``values`` whose step records each member it checked and
    finds a mismatch when the member is marked to be refused."""
    seen: list[str] = []

    def step(c: checker.Checker, m: Any, module: nn.Module | None,
             name: str | None) -> list[Mismatch]:
        seen.append(m.name)
        assert module is not None  # a level that executes is given the member
        return [Mismatch("out", "toy", "checked", "refused", "toy", members=(m.name,))] \
            if getattr(module, "refuse", False) else []

    levels.add_level(levels.Level("toy", executes=True, retains=True), after="values")
    checker.register_step("toy", step)
    try:
        yield seen
    finally:
        checker.unregister_step("toy")
        levels.remove_level("toy")


def _finalize(model: nn.Module, verify: str) -> ctxreplay.CaptureReport:
    with ctxreplay.capture_with(model, verify=verify, backend="export") as session:
        model(torch.rand(2, 4))
    return session.finalize()


def test_a_new_level_is_one_level_and_one_step(toy_level: list[str]) -> None:
    report = _finalize(Block(), "toy")
    (c,) = report.captures
    assert c.fidelity.checked == ("signature", "execute", "sampled", "values", "toy")
    assert report.ok and toy_level == [""]  # the root module is the one member
    assert report.retained is not None  # the toy level retains, as values does
    refusing = Block()
    refusing.refuse = True  # type: ignore[assignment]
    bad = _finalize(refusing, "toy")
    assert not bad.ok
    assert [m.field for m in bad.captures[0].fidelity.mismatches] == ["toy"]
    # below the new level its step never runs
    toy_level.clear()
    assert _finalize(refusing, "values").ok and toy_level == []


def test_an_added_level_is_gone_after_removal(toy_level: list[str]) -> None:
    assert "toy" in levels.level_names()
    checker.unregister_step("toy")
    levels.remove_level("toy")
    assert "toy" not in levels.level_names()
    with pytest.raises(ValueError, match="unknown verification level 'toy'"):
        ctxreplay.capture_with(Block(), verify="toy")
    levels.add_level(levels.Level("toy", executes=True, retains=True), after="values")
    checker.register_step("toy", lambda *a: [])  # what the fixture takes out again
