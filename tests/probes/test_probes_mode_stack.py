"""The mode_stack probe: the user's torch-function and torch-dispatch modes
(in the default set, types only; instances replayed when opted in).

Acceptance: a ``TorchFunctionMode`` that rewrites ``torch.add`` to
``torch.sub``, active during the live forward -- with the probe replaying
instances the capture computes what ran (by value), without the probe it
does not (and the engine's checks cannot tell); a non-replayable mode is
reported by type, as a capture failure, never a crash of ``finalize()``.
"""

from __future__ import annotations

import gc
import json
import weakref
from typing import Any

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import ctxreplay
from ctxreplay.probes import ModeNotReplayableError, ModeStackProbe, ModeStackState
from ctxreplay.probes.mode_stack import EMPTY
from ctxreplay.testing import check_probe

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


class AddToSub(TorchFunctionMode):
    """A user's rewriting mode: ``torch.add`` runs as ``torch.sub``."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if func is torch.add:
            func = torch.sub
        return func(*args, **(kwargs or {}))


class Scale(TorchFunctionMode):
    """Doubles the result of every ``torch.mul``."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        return out * 2 if func is torch.mul else out


class Passthrough(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.add(self.lin(x), 1.0)


def _run(model: nn.Module, probes: list[Any] | None, mode: Any, *,
         verify: str = "execute") -> tuple[Any, torch.Tensor, torch.Tensor]:
    x = torch.rand(2, 3)
    with ctxreplay.capture_with(model, probes=probes, backend="export", verify=verify) as s, \
            mode:
        live = model(x)
    return s.finalize(), x, live


def test_a_rewriting_function_mode_is_replayed_by_instance() -> None:
    torch.manual_seed(0)
    model = Block().eval()
    probe = ModeStackProbe(replay_instances=True)
    report, x, live = _run(model, [*ctxreplay.probes.default_probes(), probe], AddToSub())
    assert report.ok, report.failures
    (c,) = report.captures
    assert torch.allclose(c.artifact.module()(x), live)          # computes what ran
    assert "aten.sub.Tensor" in {op for op, _ in c.ops}
    assert c.snapshot.describe()["mode_stack"] == "AddToSub"
    assert "mode_stack" in c.ambient_only or "mode_stack" in c.snapshot.names
    # live instances never leave the process: the document marks the state
    doc = c.snapshot.to_json()["probes"]["mode_stack"]
    assert doc == {"portable": False, "type": "ModeStackState"}
    probe.clear()


def test_the_types_only_probe_carries_type_names() -> None:
    probe = ctxreplay.probes.get_probe("mode_stack")
    with AddToSub():
        state = probe.observe()
    doc = json.loads(json.dumps(probe.encode(state)))
    assert doc == {"function_modes": [f"{__name__}.AddToSub"], "dispatch_modes": []}
    assert probe.decode(doc, "$.state") == state


def test_without_the_probe_the_capture_computes_something_else() -> None:
    """... and the engine's own checks call it faithful: the reason the probe
    exists (the lead should know: verify='execute' compares no values)."""
    torch.manual_seed(0)
    model = Block().eval()
    without = [n for n in ctxreplay.probes.default_probes() if n != "mode_stack"]
    report, x, live = _run(model, without, AddToSub())
    (c,) = report.captures
    assert not torch.allclose(c.artifact.module()(x), live)
    assert "aten.add.Tensor" in {op for op, _ in c.ops}
    assert report.ok and c.fidelity.ok  # a false OK that mode_stack turns into a failure


def test_a_mode_that_is_not_replayable_is_reported_by_type() -> None:
    torch.manual_seed(0)
    model = Block().eval()
    for probe, mode, name in (("mode_stack", AddToSub(), "AddToSub"),
                              (ModeStackProbe(replay_instances=True), Passthrough(),
                               "Passthrough")):
        report, _, _ = _run(model, [*ctxreplay.probes.default_probes(), probe], mode)
        assert not report.ok and not report.captures
        (failure,) = report.failures
        assert failure.reason == "replay_failed"
        assert failure.exc_type == "ModeNotReplayableError"
        assert failure.context["mode_stack"] == f"{name} (not replayable)"
        json.dumps(report.to_json())
        if isinstance(probe, ModeStackProbe):
            probe.clear()


def test_modes_from_a_document_are_never_replayed() -> None:
    types_only = ctxreplay.probes.get_probe("mode_stack")
    probe = ModeStackProbe(replay_instances=True)
    with AddToSub():
        live = probe.observe()
        typed = types_only.observe()
    with pytest.raises(ctxreplay.probes.NotPortableError):
        probe.encode(live)
    decoded = probe.decode(json.loads(json.dumps(types_only.encode(typed))), "$.state")
    assert decoded.function_modes == live.function_modes and decoded != live  # no instance
    with pytest.raises(ModeNotReplayableError, match="not replayable"):
        probe.replay(decoded)
    with pytest.raises(ModeNotReplayableError, match=r"ModeStackProbe\(replay_instances"):
        types_only.replay(decoded)
    probe.clear()


def test_infrastructure_modes_are_not_user_state() -> None:
    """The default-device mode belongs to default_device; what torch.export
    pushes while it traces (measured: three function modes and FakeTensorMode)
    is never observed as user state."""
    probe = ModeStackProbe()
    with torch.device("meta"):
        assert probe.observe() == EMPTY
    seen: list[tuple[ModeStackState, int, int]] = []

    class Spy(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append((probe.observe(), torch._C._len_torch_function_stack(),
                         torch._C._len_torch_dispatch_stack()))
            return x + 1

    # non-strict, as ctxreplay exports (torch 2.7's default is strict)
    torch.export.export(Spy(), (torch.rand(2),), strict=False)
    (state, fn_depth, dispatch_depth), = seen
    assert fn_depth >= 1 and dispatch_depth >= 1  # torch's own modes are there ...
    assert state == EMPTY                          # ... and not reported
    with AddToSub():
        seen.clear()
        torch.export.export(Spy(), (torch.rand(2),), strict=False)
        assert seen[0][0].function_modes == (f"{__name__}.AddToSub",)


def test_check_probe_with_instances() -> None:
    probe = ModeStackProbe(replay_instances=True)
    fresh = probe.observe()
    a, b = AddToSub(), Scale()
    with a:
        one = probe.observe()
    with a, b:
        two = probe.observe()
    with Scale():
        other = probe.observe()  # same type as b, another instance: another variant
    assert len({one, two, other}) == 3
    check_probe(probe, [one, two, other], neutral=fresh, clear=False)
    with probe.replay(two):
        assert torch.mul(torch.ones(1), 3).item() == 6.0
        assert torch.add(torch.ones(1), 1).item() == 0.0
    assert torch.add(torch.ones(1), 1).item() == 2.0
    probe.clear()
    with pytest.raises(ModeNotReplayableError, match="cleared"):
        probe.replay(one)


def test_check_probe_types_only() -> None:
    """The registered probe: states are the types; only the empty one replays."""
    probe = ctxreplay.probes.get_probe("mode_stack")
    assert probe.default and not probe.traceable
    fresh = probe.observe()
    assert fresh == EMPTY == probe.neutral_state()
    with AddToSub():
        state = probe.observe()
    with Scale(), AddToSub():
        assert probe.observe() != state
    with pytest.raises(ModeNotReplayableError):
        probe.replay(state)
    # the contract on the states it can replay: the empty one, from inside a mode
    with AddToSub():
        check_probe(probe, [fresh])


def test_clear_drops_the_instances() -> None:
    probe = ModeStackProbe(replay_instances=True)
    mode = AddToSub()
    ref = weakref.ref(mode)
    with mode:
        state = probe.observe()
    del mode
    gc.collect()
    assert ref() is not None
    with probe.replay(state):
        assert torch.add(torch.ones(1), 1).item() == 0.0
    probe.clear()
    gc.collect()
    assert ref() is None


def test_max_held_and_ignore() -> None:
    probe = ModeStackProbe(replay_instances=True, max_held=1, ignore=(Scale,))
    with AddToSub():
        kept = probe.observe()
    with AddToSub():
        dropped = probe.observe()
    assert probe.dropped == 1 and dropped.slot < 0
    with pytest.raises(ModeNotReplayableError, match="max_held=1"):
        probe.replay(dropped)
    with Scale():
        assert probe.observe() == EMPTY  # ignored type
    with probe.replay(kept):
        pass
    probe.clear()


def test_watch_sees_a_mode_pushed_under_a_cached_empty_state() -> None:
    probe = ctxreplay.probes.get_probe("mode_stack")
    checks = probe.watch(probe.observe())
    assert all(g() == e for g, e in checks)
    with AddToSub():
        assert not all(g() == e for g, e in checks)
    with Passthrough():
        assert not all(g() == e for g, e in checks)


@pytest.mark.parametrize("bad", [{"function_modes": ["not a name"], "dispatch_modes": []},
                                 {"function_modes": ["NoModule"], "dispatch_modes": []},
                                 {"function_modes": [1], "dispatch_modes": []},
                                 {"function_modes": [], "dispatch_modes": "x"},
                                 {"function_modes": []}])
def test_decode_refuses_what_is_not_a_list_of_type_names(bad: Any) -> None:
    with pytest.raises(ValueError, match=r"^\$\.state"):
        ctxreplay.probes.get_probe("mode_stack").decode(bad, "$.state")
