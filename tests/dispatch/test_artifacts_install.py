"""install: matching calls of a live model run the captured programs, with
each member's own weights; everything else runs eagerly, counted as a miss
with its reason; remove() puts the model back exactly."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import io
import json
import pickle
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from digests import redigest
from manifest_audit import manifests_are_metadata_only  # noqa: F401
from torch import nn

import ctxreplay
from ctxreplay.loading.weights import bind_weights

pytestmark = [pytest.mark.filterwarnings("ignore:.*LeafSpec:FutureWarning")]


class Block(nn.Module):
    eager_calls = 0  # counts the block's own forward: a hit never runs it

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.lin = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        Block.eager_calls += 1
        out: torch.Tensor = self.lin(self.norm(x)).relu()
        return out


class Net(nn.Module):
    def __init__(self, dim: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = x + b(x)
        return x


def bf16() -> torch.autocast:
    return torch.autocast("cpu", dtype=torch.bfloat16)


def captured(model: nn.Module, *inputs: Any, **options: Any) -> ctxreplay.CaptureReport:
    options.setdefault("verify", "execute")
    with ctxreplay.capture_with(model, targets="repeated", **options) as session, bf16(), \
            torch.inference_mode():
        for x in inputs:
            model(x)
    report = session.finalize()
    assert report.ok, (report.failures, [c.fidelity for c in report.captures])
    return report


@pytest.fixture
def net() -> Net:
    torch.manual_seed(0)
    return Net().eval()


def _eager(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with bf16(), torch.inference_mode():
        out: torch.Tensor = model(x)
    return out


@pytest.mark.parametrize("kind", ["report", "loaded"])
def test_matching_calls_run_the_program_bit_identically(net: Net, tmp_path: Path,
                                                        kind: str) -> None:
    x = torch.rand(2, 16)
    report = captured(net, x)
    assert len(report.captures) == 1 and len(report.captures[0].members) == 3
    source: Any = report
    if kind == "loaded":
        report.save_all(tmp_path)
        source = ctxreplay.load(tmp_path)
    expected = _eager(net, x)
    other = torch.rand(5, 16)
    expected_other = _eager(net, other)
    with ctxreplay.install(net, source) as handle:
        Block.eager_calls = 0
        for _ in range(2):
            assert torch.equal(_eager(net, x), expected)
        assert Block.eager_calls == 0  # every block call ran the program
        stats = handle.stats()
        assert stats.hits == {"blocks.0#0": 6} and stats.total_misses == 0
        # a new input shape: no capture has that signature, so eager
        assert torch.equal(_eager(net, other), expected_other)
        assert Block.eager_calls == 3
        # the same shape under another context (no autocast): eager too
        with torch.inference_mode():
            plain = net(x)
        assert plain.dtype == torch.float32
        stats = handle.stats()
        assert stats.hits == {"blocks.0#0": 6}
        assert stats.misses == {"blocks.0": 2, "blocks.1": 2, "blocks.2": 2}
        assert stats.reasons == {"signature": 3, "context": 3}
        assert handle.members == ("blocks.0", "blocks.1", "blocks.2")


def test_each_member_runs_with_its_own_live_weights(net: Net) -> None:
    x = torch.rand(2, 16)
    report = captured(net, x)
    handle = ctxreplay.install(net, report)
    try:
        _eager(net, x)  # every member's program is bound now
        with torch.no_grad():  # updated in place: the program sees it
            net.blocks[1].lin.weight.mul_(-2.0)
        # replaced by a new tensor: re-bound (torch's registration hooks)
        net.blocks[2].lin.weight = nn.Parameter(torch.randn(16, 16))
        net.blocks[2].norm = nn.LayerNorm(16, eps=1e-5).eval()
        Block.eager_calls = 0
        got = _eager(net, x)
        assert Block.eager_calls == 0
    finally:
        handle.remove()
    assert torch.equal(got, _eager(net, x))
    assert handle.stats().total_hits == 6


def test_remove_restores_the_model_exactly(net: Net) -> None:
    x = torch.rand(2, 16)
    report = captured(net, x)

    def own(*args: Any) -> Any:  # a forward a user set on the instance before
        return Block.forward(net.blocks[1], *args)

    net.blocks[1].forward = own  # type: ignore[method-assign]
    before = [dict(b.__dict__) for b in net.blocks]
    params = [(n, p) for n, p in net.named_parameters()]
    hooks = (dict(torch.nn.modules.module._global_parameter_registration_hooks),
             dict(torch.nn.modules.module._global_module_registration_hooks))
    expected = _eager(net, x)
    handle = ctxreplay.install(net, report)
    assert all("forward" in b.__dict__ for b in net.blocks)
    assert torch.equal(_eager(net, x), expected)
    handle.remove()
    handle.remove()  # idempotent
    assert [dict(b.__dict__) for b in net.blocks] == before
    assert net.blocks[1].__dict__["forward"] is own and "forward" not in net.blocks[0].__dict__
    assert [(n, p) for n, p in net.named_parameters()] == params
    assert (dict(torch.nn.modules.module._global_parameter_registration_hooks),
            dict(torch.nn.modules.module._global_module_registration_hooks)) == hooks
    Block.eager_calls = 0
    assert torch.equal(_eager(net, x), expected) and Block.eager_calls == 3


def test_copies_of_an_installed_model_are_plain_models(net: Net) -> None:
    # a deep copy, a pickle or a torch.save of the model while installed must
    # neither carry the dispatch wrappers nor dispatch (the copy has its own
    # weights, which the captures were never checked against)
    x = torch.rand(2, 16)
    report = captured(net, x)
    expected = _eager(net, x)
    inspect_before = inspect.signature(net.blocks[0].forward)
    handle = ctxreplay.install(net, report)
    assert "forward" in net.blocks[0].__dict__
    assert inspect.signature(net.blocks[0].forward) == inspect_before
    buf = io.BytesIO()
    torch.save(net, buf)
    for twin in (copy.deepcopy(net), pickle.loads(pickle.dumps(net)),
                 torch.load(io.BytesIO(buf.getvalue()), weights_only=False)):
        assert not [n for n, m in twin.named_modules()
                    if {"forward", "__deepcopy__", "__reduce_ex__"} & set(m.__dict__)]
        hits = handle.stats().total_hits
        Block.eager_calls = 0
        assert torch.equal(_eager(twin, x), expected)
        assert Block.eager_calls == 3 and handle.stats().total_hits == hits
    assert torch.equal(_eager(net, x), expected) and handle.stats().total_hits > 0
    handle.remove()
    assert not [n for n, m in net.named_modules()
                if {"forward", "__deepcopy__", "__reduce_ex__"} & set(m.__dict__)]


def test_a_training_flag_changed_after_install_is_a_miss(net: Net) -> None:
    x = torch.rand(2, 16)
    with ctxreplay.install(net, captured(net, x)) as handle:
        net.train()
        Block.eager_calls = 0
        _eager(net, x)
        assert Block.eager_calls == 3 and handle.stats().reasons == {"training": 3}


@pytest.mark.parametrize("kind", ["report", "loaded"])
def test_a_member_changed_before_install_is_an_identity_miss(net: Net, tmp_path: Path,
                                                             kind: str) -> None:
    x = torch.rand(2, 16)
    report = captured(net, x)
    source: Any = report
    if kind == "loaded":
        report.save_all(tmp_path / "saved")
        source = ctxreplay.load(tmp_path / "saved")
    net.blocks[1].norm.eps = 0.5  # a plain attribute the program has baked in
    (c,) = report.captures
    # the program run with that member's weights no longer computes what it does
    program = bind_weights(c.artifact, net.blocks[1], c.binding)
    h = torch.rand(2, 16)
    assert not torch.equal(_eager(program, h), _eager(net.blocks[1], h))
    expected = _eager(net, x)
    with ctxreplay.install(net, source) as handle:
        assert torch.equal(_eager(net, x), expected)
        stats = handle.stats()
        assert stats.hits == {"blocks.0#0": 2} and stats.reasons == {"identity": 1}
        assert stats.unusable == {"blocks.0#0@blocks.1": "identity"}
        # a submodule replaced after install by one in train mode: not the
        # member the capture was made from (dropout, batch norm would differ)
        net.blocks[2].norm = nn.LayerNorm(16)
        assert torch.equal(_eager(net, x), _eager_uninstalled(net, x, handle))
        assert handle.stats().unusable["blocks.0#0@blocks.2"] == "identity"


@pytest.mark.parametrize("kind", ["report", "loaded"])
def test_an_attribute_assigned_after_a_dispatched_call_is_an_identity_miss(
        net: Net, tmp_path: Path, kind: str) -> None:
    x = torch.rand(2, 16)
    report = captured(net, x)
    source: Any = report
    if kind == "loaded":
        report.save_all(tmp_path / "saved")
        source = ctxreplay.load(tmp_path / "saved")
    with ctxreplay.install(net, source) as handle:
        assert torch.equal(_eager(net, x), _eager_uninstalled(net, x, handle))
        assert handle.stats().hits == {"blocks.0#0": 3}  # each member bound and dispatched
        # after that, a plain attribute the program has baked in is assigned
        net.blocks[1].norm.eps = 0.5
        expected = _eager_uninstalled(net, x, handle)
        # the oracle: the program bound to that member no longer computes what it does
        (c,) = report.captures
        program = bind_weights(c.artifact, net.blocks[1], c.binding)
        h = torch.rand(2, 16)
        assert not torch.equal(_eager(program, h), _eager(net.blocks[1], h))
        assert torch.equal(_eager(net, x), expected)
        stats = handle.stats()
        # (the oracle's own call of blocks.1 above was dispatched too: a miss)
        assert stats.hits == {"blocks.0#0": 5} and stats.reasons == {"identity": 2}
        assert stats.unusable == {"blocks.0#0@blocks.1": "identity"}
        # set back as it was captured: dispatched again
        net.blocks[1].norm.eps = 1e-5
        assert torch.equal(_eager(net, x), _eager_uninstalled(net, x, handle))
        assert handle.stats().hits == {"blocks.0#0": 8} and handle.stats().unusable == {}


def _eager_uninstalled(model: nn.Module, x: torch.Tensor,
                       handle: ctxreplay.InstallHandle) -> torch.Tensor:
    """``model``'s eager output, dispatch switched off for the call."""
    slots = handle._slots
    for s in slots:
        s.off = True
    try:
        return _eager(model, x)
    finally:
        for s in slots:
            s.off = False


