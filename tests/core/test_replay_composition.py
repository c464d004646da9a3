"""How replay parts are composed, on every torch release the suite runs on.

``ctxreplay.core.probe.composed`` is the one composition of replay parts that a
tracer may see: an ``ExitStack`` where it can trace one, nested ``with``
statements while a Dynamo that cannot (before 2.11,
``CAPS.dynamo_traces_exitstack``) traces it.  Both forms must mean the same,
and the nested one must be what old Dynamo traces -- so it is exercised here
on the installed torch too, by making ``composed`` take it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import pytest
import torch
from torch import nn

import ctxreplay
import ctxreplay.core.probe as probe_mod
import ctxreplay.probes.autocast as autocast_mod
from ctxreplay._base.torchcaps import CAPS
from ctxreplay.core.probe import composed

BF16 = torch.bfloat16


@pytest.fixture(params=["stacked", "nested"])
def form(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test with each form of ``composed``; "nested" is what Dynamo
    before 2.11 gets (forced here whatever the tracer)."""
    if request.param == "nested":
        monkeypatch.setattr(probe_mod, "CAPS",
                            dataclasses.replace(CAPS, dynamo_traces_exitstack=False))
        monkeypatch.setattr(probe_mod, "dynamo_compiling", lambda: True)
    return str(request.param)


def _recording(log: list[str], name: str, *, fail_enter: bool = False,
               fail_exit: bool = False) -> Any:
    @contextmanager
    def cm() -> Iterator[None]:
        log.append(f"make+enter {name}")
        if fail_enter:
            raise RuntimeError(f"enter {name}")
        try:
            yield
        finally:
            log.append(f"exit {name}")
            if fail_exit:
                raise RuntimeError(f"exit {name}")

    return cm


def test_parts_enter_in_order_and_exit_in_reverse(form: str) -> None:
    log: list[str] = []
    parts = [_recording(log, "a"), lambda: None, _recording(log, "b")]
    with composed(parts):
        log.append("body")
    assert log == ["make+enter a", "make+enter b", "body", "exit b", "exit a"]


def test_a_part_is_made_only_when_the_ones_before_it_are_entered(form: str) -> None:
    made: list[bool] = []

    def second() -> AbstractContextManager[None]:
        made.append(torch.is_grad_enabled())
        return torch.enable_grad()

    with torch.enable_grad(), composed([torch.no_grad, second]):
        pass
    assert made == [False]  # made after no_grad was entered


def test_a_part_that_fails_to_enter_unwinds_the_ones_entered(form: str) -> None:
    log: list[str] = []
    parts = [_recording(log, "a"), _recording(log, "b", fail_enter=True),
             _recording(log, "c")]
    cm = composed(parts)
    with pytest.raises(RuntimeError, match="enter b"):
        cm.__enter__()
    assert log == ["make+enter a", "make+enter b", "exit a"]


def test_an_error_in_the_body_or_an_exit_reaches_the_caller(form: str) -> None:
    log: list[str] = []
    with pytest.raises(ValueError, match="body"), \
            composed([_recording(log, "a"), _recording(log, "b")]):
        raise ValueError("body")
    assert log[-2:] == ["exit b", "exit a"]
    log.clear()
    with pytest.raises(RuntimeError, match="exit b"), \
            composed([_recording(log, "a"), _recording(log, "b", fail_exit=True)]):
        pass
    assert log[-2:] == ["exit b", "exit a"]  # a still exits


def test_the_nested_form_is_taken_only_where_dynamo_needs_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def form_of() -> str:
        return str(composed([]).gen.__name__)  # type: ignore[attr-defined]

    assert form_of() == "_stacked"  # not under Dynamo: always the ExitStack
    monkeypatch.setattr(probe_mod, "dynamo_compiling", lambda: True)
    assert form_of() == ("_stacked" if CAPS.dynamo_traces_exitstack else "_nested")
    monkeypatch.setattr(probe_mod, "CAPS",
                        dataclasses.replace(CAPS, dynamo_traces_exitstack=False))
    assert form_of() == "_nested"


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor) -> torch.Tensor:
        return self.lin(x * scale)


@pytest.mark.parametrize("backend", ["dynamo", "export"])
def test_a_capture_replays_autocast_and_grad_mode_in_either_form(form: str,
                                                                 backend: str) -> None:
    """The embedded replay -- autocast for one device, its cache flag and grad
    mode: three parts -- traced by Dynamo and by export in both forms."""
    model = Block()
    x, scale = torch.rand(2, 8), torch.rand(8)
    with ctxreplay.capture_with(model, probes=["autocast", "grad_mode"],
                                backend=backend, verify="execute") as session, \
            torch.no_grad(), torch.autocast("cpu", dtype=BF16, cache_enabled=False):
        live = model(x, scale=scale)
    assert live.dtype == BF16
    report = session.finalize()
    assert not report.failures, report.failures
    (cap,) = report.captures
    assert cap.backend == backend
    assert cap.fidelity.ok, cap.fidelity.mismatches
    assert set(cap.embedded) >= {"autocast", "grad_mode"}
    assert not torch.is_autocast_enabled("cpu") and torch.is_grad_enabled()


def test_the_autocast_probe_watches_only_what_the_guard_cannot_see(
        monkeypatch: pytest.MonkeyPatch) -> None:
    autocast = ctxreplay.probes.get_probe("autocast")
    with torch.autocast("cpu", dtype=BF16):
        state = autocast.observe()
    if CAPS.guard_sees_autocast_flags and CAPS.guard_sees_autocast_dtype:
        # the guard sees enabled flags, enabled dtypes and the cache flag (2.7-2.14)
        assert autocast.watch(state) == ()
    for blind in ("guard_sees_autocast_flags", "guard_sees_autocast_dtype"):
        monkeypatch.setattr(autocast_mod, "CAPS", dataclasses.replace(CAPS, **{blind: False}))
        ((getter, value),) = autocast.watch(state)
        assert value == state
        with torch.autocast("cpu", dtype=BF16):
            assert getter() == value
        with torch.autocast("cpu", dtype=torch.float16):
            assert getter() != value
        assert getter() != value  # autocast off
