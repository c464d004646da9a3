"""Step caches served: every cache hook the installed diffusers ships, on
tiny Wan and CogVideoX transformers, over whole generations as a pipeline
runs them (classifier-free guidance batched, a ``cache_context`` per step,
the cache reset when a generation ends).

A step cache decides per step whether a block (or its attention) computes
or reuses what it stored.  ctxreplay observes, captures and installs
beneath the cache's hooks, so the hooks stay Python and keep deciding, and
each step they compute runs the captured program.  After one observed
generation the installed model runs two more (another prompt, then the
first again), and step by step:

* its outputs equal an eager twin's, with the same cache, uncaptured;
* the programs ran exactly on the steps the twin computed: the dispatch
  hits equal the twin's computed calls of the same modules (counted by a
  forward hook inside each), and no call missed;
* the cache's own state (its counters, stored outputs and residuals, by
  value) equals the twin's at the end of each generation;
* and the cache really reused steps (the twin computed fewer calls than
  it made): a capture of the cache's decisions would be wrong here.

Before, every cache but TaylorSeer was refused (``held_state``,
``data_dependent_control_flow``) and served nothing.
"""

from __future__ import annotations

import pytest
import torch
from step_caches import (
    STEPS,
    Clock,
    build,
    config,
    counted,
    generate,
    hook_values,
    value_differences,
)

import ctxreplay