def test_compile_is_applied_once_per_member(net: Net) -> None:
    x = torch.rand(2, 16)
    report = captured(net, x)
    seen: list[nn.Module] = []

    def compiler(gm: nn.Module) -> Callable[..., Any]:
        seen.append(gm)
        return gm

    expected = _eager(net, x)
    with ctxreplay.install(net, report, compile=compiler) as handle:
        for _ in range(3):
            assert torch.equal(_eager(net, x), expected)
        assert len(seen) == 3 and len({id(g) for g in seen}) == 3
        assert sorted(handle.stats().compiled) == [f"blocks.0#0@blocks.{i}" for i in range(3)]
        assert handle.stats().total_hits == 9


@pytest.mark.parametrize("where", ["compiling", "first call"])
def test_a_failing_compiler_warns_and_leaves_the_member_eager(net: Net, where: str) -> None:
    x = torch.rand(2, 16)
    report = captured(net, x)

    def broken(*_args: Any) -> Any:
        raise RuntimeError("no kernel for this")

    compiler = broken if where == "compiling" else (lambda gm: broken)
    expected = _eager(net, x)
    with ctxreplay.install(net, report, compile=compiler) as handle:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            assert torch.equal(_eager(net, x), expected)
            assert torch.equal(_eager(net, x), expected)
        assert sorted(str(w.message) for w in seen) == [
            f"ctxreplay.install: compiling blocks.0#0@blocks.{i} failed; its calls run eagerly"
            for i in range(3)]  # once per member
        stats = handle.stats()
        assert stats.total_hits == 0 and stats.reasons == {"compile_failed": 6}
        assert stats.unusable["blocks.0#0@blocks.1"] == "compile_failed"


