"""Reading a written ``.pt2`` back to check it (``Pt2Format.reload``) and the
collector pause around writing it (``saving.collector_paused``).

The check reads the archive through torch's own archive reader and graph
deserialiser, decoding the program's JSON with a decoder made once per
schema type: these tests hold that decoder to torch's own
(``serialize._dict_to_dataclass``) on programs of every shape a capture
makes, and the program read back to what ``torch.export.load`` gives.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from tampering import rewrite_zip
from torch import nn
from torch._export.serde.schema import ExportedProgram as Schema
from torch._export.serde.serialize import _dict_to_dataclass
from torch._export.serde.union import _Union

import ctxreplay
from ctxreplay.artifacts.formats import ArtifactFormat, register_format, unregister_format
from ctxreplay.artifacts.pt2 import Pt2Format
from ctxreplay.artifacts.pt2read import decode
from ctxreplay.artifacts.saving import collector_paused
from ctxreplay.backends import passes

pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec:FutureWarning")



class _Block(nn.Module):
    """Weights, a buffer, a lifted tensor constant and a size-dependent view."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("scale", torch.full((8,), 0.5))
        self.shift = torch.tensor(0.25)  # a plain tensor attribute: a lifted constant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.lin(x)) * self.scale + self.shift
        return h.reshape(x.shape[0], -1).softmax(-1)


def _plain() -> torch.export.ExportedProgram:
    return torch.export.export(_Block().eval(), (torch.rand(3, 8),))


def _dynamic() -> torch.export.ExportedProgram:
    return torch.export.export(_Block().eval(), (torch.rand(3, 8),),
                               dynamic_shapes=({0: torch.export.Dim.AUTO},))


def _embedded_autocast() -> torch.export.ExportedProgram:
    """What ctxreplay captures of a block live under CPU autocast with the
    context embedded: ``wrap_with_autocast`` higher-order ops in the graph."""
    torch.manual_seed(0)
    model = nn.Sequential(_Block(), _Block()).eval()
    with ctxreplay.capture_with(model, targets="repeated", backend="export",
                                replay="embedded") as session, \
            torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        model(torch.rand(3, 8))
    report = session.finalize()
    assert report.ok, report.problems
    (_, as_captured), _ = Pt2Format().forms(report.captures[0].artifact)
    program = as_captured()  # the form Capture.save writes first
    assert any("autocast" in str(n.target) for n in passes.graph_nodes(program.graph_module))
    return program


PROGRAMS: dict[str, Callable[[], torch.export.ExportedProgram]] = {
    "plain": _plain, "dynamic": _dynamic, "embedded_autocast": _embedded_autocast}


def _model_json(path: Path) -> Any:
    with zipfile.ZipFile(path) as z:
        (name,) = [n for n in z.namelist() if n.endswith("models/model.json")
                   or n.endswith("serialized_exported_program.json")]
        return json.loads(z.read(name))


@pytest.mark.parametrize("make", PROGRAMS.values(), ids=PROGRAMS.keys())
def test_the_decoder_builds_what_torchs_own_builds(make: Callable[[], Any],
                                                   tmp_path: Path) -> None:
    path = tmp_path / "p.pt2"
    torch.export.save(make(), path)
    data = _model_json(path)
    ours, torchs = _fields(decode(Schema, data)), _fields(_dict_to_dataclass(Schema, data))
    assert ours == torchs and ours[0] == "ExportedProgram"


def _fields(obj: Any) -> Any:
    """A schema object as plain data, compared field by field: torch 2.7's
    union types raise on ``==`` (their ``__getattribute__`` refuses the
    fields that are not set), so they are read as ``(type, value)``."""
    if isinstance(obj, _Union):
        return (type(obj).__name__, obj.type, _fields(obj.value))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return (type(obj).__name__, {f.name: _fields(object.__getattribute__(obj, f.name))
                                     for f in dataclasses.fields(obj)})
    if isinstance(obj, (list, tuple)):
        return [_fields(o) for o in obj]
    if isinstance(obj, dict):
        return {k: _fields(v) for k, v in obj.items()}
    return obj


