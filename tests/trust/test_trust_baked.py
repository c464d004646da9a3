"""State a program baked in, changed after install.

A trace runs the forward's Python once; what it read beside its arguments
and weights -- a plain tensor attribute, a dict entry, a module global, a
class attribute, an attribute of a module the block only refers to, the
weights of an adapter held in a plain list -- is a constant of the graph.
A pipeline changes such state from outside, between calls.  Installed,
each such change makes the calls that follow run eagerly
(``baked_state``, the place named in ``stats().stale``), never the old
program; a change put back is served again.

The oracle is eager: every call of the installed model against the same
model with ctxreplay removed.  The control runs the programs with the guard
off and shows each change is one the program gets wrong.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import baked_knobs
import pytest
import torch
from torch import nn

import ctxreplay
from ctxreplay.dispatch.baked import BakedGuard


class Block(nn.Module):
    cmode = "a"

    def __init__(self, shared: list[nn.Module], root: list[nn.Module]) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.temb = torch.ones(8)
        self.cfg = {"mode": "a"}
        self.shared = shared  # a plain list: not a submodule
        self.root = root      # the model, referred to

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x) + self.temb
        if self.cfg["mode"] == "b":
            y = y * 3
        if baked_knobs.MODE == "b":
            y = y - 2
        if self.cmode == "b":
            y = y + 5
        y = y * self.root[0].t_scale
        return y + self.shared[0](x)


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.t_scale = 1.0
        self.shared = [nn.Linear(8, 8)]
        self.blocks = nn.ModuleList(Block(self.shared, [self]) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def _reload(m: Stack) -> None:
    with torch.no_grad():
        m.shared[0].weight.copy_(torch.randn(8, 8))


#: (name, change, the place ``stale`` names)
CHANGES: list[tuple[str, Callable[[Stack], None], str]] = [
    ("tensor attribute", lambda m: setattr(m.blocks[0], "temb", torch.randn(8)), "temb"),
    ("dict in place", lambda m: m.blocks[0].cfg.__setitem__("mode", "b"), "cfg"),
    ("module global", lambda m: setattr(baked_knobs, "MODE", "b"),
     "global baked_knobs.MODE"),
    ("class attribute", lambda m: setattr(Block, "cmode", "b"), "cmode"),
    ("root attribute", lambda m: setattr(m, "t_scale", 0.5), "root[0].t_scale"),
    ("adapter reloaded", _reload, "shared[0].weight"),
]


@pytest.fixture(autouse=True)
def _globals_back() -> object:
    yield
    baked_knobs.MODE = "a"
    Block.cmode = "a"


def _captured() -> tuple[Stack, ctxreplay.CaptureReport, torch.Tensor]:
    torch.manual_seed(0)
    model = Stack().eval()
    x = torch.randn(2, 8)
    with ctxreplay.capture_with(model, targets="repeated") as session, torch.no_grad():
        for _ in range(3):
            model(x)
    report = session.finalize()
    assert report.ok, report.explain(model)
    return model, report, x


def _eager(model: Stack, x: torch.Tensor, handle: ctxreplay.InstallHandle) -> torch.Tensor:
    """What ``model`` computes for ``x`` without ctxreplay (then installed again)."""
    del handle
    with torch.no_grad():
        return model(x)


@pytest.mark.parametrize("name,change,place", CHANGES, ids=[c[0] for c in CHANGES])
def test_a_change_after_install_runs_eagerly_naming_the_place(
        name: str, change: Callable[[Stack], None], place: str) -> None:
    model, report, x = _captured()
    handle = ctxreplay.install(model, report)
    with torch.no_grad():
        before = model(x)
    assert handle.stats().total_hits == 3 and handle.stats().total_misses == 0
    change(model)
    with torch.no_grad():
        got = [model(x) for _ in range(4)]
    stats = handle.stats()
    handle.remove()
    with torch.no_grad():
        want = model(x)
    assert not torch.equal(before, want)  # the change changes what the model computes
    for g in got:
        torch.testing.assert_close(g, want, rtol=0, atol=0)
    assert stats.reasons.get("baked_state", 0) >= 4, stats
    assert place in stats.stale.values(), stats.stale


@pytest.mark.parametrize("name,change,place", CHANGES, ids=[c[0] for c in CHANGES])
def test_control_without_the_guard_the_program_serves_the_old_state(
        name: str, change: Callable[[Stack], None], place: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    model, report, x = _captured()
    monkeypatch.setattr(BakedGuard, "holds", lambda self: True)
    handle = ctxreplay.install(model, report)
    with torch.no_grad():
        model(x)  # bound: what the member is checked against at its first call
    change(model)
    with torch.no_grad():
        got = model(x)
    handle.remove()
    with torch.no_grad():
        want = model(x)
    assert not torch.allclose(got, want), "the program does not bake this state in"


def test_a_change_put_back_is_served_again() -> None:
    model, report, x = _captured()
    handle = ctxreplay.install(model, report)
    with torch.no_grad():
        model(x)
    model.blocks[1].cfg["mode"] = "b"
    with torch.no_grad():
        model(x)
    misses = handle.stats().total_misses
    model.blocks[1].cfg["mode"] = "a"
    with torch.no_grad():
        got = model(x)
    stats = handle.stats()
    handle.remove()
    assert misses == 1 and stats.total_misses == 1 and stats.total_hits == 8
    with torch.no_grad():
        torch.testing.assert_close(got, model(x), rtol=0, atol=0)


def test_an_equal_tensor_assigned_is_still_served() -> None:
    model, report, x = _captured()
    handle = ctxreplay.install(model, report)
    for b in model.blocks:
        b.temb = torch.ones(8)  # another object, the same values
    with torch.no_grad():
        model(x)
    stats = handle.stats()
    handle.remove()
    assert stats.total_hits == 3 and stats.total_misses == 0, stats


def test_a_saved_capture_is_guarded_where_it_is_loaded(tmp_path: Path) -> None:
    _, report, x = _captured()
    report.save_all(tmp_path / "caps")
    loaded = ctxreplay.load(tmp_path / "caps")
    torch.manual_seed(0)
    fresh = Stack().eval()  # the same weights, its own objects
    handle = ctxreplay.install(fresh, loaded)
    with torch.no_grad():
        fresh(x)
    served = handle.stats().total_hits
    fresh.blocks[2].temb = torch.full((8,), 2.0)
    with torch.no_grad():
        got = fresh(x)
    stats = handle.stats()
    handle.remove()
    with torch.no_grad():
        want = fresh(x)
    assert served == 3
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert stats.stale == {f"{report.captures[0].scope}#0@blocks.2": "temb"}, stats.stale


def test_explain_names_the_places_an_installed_model_checks() -> None:
    model, report, _ = _captured()
    text = str(report.explain(model))
    row = next(line for line in text.splitlines() if "baked in" in line)
    for place in ("cfg", "cmode", "temb", "root[0].t_scale", "shared[0].weight",
                  "global baked_knobs.MODE"):
        assert place in row, text
