"""Step caches: every cache hook the installed diffusers ships, on tiny Wan
and CogVideoX transformers, over a denoising loop with changing latents
and timesteps, with ``finalize()`` called outside and inside an open
``cache_context``, blocks (``targets="repeated"``) and the whole model.

A cache hook keeps Python state between steps (the last attention output,
an iteration counter, a residual) and decides from it whether to compute or
reuse.  Whatever the report says:

* ``finalize()`` leaves every hook's state as it found it (by identity,
  tensors by value): before, a trace left FakeTensors in it and checks
  advanced its counters;
* a capture is ok only where the installed model computes what eager does:
  the installed model runs the next steps of the loop with its cache and
  returns what an eager twin, uncaptured, returns over the same steps --
  and never raises where the twin does not (before, FasterCache's and
  FirstBlockCache's hooks raised inside the installed model: the
  dispatched graph skipped the state writes they make);
* a report that is not ok says why, and a capture of a forward that writes
  the hook's state names that state.
"""

from __future__ import annotations

import pytest
import torch
from step_caches import (
    Clock,
    build,
    denoise,
    hook_state,
    open_context,
    shipped_cache_configs,
    state_changes,
)

import ctxreplay

pytestmark = [pytest.mark.models,
              pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")]

CACHES = ("PyramidAttentionBroadcastConfig", "FasterCacheConfig", "FirstBlockCacheConfig",
          "MagCacheConfig", "SeaCacheConfig", "TaylorSeerCacheConfig", "TextKVCacheConfig")
#: (model, targets, finalize inside an open cache_context, verify): each cache
#: runs the blocks of one model with the context closed and open, at the
#: default level and at "execute", and the whole other model.  With the
#: context closed a cache that needs one does nothing at the trace while the
#: live calls reused: the comparison with the live values (the default level)
#: sees it, and at "execute" the hook state a repeat live call writes does
#: (before, SeaCache's blocks were ok there and the installed model differed)
ROWS = (("wan", "repeated", False, "default"), ("wan", "repeated", False, "execute"),
        ("wan", "repeated", True, "execute"), ("cogvideox", None, True, "default"))


def test_every_cache_the_installed_diffusers_ships_is_covered() -> None:
    assert shipped_cache_configs() == set(CACHES)


@pytest.mark.parametrize(("kind", "targets", "inside", "verify"), ROWS,
                         ids=["wan-blocks-outside", "wan-blocks-outside-execute",
                              "wan-blocks-inside", "cogvideox-model-inside"])
@pytest.mark.parametrize("cache", CACHES)
def test_a_step_cache_is_refused_or_installs_what_eager_computes(
        cache: str, kind: str, targets: str | None, inside: bool, verify: str) -> None:
    clock, twin_clock = Clock(), Clock()
    model, twin = build(kind, cache, clock), build(kind, cache, twin_clock)
    levels = {} if verify == "default" else {"verify": verify}
    with ctxreplay.capture_with(model, targets=targets, **levels) as session:
        live = denoise(model, kind, clock)
    eager = denoise(twin, kind, twin_clock)
    assert all(torch.equal(a, b) for a, b in zip(live, eager))  # observation changed nothing

    before = hook_state(model)
    with open_context(model, inside):
        report = session.finalize()
    assert state_changes(before, hook_state(model)) == []

    if not report.ok:  # said, with a reason
        assert report.failures or report.problems or any(
            not c.fidelity.ok and c.fidelity.mismatches for c in report.captures)
    for c in report.captures:
        written = [m.live for m in c.fidelity.mismatches if m.field == "held_state"]
        assert not (c.fidelity.ok and written)
    # the next steps of the loop: the installed model with its cache equals
    # the eager twin with its own, step by step, and raises nowhere
    handle = ctxreplay.install(model, report)
    try:
        installed = denoise(model, kind, clock)
        stats = handle.stats()
    finally:
        handle.remove()
    expected = denoise(twin, kind, twin_clock)
    for step, (got, want) in enumerate(zip(installed, expected)):
        assert torch.equal(got, want), (step, stats)
    if report.ok:
        assert sum(stats.hits.values()) > 0
