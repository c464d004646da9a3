"""Capture.save: a .pt2 that behaves like the live call in a fresh process,
and a metadata-only sidecar that ``load_sidecar`` reads back strictly."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from capability import BF16_LSTM_NEEDS, bf16_lstm_refusal, torch_limit
from metadata_check import assert_metadata_only
from torch import nn
from torchstate import default_dtype

import ctxreplay
from ctxreplay.demo import TinyDiT

# torch's own export internals warn about a deprecated pytree spelling
pytestmark = [pytest.mark.filterwarnings("ignore:.*LeafSpec:FutureWarning"),
              # nn.LSTM's flat weights, as export notes about every LSTM
              pytest.mark.filterwarnings("ignore:The tensor attributes:UserWarning")]


def _demo_report(depth: int = 2) -> ctxreplay.CaptureReport:
    torch.manual_seed(0)
    model = TinyDiT(dim=32, depth=depth, heads=4).eval()
    with ctxreplay.capture_with(model, targets="repeated", verify="execute") as session, \
            torch.autocast("cpu", dtype=torch.bfloat16), torch.inference_mode():
        for batch, tokens in ((1, 8), (2, 4)):
            model(torch.rand(batch, tokens, 32), torch.full((batch,), 500.0))
    report = session.finalize()
    assert report.ok and len(report.captures) == 2
    return report


@pytest.fixture(scope="module")
def demo_report() -> ctxreplay.CaptureReport:
    return _demo_report()


_FRESH = textwrap.dedent("""
    import json, sys, warnings
    warnings.filterwarnings("ignore")
    import torch, ctxreplay
    out = []
    for path in sys.argv[1:]:
        assert not torch.is_autocast_enabled("cpu")
        program = torch.export.load(path)
        side = ctxreplay.load_sidecar(path)
        args, kwargs = side.example_inputs()
        plain = program.module()(*args, **kwargs)
        with side.snapshot.replay():
            replayed = program.module()(*args, **kwargs)
            inside = torch.is_autocast_enabled("cpu"), torch.is_inference_mode_enabled()
        out.append({"plain": str(plain.dtype), "replayed": str(replayed.dtype),
                    "inside": list(inside), "check": len(side.check(plain)),
                    "context": side.snapshot.describe(),
                    "leaves": [str(s.dtype) for _, s in side.inputs],
                    "live": [str(s.dtype) for s in side.outputs]})
    print(json.dumps(out))
