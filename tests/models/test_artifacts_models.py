"""From capture to use on real models: a tiny transformers Llama and a tiny
diffusers Wan video transformer, captured under CPU bfloat16 autocast and
inference mode, saved with save_all, loaded and checked in a fresh process
that reproduces every live block call by value; checked under other ambient
states; and dispatched back into the live models with install.

Needs the ``models`` extra; a missing package skips its model."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import real_models
import torch
from manifest_audit import manifests_are_metadata_only  # noqa: F401
from torch import nn
from torchstate import default_dtype

import ctxreplay
from ctxreplay.specs.signature import tensor_values

pytestmark = [pytest.mark.models,
              pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning")]


def _llama() -> tuple[nn.Module, list[dict[str, Any]], list[dict[str, Any]]]:
    model = real_models.llama()
    live = [{"input_ids": torch.randint(0, 128, (1, n)), "use_cache": False} for n in (8, 5)]
    new = [{"input_ids": torch.randint(0, 128, (1, 3)), "use_cache": False}]
    return model, live, new


def _wan() -> tuple[nn.Module, list[dict[str, Any]], list[dict[str, Any]]]:
    model = real_models.wan()

    def call(frames: int, size: int) -> dict[str, Any]:
        return {"hidden_states": torch.rand(1, 4, frames, size, size),
                "timestep": torch.tensor([3]), "encoder_hidden_states": torch.rand(1, 4, 16)}

    return model, [call(2, 8)], [call(1, 8)]


MODELS: dict[str, Callable[[], tuple[nn.Module, list[dict[str, Any]], list[dict[str, Any]]]]] = {
    "llama": _llama, "wan": _wan}


def _out(result: Any) -> torch.Tensor:
    out = getattr(result, "logits", None)
    if out is None:
        out = result.sample
    assert isinstance(out, torch.Tensor)
    return out


def _live() -> Any:
    return torch.autocast("cpu", dtype=torch.bfloat16), torch.inference_mode()


class Setup:
    """A model captured live, every block call recorded by hooks (inputs
    before the forward, output after), and the captures saved."""

    def __init__(self, name: str, root: Path) -> None:
        self.name = name
        self.model, self.inputs, self.new_inputs = MODELS[name]()
        self.calls: dict[str, list[tuple[Any, Any, Any]]] = {}
        handles = []
        targets = [n for n, m in self.model.named_modules()
                   if n.rsplit(".", 1)[0] in ("model.layers", "blocks") and n[-1].isdigit()]
        for member in targets:
            module = self.model.get_submodule(member)
            handles.append(module.register_forward_pre_hook(self._pre(member),
                                                            with_kwargs=True))
            handles.append(module.register_forward_hook(self._post(member), with_kwargs=True))
        autocast, inference = _live()
        with ctxreplay.capture_with(self.model, targets="repeated",
                                    verify="execute") as session, autocast, inference:
            self.outputs = [_out(self.model(**kw)).clone() for kw in self.inputs]
        for h in handles:
            h.remove()
        self.report = session.finalize()
        assert self.report.ok, (self.report.failures, self.report.problems)
        self.directory = root / name
        saved = self.report.save_all(self.directory)
        assert saved.ok and len(saved.saved) == len(self.report.captures)
        self.block_calls = sum(len(v) for v in self.calls.values())
        assert self.block_calls == len(targets) * len(self.inputs)
        self.data = root / f"{name}-calls.pt"
        torch.save({"calls": self.calls,
                    "weights": {m: dict(self.model.get_submodule(m).state_dict())
                                for m in targets}}, self.data)

    def _pre(self, member: str) -> Any:
        def hook(_m: nn.Module, args: Any, kwargs: Any) -> None:
            self.calls.setdefault(member, []).append(
                (_clone(args), _clone(kwargs), None))
        return hook

    def _post(self, member: str) -> Any:
        def hook(_m: nn.Module, _args: Any, _kwargs: Any, out: Any) -> None:
            args, kwargs, _ = self.calls[member][-1]
            self.calls[member][-1] = (args, kwargs, _clone(out))
        return hook


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_clone(v) for v in value)
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    return value


@pytest.fixture(scope="module", params=sorted(MODELS))
def setup(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[Setup]:
    with pytest.MonkeyPatch.context() as mp:  # module scope: manifests audited here too
        from metadata_check import assert_metadata_only

        import ctxreplay.report.manifest as manifest
        original = manifest.write_manifest
        mp.setattr(manifest, "write_manifest",
                   lambda p, d: (assert_metadata_only(d), original(p, d))[1])
        yield Setup(request.param, tmp_path_factory.mktemp(request.param))


_FRESH = textwrap.dedent("""
    import json, sys, warnings
    warnings.filterwarnings("ignore")
    import torch, ctxreplay
    from ctxreplay.specs.signature import call_spec, tensor_values
    directory, data = sys.argv[1], sys.argv[2]
    assert not torch.is_autocast_enabled("cpu") and not torch.is_inference_mode_enabled()
    src = ctxreplay.load(directory)
    result = {"outside": [d.text for d in src.check()]}
    with torch.inference_mode():
        result["inside"] = [d.text for d in src.check()]
    recorded = torch.load(data)
    result["equal"], result["differ"], result["unmatched"] = 0, [], 0
    for member, calls in recorded["calls"].items():
        for args, kwargs, live in calls:
            spec = call_spec(args, kwargs)
            # a folded capture takes the sizes in its ranges
            caps = [c for c in src.captures if member in c.members and (
                c.signature() == spec or c.folding is not None
                and c.folding.accepts(c.signature(), spec))]
            if len(caps) != 1:
                result["unmatched"] += 1
                continue
            run = caps[0].guarded(weights=recorded["weights"][member])
            with torch.inference_mode():
                got = run(*args, **kwargs)
            same = [torch.equal(a, b) and a.dtype == b.dtype
                    for a, b in zip(tensor_values(live), tensor_values(got))]
            if same and all(same) and len(same) == len(list(tensor_values(live))):
                result["equal"] += 1
            else:
                result["differ"].append(member)
    print(json.dumps(result))