def test_weights_that_do_not_fit_are_a_structure_miss(net: Net) -> None:
    report = captured(net, torch.rand(2, 16))
    torch.manual_seed(1)
    wide = Net(dim=16).eval()
    wide.blocks[1].lin = nn.Linear(16, 16, bias=False)  # same names but one
    x = torch.rand(2, 16)
    expected = _eager(wide, x)
    with ctxreplay.install(wide, report) as handle:
        assert torch.equal(_eager(wide, x), expected)
        stats = handle.stats()
        assert stats.hits == {"blocks.0#0": 2} and stats.reasons == {"structure": 1}
        assert stats.unusable == {"blocks.0#0@blocks.1": "structure"}


def test_sources_and_members_are_checked(net: Net) -> None:
    report = captured(net, torch.rand(2, 16))
    with pytest.raises(TypeError, match="source must be a CaptureReport"):
        ctxreplay.install(net, "captures/")
    with pytest.raises(ValueError, match=r"the model has no submodule 'blocks\.2'"):
        ctxreplay.install(Net(depth=2), report)
    with pytest.raises(ValueError, match="object_args: 'maybe'"):
        ctxreplay.install(net, report, object_args="maybe")
    with pytest.raises(TypeError, match="compile must be"):
        ctxreplay.install(net, report, compile="inductor")  # type: ignore[arg-type]
    # captures of another backend are not dispatched
    sym = captured(net, torch.rand(2, 16), backend="symbolic", verify="signature")
    with ctxreplay.install(net, sym) as handle:
        _eager(net, torch.rand(2, 16))
        assert handle.stats().unusable == {"blocks.0#0": "backend_not_dispatchable"}
        assert handle.stats().reasons == {"backend_not_dispatchable": 3}