@pytest.mark.parametrize("make", PROGRAMS.values(), ids=PROGRAMS.keys())
def test_a_reloaded_file_is_what_torch_export_load_reads(make: Callable[[], Any],
                                                         tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    program = make()
    path = tmp_path / "p.pt2"
    torch.export.save(program, path)
    by_torch = torch.export.load(path)
    calls: list[Path] = []
    real = torch.export.load
    monkeypatch.setattr(torch.export, "load", lambda p, *a, **k: calls.append(p) or
                        real(p, *a, **k))
    back = Pt2Format().reload(path)
    # both of torch's layouts are read by ctxreplay's own reader, which runs
    # nothing the file holds: torch.export.load unpickles parts of it
    assert calls == []
    assert Pt2Format().same_program(by_torch, back) and Pt2Format().same_program(program, back)
    x = torch.rand(5 if make is _dynamic else 3, 8)
    with torch.no_grad():
        assert torch.equal(back.module()(x), by_torch.module()(x))


def test_an_edited_graph_in_the_file_is_read_as_written(tmp_path: Path) -> None:
    program = _plain()
    path = tmp_path / "p.pt2"
    torch.export.save(program, path)
    assert Pt2Format().same_program(program, Pt2Format().reload(path))  # the control
    rewrite_zip(path, lambda name, data: data.replace(b"aten.relu.default", b"aten.sigmoid.default")
             if name.endswith(".json") else data)
    back = Pt2Format().reload(path)
    assert any(n.target is torch.ops.aten.sigmoid.default
               for n in back.graph_module.graph.nodes)
    assert not Pt2Format().same_program(program, back)


def test_a_truncated_file_is_refused_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "p.pt2"
    torch.export.save(_plain(), path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"p\.pt2: not a readable \.pt2 archive"):
        Pt2Format().reload(path)


def test_a_truncated_file_fails_the_saved_check(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(_Block(), _Block()).eval()
    with ctxreplay.capture_with(model, targets="repeated", backend="export") as session, \
            torch.no_grad():
        model(torch.rand(3, 8))
    (capture,) = session.finalize().captures
    assert capture.save(tmp_path / "good.pt2").fidelity.ok  # the control
    real = Pt2Format.save

    def truncated(self: Pt2Format, artifact: Any, path: Path) -> None:
        real(self, artifact, path)
        path.write_bytes(path.read_bytes()[:200])

    monkeypatch.setattr(Pt2Format, "save", truncated)
    saved = capture.save(tmp_path / "bad.pt2")
    assert not saved.fidelity.ok
    assert [(m.field, m.live) for m in saved.fidelity.mismatches] == [("execution", "loaded")]


class _Recording(ArtifactFormat):
    """A ``torch.fx.GraphModule`` as a pickle: records whether the collector
    was on while it was written and read back."""

    name = "gc_recording"
    suffix = ".gcrec"

    def __init__(self, fail: bool = False) -> None:
        self.seen: list[tuple[str, bool]] = []
        self.fail = fail

    def can_save(self, artifact: Any) -> str | None:
        return None if isinstance(artifact, torch.fx.GraphModule) else "a GraphModule only"

    def save(self, artifact: Any, path: Path) -> None:
        self.seen.append(("save", gc.isenabled()))
        if self.fail:
            raise RuntimeError("refused")
        torch.save(artifact, path)

    def load(self, path: Path) -> Any:
        self.seen.append(("load", gc.isenabled()))
        return torch.load(path, weights_only=False)

    def detect(self, path: Path) -> bool:
        return path.suffix == self.suffix


def _symbolic_capture() -> Any:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU()).eval()
    with ctxreplay.capture_with(model, backend="symbolic") as session:
        model(torch.rand(2, 4))
    (capture,) = session.finalize().captures
    return capture


@pytest.mark.parametrize("enabled", [True, False])
def test_the_collector_is_held_off_while_writing_and_left_as_it_was(
        tmp_path: Path, enabled: bool) -> None:
    capture = _symbolic_capture()
    fmt = register_format(_Recording())
    was = gc.isenabled()
    try:
        if not enabled:
            gc.disable()
        capture.save(tmp_path / "a.gcrec")
        after = gc.isenabled()
    finally:
        unregister_format(fmt.name)
        if was:
            gc.enable()
    assert fmt.seen == [("save", False), ("load", False)]
    assert after is enabled


def test_a_format_that_fails_leaves_the_collector_on(tmp_path: Path) -> None:
    capture = _symbolic_capture()
    fmt = register_format(_Recording(fail=True))
    try:
        assert gc.isenabled()
        with pytest.raises(ctxreplay.ArtifactError):
            capture.save(tmp_path / "a.gcrec")
        assert gc.isenabled()
    finally:
        unregister_format(fmt.name)
        gc.enable()
    assert fmt.seen == [("save", False)]


def test_the_pause_restores_the_collector_on_an_error() -> None:
    assert gc.isenabled()
    with pytest.raises(KeyError), collector_paused():
        assert not gc.isenabled()
        raise KeyError("x")
    assert gc.isenabled()
