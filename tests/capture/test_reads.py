"""capture.reads: the attributes the first run of a view's forward read,
per submodule path; the classes put back whatever the run did."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from ctxreplay.capture.reads import Reads, recorded


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.scale = 2.0
        self.unused = 3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * self.scale


class Outer(nn.Module):
    def __init__(self, mode: str = "plain") -> None:
        super().__init__()
        self.inner = Inner()
        self.layer_idx = 7
        self.mode = mode
        # set here, reassigned by the forward: torch 2.7's export fails on a
        # forward that adds an attribute the module did not have
        self.note = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "vars":
            assert isinstance(vars(self), dict)
        if self.mode == "raise":
            raise RuntimeError("boom")
        self.note = 1  # an assignment is no read
        return self.inner(x)


def _run(module: nn.Module, times: int = 1) -> Reads:
    reads = Reads()
    with recorded(module, reads):
        for _ in range(times):
            module(torch.rand(2, 4))
    return reads


def test_the_run_notes_what_it_read_per_submodule() -> None:
    module = Outer()
    reads = _run(module)
    assert reads.complete
    read = reads.read()
    assert {"mode", "inner"} <= read[""] and "layer_idx" not in read[""]  # type: ignore[operator]
    assert {"proj", "scale"} <= read["inner"] and "unused" not in read["inner"]  # type: ignore[operator]
    assert reads.untouched({("", "layer_idx"), ("inner", "unused")})
    assert not reads.untouched({("inner", "scale")})
    assert not reads.untouched({("nowhere", "x")})  # a path it did not see counts as read
    assert type(module) is Outer and type(module.inner) is Inner


def test_vars_reads_every_attribute_and_nn_module_internals_do_not() -> None:
    reads = _run(Outer("vars"))
    assert reads.read()[""] is None
    assert not reads.untouched({("", "layer_idx")})
    # nn.Module's own __getattr__ / __setattr__ read __dict__ for parameters
    # and submodules on every call: no reason to count everything read
    assert reads.read()["inner"] is not None and reads.read()["inner.proj"] is not None


def test_only_the_first_run_is_recorded_and_a_failed_run_is_incomplete() -> None:
    module = Outer("raise")
    reads = Reads()
    with recorded(module, reads), pytest.raises(RuntimeError):
        module(torch.rand(2, 4))
    assert not reads.complete and not reads.armed
    assert not reads.untouched(set())  # nothing is served from an incomplete run
    assert type(module) is Outer and type(module.inner) is Inner
    module.mode = "plain"
    with recorded(module, reads):
        module(torch.rand(2, 4))
    assert not reads.complete  # the recorder was used up by the first run


def test_an_export_records_and_leaves_the_classes_as_they_were() -> None:
    module = Outer()
    reads = Reads()
    with recorded(module, reads):
        ep = torch.export.export(module, (torch.rand(2, 4),), strict=False)
    assert reads.complete and reads.untouched({("", "layer_idx")})
    assert type(module) is Outer
    out: Any = ep.module()(torch.ones(2, 4))
    assert torch.allclose(out, module(torch.ones(2, 4)))


def test_a_submodules_hook_that_reads_an_attribute_is_recorded() -> None:
    """Hooks of submodules run inside the forward: what they read counts."""
    module = Outer()
    module.inner.proj.tag = 5  # type: ignore[assignment]
    module.inner.proj.register_forward_hook(lambda m, args, out: out * m.tag)
    reads = _run(module)
    assert not reads.untouched({("inner.proj", "tag")})
    assert reads.untouched({("inner", "unused")})


def test_a_class_that_cannot_be_swapped_leaves_the_run_unrecorded(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The forward still runs (a trace never fails for the recorder), and
    nothing is served from it."""
    import ctxreplay.capture.reads as reads_module

    real = reads_module._recording

    def refuse(cls: type, reads: Reads) -> type:
        if cls is Inner:
            raise TypeError("__class__ assignment: layout differs")
        return real(cls, reads)

    monkeypatch.setattr(reads_module, "_recording", refuse)
    module = Outer()
    reads = _run(module)
    assert not reads.complete and not reads.untouched({("", "layer_idx")})
    assert type(module) is Outer and type(module.inner) is Inner


def test_a_view_holding_a_weak_reference_is_not_recorded() -> None:
    """A weak reference survives ``deepcopy`` pointing at the live module:
    reads through it are not the view's, so the run counts as incomplete."""
    import weakref

    module = Outer()
    module.inner.owner = weakref.ref(module)  # type: ignore[assignment]
    reads = _run(module)
    assert not reads.complete and not reads.untouched({("", "layer_idx")})