""")


def test_a_fresh_process_loads_checks_and_reproduces_every_block_call(setup: Setup) -> None:
    proc = subprocess.run([sys.executable, "-c", _FRESH, str(setup.directory),
                           str(setup.data)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["inside"] == []  # nothing differs where inference mode is re-entered
    # without it, the one thing the artifacts cannot carry is named
    assert len(result["outside"]) == 1
    assert result["outside"][0].startswith("grad_mode: needs inference_mode, now grad")
    assert result["unmatched"] == 0 and result["differ"] == []
    assert result["equal"] == setup.block_calls


def _loaded(path: Path) -> ctxreplay.LoadedManifest:
    loaded = ctxreplay.load(path)
    assert isinstance(loaded, ctxreplay.LoadedManifest)
    return loaded


def _first_call(setup: Setup) -> tuple[str, Any, Any, Any]:
    member = sorted(setup.calls)[0]
    args, kwargs, live = setup.calls[member][0]
    return member, args, kwargs, live


def _capture_for(loaded: ctxreplay.LoadedManifest, member: str, args: Any,
                 kwargs: Any) -> ctxreplay.LoadedCapture:
    from ctxreplay.specs.signature import call_spec

    spec = call_spec(args, kwargs)
    (cap,) = [c for c in loaded if member in c.members and c.signature() == spec]
    return cap


def test_another_default_dtype_or_torch_is_reported_and_refused(setup: Setup,
                                                                tmp_path: Path) -> None:
    loaded = _loaded(setup.directory)
    member, args, kwargs, _ = _first_call(setup)
    cap = _capture_for(loaded, member, args, kwargs)
    run = cap.guarded(weights=setup.model.get_submodule(member))
    with torch.inference_mode(), default_dtype(torch.float64):
        found = loaded.check()
        assert [d.text.split(" [")[0] for d in found] == [
            "default_dtype: needs float32, now float64"]
        assert set(found[0].captures) == {c.label for c in loaded}
        with pytest.raises(ctxreplay.GuardError, match="default_dtype: needs float32"):
            run(*args, **kwargs)
    copy = tmp_path / "copy"
    shutil.copytree(setup.directory, copy)
    doc = json.loads((copy / "manifest.json").read_text())
    doc["environment"]["torch"] = "2.99.0+future"
    (copy / "manifest.json").write_text(json.dumps(doc))
    edited = _loaded(copy)
    with torch.inference_mode():
        assert [d.text.split(" [")[0] for d in edited.check()] == [
            f"torch: made with 2.99.0+future, now {torch.__version__}"]
        with pytest.raises(ctxreplay.GuardError, match=r"torch: made with 2\.99\.0"):
            _capture_for(edited, member, args, kwargs).guarded()(*args, **kwargs)


def test_autocast_carried_only_ambiently_is_reported_and_refused(setup: Setup,
                                                                 tmp_path: Path) -> None:
    # the same model captured with every probe replayed around the trace: the
    # artifacts then need autocast re-established wherever they run (they are
    # verified by signature: from a neutral state they could not reproduce)
    autocast, inference = _live()
    with ctxreplay.capture_with(setup.model, targets="repeated", replay="ambient",
                                verify="signature") as s, autocast, inference:
        setup.model(**setup.inputs[0])
    report = s.finalize()
    assert report.ok and all("autocast" in c.ambient_only for c in report.captures)
    report.save_all(tmp_path / "ambient", verify=False)
    loaded = _loaded(tmp_path / "ambient")
    member, args, kwargs, live = _first_call(setup)
    cap = _capture_for(loaded, member, args, kwargs)
    with torch.inference_mode():
        assert [d.text.split(" [")[0] for d in loaded.check()] == [
            "autocast: needs cpu:bfloat16, now off"]
        with pytest.raises(ctxreplay.GuardError, match="autocast: needs cpu:bfloat16"):
            cap.guarded()(*args, **kwargs)
        # unguarded, it computes something else (Llama: other values, silently)
        # or fails deep inside torch (Wan: a bfloat16 input meets float32 weights)
        try:
            plain = cap.module()(*args, **kwargs)
        except RuntimeError as exc:
            assert "dtype" in str(exc) and setup.name == "wan"
        else:
            assert not all(torch.equal(a, b) for a, b in zip(tensor_values(live),
                                                            tensor_values(plain)))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert loaded.check() == ()
            again = cap.guarded()(*args, **kwargs)
    assert all(torch.equal(a, b) for a, b in zip(tensor_values(live), tensor_values(again)))


@pytest.mark.parametrize("source", ["report", "loaded"])
def test_install_dispatches_bit_identically_and_restores(setup: Setup, source: str) -> None:
    model = setup.model
    members = sorted(setup.calls)
    before = {m: dict(model.get_submodule(m).__dict__) for m in members}
    src: Any = setup.report if source == "report" else _loaded(setup.directory)
    autocast, inference = _live()
    with autocast, inference:
        new_eager = [_out(model(**kw)).clone() for kw in setup.new_inputs]
    handle = ctxreplay.install(model, src)
    try:
        with autocast, inference:
            got = [_out(model(**kw)) for kw in setup.inputs]
            new = [_out(model(**kw)) for kw in setup.new_inputs]
    finally:
        handle.remove()
    for a, b in zip(got, setup.outputs):
        assert torch.equal(a, b)
    for a, b in zip(new, new_eager):
        assert torch.equal(a, b)
    stats = handle.stats()
    assert stats.total_hits == setup.block_calls
    assert stats.total_misses == len(members) * len(setup.new_inputs)
    assert stats.reasons == {"signature": stats.total_misses}
    assert {m: dict(model.get_submodule(m).__dict__) for m in members} == before
    with autocast, inference:
        assert torch.equal(_out(model(**setup.inputs[0])), setup.outputs[0])


def test_install_with_torch_compile_is_within_bfloat16_tolerance(setup: Setup) -> None:
    model = setup.model
    autocast, inference = _live()
    with ctxreplay.install(model, setup.report, compile=torch.compile) as handle:
        with autocast, inference:
            got = [_out(model(**kw)) for kw in setup.inputs]
        stats = handle.stats()
    assert stats.total_hits == setup.block_calls and stats.total_misses == 0
    assert len(stats.compiled) == sum(len(c.members) for c in setup.report.captures)
    for a, b in zip(got, setup.outputs):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a.float(), b.float(), rtol=1.6e-2, atol=2e-2)