def _copy_edit(src: Path, tmp_path: Path, name: str, change: Callable[[Any], Any]) -> Path:
    target = tmp_path / "copy"
    shutil.copytree(src, target)
    path = target / name if name != "*sidecar" else next(target.glob("*.pt2.json"))
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc))
    if name == "*sidecar":
        redigest(target)  # saved so, not edited after
    return target


def test_a_loaded_capture_whose_needs_fail_is_never_dispatched(net: Net,
                                                               tmp_path: Path) -> None:
    x = torch.rand(2, 16)
    report = captured(net, x)
    report.save_all(tmp_path / "saved")
    copy = _copy_edit(tmp_path / "saved", tmp_path, "manifest.json",
                      lambda d: d["environment"].update(torch="1.0.0"))
    expected = _eager(net, x)
    with ctxreplay.install(net, ctxreplay.load(copy)) as handle:
        assert torch.equal(_eager(net, x), expected)
        assert handle.stats().unusable == {"blocks.0#0": "environment"}
        assert handle.stats().reasons == {"environment": 3}


def test_an_unknown_probe_keeps_a_loaded_capture_eager_unless_ignored(
        net: Net, tmp_path: Path) -> None:
    x = torch.rand(2, 16)
    captured(net, x).save_all(tmp_path / "saved")

    def add(d: Any) -> None:
        d["snapshot"]["probes"]["acme"] = {"portable": True, "state": {"on": True}}
        d["ambient_only"].append("acme")

    copy = _copy_edit(tmp_path / "saved", tmp_path, "*sidecar", add)
    with pytest.warns(ctxreplay.probes.UnknownProbeWarning, match="acme"):
        loaded = ctxreplay.load(copy)
    with ctxreplay.install(net, loaded) as handle:
        _eager(net, x)
        assert handle.stats().reasons == {"unknown_probe": 3}
    with ctxreplay.install(net, loaded, ignore=["acme"]) as handle:
        expected = _eager(net, x)
        assert handle.stats().total_hits == 3
    assert torch.equal(_eager(net, x), expected)


# -- calls that take Python objects ------------------------------------------------------

@dataclasses.dataclass
class Meta:
    scale: float
    bias: torch.Tensor


@dataclasses.dataclass
class Out:
    y: torch.Tensor
    norm: torch.Tensor


class MetaBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, meta: Meta) -> Out:
        y = self.lin(x) * meta.scale + meta.bias
        return Out(y, y.norm())


class MetaNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MetaBlock() for _ in range(2))

    def forward(self, x: torch.Tensor, meta: Meta) -> torch.Tensor:
        for b in self.blocks:
            x = b(x, meta).y
        return x


def test_object_arguments_run_eagerly_unless_dispatch_is_asked() -> None:
    torch.manual_seed(0)
    model = MetaNet().eval()
    meta = Meta(0.5, torch.rand(8))
    x = torch.rand(2, 8)
    with ctxreplay.capture_with(model, targets="repeated", verify="execute") as session, \
            torch.no_grad():
        expected = model(x, meta)
    report = session.finalize()
    assert report.ok and report.captures[0].binding == "flattened"
    with ctxreplay.install(model, report) as handle, torch.no_grad():
        assert torch.equal(model(x, meta), expected)
        assert handle.stats().reasons == {"object_arguments": 2}
    with ctxreplay.install(model, report, object_args="dispatch") as handle, torch.no_grad():
        out = model.blocks[0](x, meta)
        assert isinstance(out, Out) and torch.equal(out.y, model.blocks[0].lin(x) * 0.5
                                                    + meta.bias)
        assert torch.equal(model(x, meta), expected)
        assert handle.stats().total_hits == 3
        # another scale is another signature (the graph baked 0.5 in): eager
        other = Meta(2.0, meta.bias)
        y = model.blocks[1](model.blocks[0].lin(x) * 2.0 + meta.bias, other).y
        assert torch.equal(y, model.blocks[1].lin(model.blocks[0].lin(x) * 2.0 + meta.bias)
                           * 2.0 + meta.bias)
        assert handle.stats().reasons == {"signature": 1}