pytestmark = [pytest.mark.models,
              pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")]

CACHES = ("PyramidAttentionBroadcastConfig", "FasterCacheConfig", "FirstBlockCacheConfig",
          "MagCacheConfig", "SeaCacheConfig", "TaylorSeerCacheConfig")
#: the hooked modules each cache's members are (blocks, or their attention)
BENEATH = {"PyramidAttentionBroadcastConfig": "attn1", "FasterCacheConfig": "attn1",
           "TaylorSeerCacheConfig": "attn", "FirstBlockCacheConfig": "block",
           "MagCacheConfig": "block", "SeaCacheConfig": "block"}


def _served(cache: str, kind: str, targets: str | None, tmp: str | None = None) -> None:
    clock, twin_clock = Clock(), Clock()
    model, twin = build(kind, cache, clock), build(kind, cache, twin_clock)
    with ctxreplay.capture_with(model, targets=targets) as session:
        live = generate(model, kind, clock, prompt=1)
    eager = generate(twin, kind, twin_clock, prompt=1)
    assert all(torch.equal(a, b) for a, b in zip(live, eager))
    report = session.finalize()
    assert report.ok, report.summary
    members = sorted({n for c in report.captures for n in c.members})
    assert members and all(BENEATH[cache] in n.rsplit(".", 1)[-1] or
                           (BENEATH[cache] == "block" and n.rsplit(".", 1)[-1].isdigit())
                           for n in members), members
    notices = {n.reason: n for n in report.notices}
    assert set(notices["step_cache_beneath"].names) == {f"{n} (" for n in members} or \
        all(any(x.startswith(f"{n} (") for x in notices["step_cache_beneath"].names)
            for n in members)
    assert "step_cache_beneath" in report.summary
    if tmp is not None:
        report.save_all(tmp)
        report = ctxreplay.load(tmp)
    handle = ctxreplay.install(model, report)
    try:
        for prompt in (2, 1):
            ours: dict[str, object] = {}
            theirs: dict[str, object] = {}
            before = handle.stats()
            got = generate(model, kind, clock, prompt,
                           end=lambda d=ours: d.update(hook_values(model)))
            with counted(twin, members) as computed:
                want = generate(twin, kind, twin_clock, prompt,
                                end=lambda d=theirs: d.update(hook_values(twin)))
            stats = handle.stats()
            for step, (a, b) in enumerate(zip(got, want)):
                assert torch.equal(a, b), (cache, prompt, step, stats)
            hits = stats.total_hits - before.total_hits
            assert hits == sum(computed.values()) > 0, (hits, computed)
            assert stats.total_misses == before.total_misses, stats
            assert ours and value_differences(ours, theirs) == []
            if kind == "wan":  # every cache reuses some steps of these
                assert sum(computed.values()) < STEPS * len(members), computed
    finally:
        handle.remove()


@pytest.mark.parametrize("cache", CACHES)
def test_a_step_cache_is_served_beneath_its_hooks_on_wan_blocks(cache: str) -> None:
    _served(cache, "wan", "repeated")


@pytest.mark.parametrize("cache", CACHES)
def test_a_step_cache_is_served_beneath_its_hooks_on_a_whole_cogvideox(cache: str) -> None:
    _served(cache, "cogvideox", None)


@pytest.mark.parametrize("cache", ("FirstBlockCacheConfig", "PyramidAttentionBroadcastConfig"))
def test_a_saved_step_cache_capture_is_served_beneath_its_hooks(cache: str, tmp_path) -> None:
    _served(cache, "wan", "repeated", str(tmp_path / "saved"))


def test_a_step_cache_enabled_whole_model_names_what_runs_eagerly() -> None:
    clock = Clock()
    model = build("wan", "PyramidAttentionBroadcastConfig", clock)
    with ctxreplay.capture_with(model) as session:
        generate(model, "wan", clock, prompt=1)
    report = session.finalize()
    inside = next(n for n in report.notices if n.reason == "step_cache_inside")
    assert inside.names == ("WanTransformer3DModel: blocks.0.attn1, blocks.1.attn1",)
    assert report.ok
    assert "the rest of each target runs eagerly" in report.explain(model).table()


def test_observing_beneath_the_hooks_puts_every_forward_back() -> None:
    clock = Clock()
    model = build("wan", "FirstBlockCacheConfig", clock)
    refs = [m._diffusers_hook._fn_refs[0] for m in model.blocks]
    before = [(m.__dict__["forward"], r.original_forward) for m, r in zip(model.blocks, refs)]
    with ctxreplay.capture_with(model, targets="repeated") as session:
        assert all(r.original_forward != b for r, (_, b) in zip(refs, before))  # beneath
        assert all(m.__dict__["forward"] is f for m, (f, _) in zip(model.blocks, before))
        generate(model, "wan", clock, prompt=1)
    handle = ctxreplay.install(model, session.finalize())
    handle.remove()
    assert [(m.__dict__["forward"], r.original_forward)
            for m, r in zip(model.blocks, refs)] == before


def test_a_cache_disabled_while_observed_leaves_the_plain_forward() -> None:
    clock = Clock()
    model = build("wan", "MagCacheConfig", clock)
    with ctxreplay.capture_with(model, targets="repeated") as session:
        generate(model, "wan", clock, prompt=1)
        model.disable_cache()  # diffusers puts what its hook called on the module
    report = session.finalize()
    assert report.ok, report.summary
    for block in model.blocks:  # the class's forward, bound, as diffusers leaves it
        fn = block.__dict__["forward"]
        assert fn.__func__ is type(block).forward and fn.__self__ is block


def test_a_cache_enabled_while_observed_is_served_beneath_its_hooks() -> None:
    # the session's wrappers are what the cache's hooks wrap, and stay in
    # its chain after the session closes: install still goes beneath them
    clock, twin_clock = Clock(), Clock()
    model, twin = build("wan", "FirstBlockCacheConfig", clock), \
        build("wan", "FirstBlockCacheConfig", twin_clock)
    model.disable_cache()
    with ctxreplay.capture_with(model, targets="repeated") as session:
        model.enable_cache(config("FirstBlockCacheConfig", clock))
        generate(model, "wan", clock, prompt=1)
    generate(twin, "wan", twin_clock, prompt=1)
    report = session.finalize()
    assert report.ok, report.summary
    with ctxreplay.install(model, report) as handle, \
            counted(twin, ["blocks.0", "blocks.1"]) as computed:
        got = generate(model, "wan", clock, prompt=2)
        want = generate(twin, "wan", twin_clock, prompt=2)
        hits = handle.stats().total_hits
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert hits == sum(computed.values()) < STEPS * 2
