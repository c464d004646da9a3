"""ContextSnapshot: JSON round trips, strict decoding, non-portable states,
hashing and comparison, diff and without, and the cached default observer."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import pytest
import torch
import torchstate as ts
from probe_cases import CASES, Case

import ctxreplay
from ctxreplay.core.snapshots import SCHEMA
from ctxreplay.probes.autocast import AutocastState
from ctxreplay.testing import global_state

PORTABLE_CASES = [c for c in CASES if ctxreplay.probes.get_probe(c.probe).portable]


def _through_json(snap: ctxreplay.ContextSnapshot) -> Any:
    return json.loads(json.dumps(snap.to_json(), allow_nan=False))


@pytest.mark.parametrize("case", PORTABLE_CASES, ids=lambda c: c.id)
def test_json_round_trip_of_every_portable_probe(case: Case) -> None:
    neutral = ctxreplay.snapshot([case.probe])
    with case.make():
        snap = ctxreplay.snapshot([case.probe])
        live_effect = case.effect()
    assert snap != neutral

    back = ctxreplay.ContextSnapshot.from_json(_through_json(snap))
    assert back == snap and hash(back) == hash(snap)
    assert back.unresolved == ()
    assert back != neutral
    with back.replay():
        assert ctxreplay.snapshot([case.probe]) == snap
        assert case.effect() == live_effect
    assert ctxreplay.snapshot([case.probe]) == neutral


def test_json_round_trip_of_everything_at_once() -> None:
    names = [*ctxreplay.probes.default_probes(), "rng"]
    with contextlib_all([c.make for c in CASES if c.id in {
        "autocast-cpu-bf16-cache-off", "grad-inference_mode", "determinism-warn_only",
        "default_dtype-float64", "default_device-meta", "matmul-medium", "rng-after-draws",
    }]):
        snap = ctxreplay.snapshot(names)
        live = global_state()
    assert set(snap.names) == set(names)
    doc = _through_json(snap)
    assert doc["schema"] == SCHEMA
    assert all(entry["portable"] for entry in doc["probes"].values())
    back = ctxreplay.ContextSnapshot.from_json(doc)
    assert back == snap
    neutral = global_state()
    assert neutral != live
    with back.replay():
        assert ctxreplay.snapshot(names) == snap
        assert global_state() == live
    assert global_state() == neutral


@contextmanager
def contextlib_all(makers: list[Callable[[], AbstractContextManager[Any]]]) -> Iterator[None]:
    if not makers:
        yield
        return
    with makers[0](), contextlib_all(makers[1:]):
        yield


# -- malformed documents -------------------------------------------------------

def _base_doc() -> dict[str, Any]:
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        doc: dict[str, Any] = _through_json(
            ctxreplay.snapshot([*ctxreplay.probes.default_probes(), "rng"]))
    return doc


def _set(*path: Any, value: Any) -> Callable[[dict[str, Any]], Any]:
    def mutate(doc: dict[str, Any]) -> Any:
        target = doc
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
        return doc
    return mutate


def _drop(*path: Any) -> Callable[[dict[str, Any]], Any]:
    def mutate(doc: dict[str, Any]) -> Any:
        target = doc
        for key in path[:-1]:
            target = target[key]
        del target[path[-1]]
        return doc
    return mutate


P = ("probes",)
AC = (*P, "autocast", "state")
MALFORMED: list[tuple[str, Callable[[dict[str, Any]], Any], str]] = [
    ("not-an-object", lambda d: [d], "$: expected an object, got list"),
    ("wrong-schema", _set("schema", value="ctxreplay.snapshot/2"), "$.schema: unsupported schema"),
    ("schema-type", _set("schema", value=1), "$.schema: expected a string"),
    ("missing-schema", _drop("schema"), "$.schema: missing required field"),
    ("missing-probes", _drop("probes"), "$.probes: missing required field"),
    ("extra-top-key", _set("extra", value=1), "$.extra: unknown field"),
    ("probes-type", _set("probes", value=[]), "$.probes: expected an object"),
    ("unknown-probe", _set(*P, "nope", value={"portable": True, "state": 1}),
     "$.probes.nope: unknown probe 'nope'"),
    ("entry-type", _set(*P, "autocast", value=True), "$.probes.autocast: expected an object"),
    ("missing-portable", _drop(*P, "autocast", "portable"),
     "$.probes.autocast.portable: missing required field"),
    ("portable-type", _set(*P, "autocast", "portable", value="yes"),
     "$.probes.autocast.portable: expected a boolean"),
    ("missing-state", _drop(*P, "autocast", "state"),
     "$.probes.autocast.state: missing required field"),
    ("extra-entry-key", _set(*P, "autocast", "extra", value=1),
     "$.probes.autocast.extra: unknown field"),
    ("unresolved-type-type", _set(*P, "autocast", value={"portable": False, "type": 5}),
     "$.probes.autocast.type: expected a string"),
    ("autocast-enabled-type", _set(*AC, "enabled", value="cpu"),
     "$.probes.autocast.state.enabled: expected a list"),
    ("autocast-unknown-dtype", _set(*AC, "enabled", value=[["cpu", "bfloat17"]]),
     "$.probes.autocast.state.enabled[0][1]: unknown dtype 'bfloat17'"),
    ("autocast-dtype-type", _set(*AC, "enabled", value=[["cpu", 16]]),
     "$.probes.autocast.state.enabled[0][1]: expected a string"),
    ("autocast-unknown-device", _set(*AC, "enabled", value=[["gpu", "bfloat16"]]),
     "$.probes.autocast.state.enabled[0][0]: 'gpu' is not one of"),
    ("autocast-short-pair", _set(*AC, "enabled", value=[["cpu"]]),
     "$.probes.autocast.state.enabled[0]: expected [device_type, dtype]"),
    ("autocast-long-pair", _set(*AC, "enabled", value=[["cpu", "bfloat16", "x"]]),
     "$.probes.autocast.state.enabled[0]: list longer than 2"),
    ("autocast-twice", _set(*AC, "enabled", value=[["cpu", "bfloat16"], ["cpu", "float16"]]),
     "$.probes.autocast.state.enabled: a device type is listed twice"),
    ("autocast-missing-cache", _drop(*AC, "cache_enabled"),
     "$.probes.autocast.state.cache_enabled: missing required field"),
    ("autocast-cache-int", _set(*AC, "cache_enabled", value=1),
     "$.probes.autocast.state.cache_enabled: expected a boolean, got int"),
    ("autocast-extra", _set(*AC, "fast", value=True),
     "$.probes.autocast.state.fast: unknown field"),
    ("device-bad-chars", _set(*P, "default_device", "state", value="CUDA:0"),
     "$.probes.default_device.state: 'CUDA:0' is not a device string"),
    ("device-unknown", _set(*P, "default_device", "state", value="warp_drive"),
     "$.probes.default_device.state: 'warp_drive' is not a device torch knows"),
    ("device-bad-index", _set(*P, "default_device", "state", value="cpu:x"),
     "$.probes.default_device.state: 'cpu:x' is not a device torch knows"),
    ("device-empty", _set(*P, "default_device", "state", value=""),
     "$.probes.default_device.state: '' is not a device string"),
    ("device-type", _set(*P, "default_device", "state", value=0),
     "$.probes.default_device.state: expected a string"),
    ("dtype-unknown", _set(*P, "default_dtype", "state", value="float17"),
     "$.probes.default_dtype.state: unknown dtype 'float17'"),
    ("dtype-not-float", _set(*P, "default_dtype", "state", value="int64"),
     "$.probes.default_dtype.state: int64 cannot be a default dtype"),
    ("determinism-type", _set(*P, "determinism", "state", "warn_only", value=None),
     "$.probes.determinism.state.warn_only: expected a boolean, got NoneType"),
    ("determinism-missing", _drop(*P, "determinism", "state", "cudnn_benchmark"),
     "$.probes.determinism.state.cudnn_benchmark: missing required field"),
    ("grad-type", _set(*P, "grad_mode", "state", "inference_mode", value="true"),
     "$.probes.grad_mode.state.inference_mode: expected a boolean, got str"),
    ("matmul-precision", _set(*P, "matmul_precision", "state", "float32_matmul_precision",
                              value="low"),
     "$.probes.matmul_precision.state.float32_matmul_precision: 'low' is not one of"),
    ("matmul-unknown-flag", _set(*P, "matmul_precision", "state", "flags", "warp", value=True),
     "$.probes.matmul_precision.state.flags.warp: unknown field"),
    ("matmul-flag-type", _set(*P, "matmul_precision", "state", "flags", "cudnn_tf32", value=0),
     "$.probes.matmul_precision.state.flags.cudnn_tf32: expected a boolean"),
    ("rng-base64", _set(*P, "rng", "state", "cpu", value="!!!"),
     "$.probes.rng.state.cpu: not valid base64"),
    ("rng-length", _set(*P, "rng", "state", "cpu", value="AAAA"),
     "$.probes.rng.state.cpu: wrong length"),
    ("rng-accelerator", _set(*P, "rng", "state", "accelerator", value="tpu"),
     "$.probes.rng.state.accelerator: 'tpu' is not one of"),
    ("rng-accelerator-state", _set(*P, "rng", "state", "accelerator", value="cuda"),
     "$.probes.rng.state.accelerator_state: missing required field"),
]


def test_base_document_is_valid() -> None:
    doc = _base_doc()
    snap = ctxreplay.ContextSnapshot.from_json(doc)
    assert snap["autocast"] == AutocastState((("cpu", torch.bfloat16),))


@pytest.mark.parametrize(("mutate", "message"), [(m, msg) for _, m, msg in MALFORMED],
                         ids=[i for i, _, _ in MALFORMED])
def test_malformed_documents_name_the_bad_path(mutate: Callable[[dict[str, Any]], Any],
                                               message: str) -> None:
    doc = mutate(copy.deepcopy(_base_doc()))
    with pytest.raises(ValueError) as info:
        ctxreplay.ContextSnapshot.from_json(doc)
    assert message in str(info.value)


def test_a_probe_decoder_raising_another_type_becomes_a_value_error() -> None:
    class Fragile(ctxreplay.probes.ContextProbe[int]):
        name = "fragile"

        def observe(self) -> int:
            return 0

        def replay(self, state: int) -> AbstractContextManager[None]:
            return contextlib_all([])

        def decode(self, data: Any, path: str) -> int:
            return int(data["value"])  # KeyError / TypeError on bad input

    doc = {"schema": SCHEMA, "probes": {"fragile": {"portable": True, "state": {}}}}
    with pytest.raises(ValueError, match=r"\$\.probes\.fragile\.state: could not be decoded"):
        ctxreplay.ContextSnapshot.from_json(doc, probes=[Fragile()])


def test_a_custom_root_path_prefixes_every_message() -> None:
    doc = _set(*AC, "cache_enabled", value=1)(_base_doc())
    with pytest.raises(ValueError, match=r"^report\.captures\[3\]\.snapshot\.probes\.autocast"):
        ctxreplay.ContextSnapshot.from_json(doc, path="report.captures[3].snapshot")


# -- non-portable states -------------------------------------------------------

class Frame:
    pass


_frames: list[Frame] = []


def _get_frame() -> Frame:
    if not _frames:
        raise LookupError("no frame")
    return _frames[-1]


@contextmanager
def _set_frame(frame: Frame) -> Iterator[None]:
    _frames.append(frame)
    try:
        yield
    finally:
        _frames.pop()


def test_a_non_portable_state_is_marked_and_unresolved_after_loading() -> None:
    fwd = ctxreplay.probes.ForwardContextProbe(_get_frame, _set_frame, name="frame")
    with _set_frame(Frame()), torch.autocast("cpu", dtype=torch.bfloat16):
        snap = ctxreplay.snapshot([fwd, "autocast"])
    doc = _through_json(snap)
    assert doc["probes"]["frame"] == {"portable": False, "type": "LiveState"}
    assert doc["probes"]["autocast"]["portable"] is True

    with pytest.raises(ValueError, match=r"\$\.probes\.frame: unknown probe 'frame'"):
        ctxreplay.ContextSnapshot.from_json(doc)  # the registry does not know it

    back = ctxreplay.ContextSnapshot.from_json(doc, probes=[fwd])
    assert back.unresolved == ("frame",)
    assert back != snap
    assert back["autocast"] == snap["autocast"]
    assert "not portable" in back.describe()["frame"]
    with pytest.raises(ValueError, match="frame"), back.replay():
        pass
    with pytest.raises(ValueError, match="frame"):
        back.replay_parts()
    assert _through_json(back)["probes"]["frame"] == {"portable": False, "type": "LiveState"}

    # Without the unresolved probe the rest replays.
    with back.without("frame").replay():
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16
        assert torch.is_autocast_enabled("cpu")
    assert not torch.is_autocast_enabled("cpu")

    # A live snapshot of the same probe still replays (before clear()).
    with snap.replay():
        assert isinstance(_get_frame(), Frame)
    fwd.clear()


def test_a_registered_non_portable_probe_resolves_by_name() -> None:
    fwd = ctxreplay.probes.ForwardContextProbe(_get_frame, _set_frame, name="frame_registered")
    ctxreplay.probes.register_probe(fwd)
    try:
        with _set_frame(Frame()):
            snap = ctxreplay.snapshot(["frame_registered"])
        back = ctxreplay.ContextSnapshot.from_json(_through_json(snap))
        assert back.unresolved == ("frame_registered",)
        assert back.probes[0] is fwd
    finally:
        ctxreplay.probes.unregister_probe("frame_registered")


# -- identity, comparison, diff -----------------------------------------------

def test_snapshots_are_hashable_and_compare_by_state() -> None:
    a = ctxreplay.snapshot()
    b = ctxreplay.snapshot(ctxreplay.probes.default_probes())  # a fresh observer
    with torch.autocast("cpu", dtype=torch.bfloat16):
        c = ctxreplay.snapshot()
    assert a == b and hash(a) == hash(b)
    assert a != c
    assert len({a, b, c}) == 2
    table = {a: "neutral", c: "bf16"}
    assert table[b] == "neutral"
    assert a != a.without("autocast")
    assert a != "not a snapshot"


def test_snapshot_access() -> None:
    snap = ctxreplay.snapshot(["rng", "autocast"])
    assert snap.names == ("autocast", "rng")  # replay order: sorted by name
    assert "autocast" in snap and "grad_mode" not in snap
    assert dict(snap.items())["autocast"] == snap["autocast"]
    with pytest.raises(KeyError, match="grad_mode"):
        snap["grad_mode"]
    assert set(snap.describe()) == {"autocast", "rng"}
    assert snap.describe()["autocast"] == "off"


def test_diff_lists_exactly_the_differing_probes() -> None:
    a = ctxreplay.snapshot()
    with torch.autocast("cpu", dtype=torch.bfloat16), \
            torch.device("meta"):
        b = ctxreplay.snapshot()
    with torch.no_grad():
        c = ctxreplay.snapshot()
    assert a.diff(a) == ()
    assert [(d.probe, d.left, d.right) for d in a.diff(b)] == [
        ("autocast", "off", "cpu:bfloat16"), ("default_device", "cpu", "meta")]
    assert [(d.probe, d.left, d.right) for d in b.diff(a)] == [
        ("autocast", "cpu:bfloat16", "off"), ("default_device", "meta", "cpu")]
    assert [d.probe for d in a.diff(c)] == ["grad_mode"]
    assert [d.probe for d in b.diff(c)] == ["autocast", "default_device", "grad_mode"]
    # Probes present on one side only are listed with None on the other.
    assert [(d.probe, d.left, d.right) for d in a.diff(b.without("autocast"))] == [
        ("autocast", "off", None), ("default_device", "cpu", "meta")]
    assert [(d.probe, d.left, d.right) for d in a.without("grad_mode").diff(a)] == [
        ("grad_mode", None, "grad")]


def test_without() -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        snap = ctxreplay.snapshot()
    rest = snap.without("autocast", "not_a_probe")
    assert "autocast" not in rest
    assert rest.names == tuple(n for n in snap.names if n != "autocast")
    assert rest["grad_mode"] == snap["grad_mode"]
    with rest.replay():
        assert not torch.is_grad_enabled()
        assert not torch.is_autocast_enabled("cpu")  # left out: not replayed
    assert snap.without() == snap


# -- the cached default observer -----------------------------------------------

@pytest.mark.parametrize("case", [c for c in CASES if c.probe in ctxreplay.probes.default_probes()],
                         ids=lambda c: c.id)
def test_cached_default_snapshot_sees_every_change(case: Case) -> None:
    """``snapshot()`` reuses its last result while GlobalStateGuard holds; the
    blind spots (default device, autocast dtype, inference mode, cuDNN) must
    still invalidate it."""
    before = ctxreplay.snapshot()
    assert ctxreplay.snapshot() is before  # cached
    with case.make():
        inside = ctxreplay.snapshot()
        fresh = ctxreplay.snapshot(ctxreplay.probes.default_probes())
    assert inside == fresh
    assert inside != before
    assert ctxreplay.snapshot() == before


def test_cached_snapshot_sees_blind_spot_switches_under_an_unchanged_guard() -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = ctxreplay.snapshot()
        torch.set_autocast_dtype("cpu", torch.float16)
        try:
            assert ctxreplay.snapshot()["autocast"] == AutocastState((("cpu", torch.float16),))
        finally:
            torch.set_autocast_dtype("cpu", torch.bfloat16)
        assert ctxreplay.snapshot() == bf16
    with torch.no_grad():
        no_grad = ctxreplay.snapshot()
        with torch.inference_mode():
            assert ctxreplay.snapshot() != no_grad
        assert ctxreplay.snapshot() == no_grad
    with torch.backends.cudnn.flags(enabled=True, benchmark=True):
        assert ctxreplay.snapshot()["determinism"].cudnn_benchmark
    with ts.matmul_precision("high"):
        high = ctxreplay.snapshot()
        # The guard sees only allow_tf32, which "high" and "medium" both set.
        with ts.matmul_precision("medium"):
            assert ctxreplay.snapshot()["matmul_precision"].float32_matmul_precision == "medium"
        assert ctxreplay.snapshot() == high
    with torch.device("meta"):
        assert ctxreplay.snapshot()["default_device"] == "meta"


# -- the cached check ----------------------------------------------------------------

def test_checker_compares_by_identity_then_equality_and_stops_at_the_first_miss() -> None:
    from ctxreplay.core.observer import checker

    calls: list[str] = []

    def getter(name: str, value: object) -> Callable[[], object]:
        def get() -> object:
            calls.append(name)
            return value
        return get

    nan = float("nan")
    same = checker(((getter("a", nan), nan), (getter("b", [1, 2]), [1, 2])))
    assert same() and calls == ["a", "b"]  # nan is itself; equal lists are equal
    calls.clear()
    differs = checker(((getter("a", 1), 2), (getter("b", 3), 3)))
    assert not differs() and calls == ["a"]
    assert checker(())()

    def broken() -> object:
        raise RuntimeError("a getter that raises")
    with pytest.raises(RuntimeError, match="raises"):
        checker(((getter("a", 1), 1), (broken, 0)))()