class Cache:
    def __init__(self) -> None:
        self.seen: list[torch.Tensor] = []
        self.keys = torch.zeros(0, 8)


class CachingBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, cache: Cache) -> torch.Tensor:
        cache.keys = torch.cat([cache.keys, x])  # a Python-level assignment of a new tensor
        out: torch.Tensor = self.lin(x) + cache.keys.sum()
        return out


def test_a_forward_assigning_a_tensor_to_an_argument_object_writes_it_when_dispatched(
        ) -> None:
    # CachingBlock assigns cache.keys a longer tensor: the program returns
    # it beside the output, and a dispatched call assigns it to the live
    # cache, as the eager forward does
    torch.manual_seed(0)
    model = nn.Sequential()
    model.blocks = nn.ModuleList(CachingBlock() for _ in range(2))
    x = torch.rand(1, 8)
    with ctxreplay.capture_with(model, targets="repeated", verify="signature") as session, \
            torch.no_grad():
        for b in model.blocks:
            b(x, Cache())
    report = session.finalize()
    assert report.ok
    [capture] = report.captures
    assert capture.assigned is not None
    assert ["".join(p) for p in capture.assigned.tensors] == ["args[1].keys"]
    eager_cache = Cache()
    with torch.no_grad():
        eager_out = model.blocks[0](x, eager_cache)
    for policy, hits in (("eager", 0), ("dispatch", 1)):
        with ctxreplay.install(model, report, object_args=policy) as handle, torch.no_grad():
            cache = Cache()
            out = model.blocks[0](x, cache)
            assert handle.stats().total_hits == hits
            assert handle.stats().reasons == ({} if hits else {"object_arguments": 1})
            # the live cache got its update, as without install
            assert cache.keys.shape == eager_cache.keys.shape == (1, 8)
            assert torch.equal(cache.keys, eager_cache.keys)
            assert torch.equal(out, eager_out)


def test_train_mode_batchnorm_updates_the_members_buffers() -> None:
    torch.manual_seed(0)

    class BN(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bn = nn.BatchNorm1d(8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.bn(x)
            return out

    model = nn.Sequential(BN(), BN()).train()
    x = torch.rand(4, 8)
    with ctxreplay.capture_with(model, targets="repeated", verify="execute") as session, \
            torch.no_grad():
        model(x)
    report = session.finalize()
    assert report.ok, [c.fidelity for c in report.captures]
    twin = nn.Sequential(BN(), BN()).train()
    twin.load_state_dict(model.state_dict())
    with torch.no_grad():
        expected = twin(x)
    with ctxreplay.install(model, report) as handle, torch.no_grad():
        got = model(x)
        assert handle.stats().total_hits == 2
    assert torch.equal(got, expected)
    for a, b in zip(model.modules(), twin.modules()):
        if isinstance(a, nn.BatchNorm1d):
            assert torch.equal(a.running_mean, b.running_mean)  # type: ignore[arg-type]
            assert torch.equal(a.num_batches_tracked, b.num_batches_tracked)  # type: ignore[arg-type]


def test_dispatch_never_breaks_the_forward_on_an_observation_error(net: Net) -> None:
    x = torch.rand(2, 16)
    report = captured(net, x)
    expected = _eager(net, x)
    with ctxreplay.install(net, report) as handle:
        slot = handle._slots[0]
        obs = slot.groups[0][0]

        def failing() -> Any:
            raise RuntimeError("probe exploded")

        slot.groups[0] = (failing, slot.groups[0][1])  # type: ignore[assignment]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert torch.equal(_eager(net, x), expected)
        slot.groups[0] = (obs, slot.groups[0][1])
        assert handle.stats().reasons == {"observe_error": 1}


def test_a_numerics_flag_changed_between_model_calls_is_a_context_miss(net: Net) -> None:
    from torchstate import cudnn_allow_tf32

    x = torch.rand(2, 16)
    report = captured(net, x)
    with ctxreplay.install(net, report) as handle:
        _eager(net, x)
        flag = torch.backends.cudnn.allow_tf32
        with cudnn_allow_tf32(not flag):  # read once per model call, not per block
            _eager(net, x)
            Block.eager_calls = 0
            with bf16(), torch.inference_mode():
                net.blocks[0](x)  # a block called outside the model: checked there
            assert Block.eager_calls == 1
        _eager(net, x)
        stats = handle.stats()
        assert stats.hits == {"blocks.0#0": 6}
        assert stats.reasons == {"context": 4}