""")


def test_saved_demo_captures_run_bfloat16_in_a_fresh_process(
        demo_report: ctxreplay.CaptureReport, tmp_path: Path) -> None:
    paths = []
    for c in demo_report.captures:
        saved = c.save(tmp_path / f"{c.scope}-{c.variant}.pt2")
        assert saved.path.is_file() and saved.sidecar == Path(f"{saved.path}.json")
        assert saved.sidecar.is_file()
        # torch 2.13 serialises the wrap_with_autocast wrapper: the file holds
        # the program finalize() traced and checked, so that check stands for
        # the file (its graph is compared, nothing runs again); the fresh
        # process below runs every file
        assert not saved.lowered and c.fidelity.ok
        assert saved.fidelity.ok and saved.fidelity.checked == ("graph",)
        paths.append(str(saved.path))
    proc = subprocess.run([sys.executable, "-c", _FRESH, *paths], capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == 2
    for r in results:
        assert r["plain"] == "torch.bfloat16"  # the live dtype, with no autocast at all
        assert r["replayed"] == "torch.bfloat16"
        assert r["inside"] == [True, True]  # the snapshot replayed autocast + inference mode
        assert r["check"] == 0
        assert r["context"]["autocast"] == "cpu:bfloat16"
        assert r["context"]["grad_mode"] == "inference_mode"
        assert r["live"] == ["torch.bfloat16"]


def test_sidecar_is_metadata_only_and_round_trips(demo_report: ctxreplay.CaptureReport,
                                                  tmp_path: Path) -> None:
    c = demo_report.captures[0]
    saved = c.save(tmp_path / "block.pt2", verify=False)
    doc = json.loads(saved.sidecar.read_text())
    assert_metadata_only(doc)
    assert doc["snapshot"] == c.snapshot.to_json()
    side = ctxreplay.load_sidecar(saved.sidecar)  # the .json path works too
    assert side.snapshot == c.snapshot
    assert side.artifact == saved.path
    assert (side.scope, side.variant, side.backend, side.binding) == (
        c.scope, c.variant, "export", "native")
    assert side.fingerprint == c.fingerprint
    assert side.inputs == tuple(c.signature.leaves())
    assert side.embedded == c.embedded and side.ambient_only == c.ambient_only
    assert saved.fidelity.checked == ()  # verify=False skips the reload check
    program = side.load_program()
    args, kwargs = side.example_inputs()
    assert side.check(program.module()(*args, **kwargs)) == ()


def _sidecar_doc(demo_report: ctxreplay.CaptureReport, tmp_path: Path) -> tuple[Path, Any]:
    saved = demo_report.captures[0].save(tmp_path / "b.pt2", verify=False)
    return saved.sidecar, json.loads(saved.sidecar.read_text())


@pytest.mark.parametrize(("mutate", "where"), [
    (lambda d: d.update(bogus=1), "$.bogus"),
    (lambda d: d.update(schema="ctxreplay.artifact/99"), "$.schema"),
    (lambda d: d.pop("snapshot"), "$.snapshot"),
    (lambda d: d["snapshot"].update(schema="nope"), "$.snapshot.schema"),
    (lambda d: d["snapshot"]["probes"]["autocast"]["state"].update(cache_enabled="yes"),
     "$.snapshot.probes.autocast.state.cache_enabled"),
    (lambda d: d["inputs"]["leaves"][0][1]["tensor"].update(dtype="float99"),
     "$.inputs.leaves[0][1].tensor.dtype"),
    (lambda d: d["inputs"]["args"][0]["tensor"].update(shape=[-1]),
     "$.inputs.args[0].tensor.shape[0]"),
    (lambda d: d.update(artifact="../elsewhere.pt2"), "$.artifact"),
    (lambda d: d.update(binding="pickled"), "$.binding"),
    (lambda d: d.update(output_leaves=[{"tensor": "x"}]), "$.output_leaves[0].tensor"),
])
def test_load_sidecar_validates_strictly(demo_report: ctxreplay.CaptureReport,
                                         tmp_path: Path, mutate: Any, where: str) -> None:
    path, doc = _sidecar_doc(demo_report, tmp_path)
    mutate(doc)
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=r"^" + __import__("re").escape(where)):
        ctxreplay.load_sidecar(path)


def test_load_sidecar_rejects_non_json(tmp_path: Path) -> None:
    (tmp_path / "x.pt2.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a JSON document"):
        ctxreplay.load_sidecar(tmp_path / "x.pt2")


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.lin(x)
        return out


@pytest.mark.parametrize("backend", ["symbolic", "dynamo"])
def test_save_refuses_other_backends_by_name(backend: str, tmp_path: Path) -> None:
    model = Tiny()
    with ctxreplay.capture_with(model, backend=backend) as session:
        model(torch.rand(2, 4))
    (c,) = session.finalize().captures
    with pytest.raises(ctxreplay.ArtifactError, match=f"'{backend}' backend") as info:
        c.save(tmp_path / "x.pt2")
    assert info.value.reason == "backend_not_savable"
    assert not (tmp_path / "x.pt2").exists()


class Factory(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ones(4) + torch.arange(4) * 0.5 + x


def test_saved_artifact_keeps_pinned_default_dtype(tmp_path: Path) -> None:
    model = Factory()
    with ctxreplay.capture_with(model, backend="export", verify="execute") as session, \
            default_dtype(torch.float64), torch.autocast("cpu", dtype=torch.bfloat16):
        assert model(torch.rand(4, dtype=torch.float32)).dtype == torch.float64
    (c,) = session.finalize().captures
    assert c.fidelity.ok, c.fidelity
    saved = c.save(tmp_path / "f.pt2")
    assert saved.fidelity.ok, saved.fidelity
    out = torch.export.load(saved.path).module()(torch.rand(4))
    assert out.dtype == torch.float64


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    scale: float


class TakesBatch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, batch: Batch) -> torch.Tensor:
        out: torch.Tensor = self.lin(batch.x) * batch.scale
        return out


def test_flattened_capture_saves_and_its_sidecar_gives_leaf_inputs(tmp_path: Path) -> None:
    model = TakesBatch()
    with ctxreplay.capture_with(model, backend="export", verify="execute") as session, \
            torch.autocast("cpu", dtype=torch.bfloat16):
        model(Batch(torch.rand(2, 4), 2.0))
    (c,) = session.finalize().captures
    assert c.binding == "flattened" and c.fidelity.ok
    saved = c.save(tmp_path / "flat.pt2")
    assert saved.fidelity.ok, saved.fidelity
    side = ctxreplay.load_sidecar(saved.path)
    args, kwargs = side.example_inputs()
    assert kwargs == {} and [a.shape for a in args] == [torch.Size([2, 4])]
    out = side.load_program().module()(*args)
    assert out.dtype == torch.bfloat16 and side.check(out) == ()


def test_sidecar_refuses_to_rebuild_what_json_cannot_carry(tmp_path: Path) -> None:
    model = Tiny()
    with ctxreplay.capture_with(model, backend="export") as session:
        model(torch.rand(2, 4))
    (c,) = session.finalize().captures
    saved = c.save(tmp_path / "t.pt2", verify=False)
    doc = json.loads(saved.sidecar.read_text())
    doc["inputs"]["args"][0] = {"seq": "Point", "items": [doc["inputs"]["args"][0]]}
    saved.sidecar.write_text(json.dumps(doc))
    side = ctxreplay.load_sidecar(saved.path)
    with pytest.raises(ctxreplay.ArtifactError, match=r"\$\.inputs\.args\[0\]") as info:
        side.example_inputs()
    assert info.value.reason == "not_rebuildable"


class NllLoss(nn.Module):
    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.nll_loss(x.log_softmax(-1), target)


class Lstm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(3, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.lstm(x)[0]
        return out


@pytest.mark.parametrize(("make", "inputs", "live_dtype"), [
    # autocast's float32 kernel sits on nll_loss, inside nll_loss_nd's decomposition
    (NllLoss, lambda: (torch.rand(4, 5, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.long)),
     torch.float32),
    # and mkldnn_rnn_layer's bfloat16 one inside lstm's
    (Lstm, lambda: (torch.rand(5, 2, 3),), torch.bfloat16),
], ids=["nll_loss", "lstm"])
def test_save_keeps_the_wrappers_where_lowering_loses_a_cast(
        make: Any, inputs: Any, live_dtype: torch.dtype, tmp_path: Path,
        request: pytest.FixtureRequest) -> None:
    if make is Lstm and (error := bf16_lstm_refusal()) is not None:
        request.applymarker(torch_limit(error, BF16_LSTM_NEEDS))
    model = make()
    with ctxreplay.capture_with(model, backend="export", verify="execute") as session, \
            torch.autocast("cpu", dtype=torch.bfloat16):
        assert model(*inputs()).dtype == live_dtype
    (c,) = session.finalize().captures
    saved = c.save(tmp_path / "m.pt2")
    assert saved.fidelity.ok, saved.fidelity
    assert not saved.lowered  # the wrappers stay: the lowered program loses the cast
    assert torch.export.load(saved.path).module()(*inputs()).dtype == live_dtype
    assert not ctxreplay.load_sidecar(saved.path).lowered
