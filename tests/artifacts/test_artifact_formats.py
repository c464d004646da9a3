"""The artifact-format seam: a format registered from outside the package saves
captures through the normal path (``Capture.save``, ``report.save_all``), and
``ctxreplay.load`` detects and reads them back; unknown names are clear errors;
the built-in ``.pt2`` is one format among them."""

# no ``from __future__ import annotations``: torch.fx records a string annotation
# of the traced forward as a global a pickled GraphModule cannot import
import json
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import ctxreplay
from ctxreplay.artifacts import (
    ArtifactFormat,
    UnknownFormatError,
    available_formats,
    get_format,
    register_format,
    unregister_format,
)
from ctxreplay.artifacts.formats import artifact_bytes, artifact_from_bytes

# torch's own export internals warn about a deprecated pytree spelling
pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec:FutureWarning")


class ToyFormat(ArtifactFormat):
    """A ``torch.fx.GraphModule`` pickled behind a magic line: what the
    symbolic backend captures, which no ``.pt2`` holds."""

    name = "toy_pickle"
    suffix = ".toy"
    magic = b"ctxreplay-toy/1\n"

    def can_save(self, artifact: Any) -> str | None:
        if isinstance(artifact, torch.fx.GraphModule):
            return None
        return "a .toy holds a torch.fx.GraphModule"

    def save(self, artifact: Any, path: Path) -> None:
        path.write_bytes(self.magic + pickle.dumps(artifact))

    def load(self, path: Path) -> Any:
        data = path.read_bytes()
        assert data.startswith(self.magic)
        return pickle.loads(data[len(self.magic):])

    def detect(self, path: Path) -> bool:
        with path.open("rb") as f:
            return f.read(len(self.magic)) == self.magic


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.relu(self.lin(x))
        return out


@pytest.fixture
def toy() -> Iterator[ToyFormat]:
    """The toy format, registered for the test; the registry left as found."""
    before = dict(available_formats())
    fmt = ToyFormat()
    register_format(fmt)
    try:
        yield fmt
    finally:
        unregister_format(fmt.name)
        assert dict(available_formats()) == before


def _report(backend: str) -> tuple[Tiny, ctxreplay.CaptureReport]:
    torch.manual_seed(0)
    model = Tiny()
    with ctxreplay.capture_with(model, backend=backend) as session:
        model(torch.rand(2, 4))
    report = session.finalize()
    assert report.ok and len(report.captures) == 1
    return model, report


def _runs_like(model: nn.Module, program: Any, binding: str) -> bool:
    assert binding == "native"
    x = torch.rand(2, 4)
    return torch.equal(program(x), model(x))


def test_a_registered_format_saves_and_loads_a_capture(toy: ToyFormat, tmp_path: Path) -> None:
    model, report = _report("symbolic")
    (c,) = report.captures
    saved = c.save(tmp_path / "tiny.toy")
    assert saved.fidelity.ok and saved.fidelity.checked == ("saved",)
    assert toy.detect(saved.path) and saved.path.read_bytes().startswith(toy.magic)
    side = ctxreplay.load_sidecar(saved.path)
    assert side.format == toy.name and json.loads(saved.sidecar.read_text())["format"] == toy.name
    loaded = ctxreplay.load(saved.path)
    assert isinstance(loaded, ctxreplay.LoadedCapture) and loaded.path == saved.path
    assert isinstance(loaded.program, torch.fx.GraphModule)
    assert _runs_like(model, loaded.program, loaded.binding)


def test_save_all_names_each_file_by_its_format(toy: ToyFormat, tmp_path: Path) -> None:
    model, report = _report("symbolic")
    saved = report.save_all(tmp_path / "captures")
    assert saved.ok and len(saved.saved) == 1 and saved.not_saved == ()
    (written,) = saved.saved
    assert written.path.name.endswith(toy.suffix)
    loaded = ctxreplay.load(tmp_path / "captures")
    assert isinstance(loaded, ctxreplay.LoadedManifest)
    (cap,) = loaded.captures
    assert cap.path == written.path and _runs_like(model, cap.program, cap.binding)


def test_without_the_format_the_same_capture_is_not_saved(tmp_path: Path) -> None:
    # the failing case of the two tests above: nothing else holds a GraphModule
    assert ToyFormat.name not in available_formats()
    _, report = _report("symbolic")
    saved = report.save_all(tmp_path)
    assert saved.saved == () and [r for *_, r in saved.not_saved] == ["backend_not_savable"]
    with pytest.raises(ctxreplay.ArtifactError, match="cannot be written") as info:
        report.captures[0].save(tmp_path / "tiny.toy")
    assert info.value.reason == "backend_not_savable"
    assert not (tmp_path / "tiny.toy").exists()


def test_a_file_of_an_unregistered_format_is_not_detected(tmp_path: Path) -> None:
    fmt = ToyFormat()
    register_format(fmt)
    try:
        saved = _report("symbolic")[1].captures[0].save(tmp_path / "tiny.toy")
        assert isinstance(ctxreplay.load(saved.path), ctxreplay.LoadedCapture)
    finally:
        unregister_format(fmt.name)
    with pytest.raises(ValueError, match="not a ctxreplay file"):
        ctxreplay.load(saved.path)


def test_the_path_suffix_chooses_the_format(toy: ToyFormat, tmp_path: Path) -> None:
    _, report = _report("symbolic")
    with pytest.raises(ctxreplay.ArtifactError, match=r"cannot be written as a \.pt2") as info:
        report.captures[0].save(tmp_path / "tiny.pt2")
    assert info.value.reason == "backend_not_savable"
    # no suffix of a format: the first format that holds the artifact
    saved = report.captures[0].save(tmp_path / "tiny.bin")
    assert ctxreplay.load_sidecar(saved.path).format == toy.name


def test_an_unknown_format_name_lists_the_known_ones() -> None:
    with pytest.raises(UnknownFormatError) as info:
        get_format("no_such_format")
    assert isinstance(info.value, ctxreplay.Error) and isinstance(info.value, KeyError)
    message = str(info.value)
    assert "'no_such_format'" in message
    assert all(name in message for name in available_formats())
    with pytest.raises(UnknownFormatError, match=r"known artifact formats: .*pt2"):
        unregister_format("no_such_format")


def test_a_sidecar_naming_an_unregistered_format_says_so(toy: ToyFormat,
                                                         tmp_path: Path) -> None:
    saved = _report("symbolic")[1].captures[0].save(tmp_path / "tiny.toy")
    doc = json.loads(saved.sidecar.read_text())
    saved.sidecar.write_text(json.dumps({**doc, "format": "gone"}))
    loaded = ctxreplay.load(saved.path)
    assert isinstance(loaded, ctxreplay.LoadedCapture)
    with pytest.raises(UnknownFormatError, match=f"'gone'.*{toy.name}"):
        loaded.program  # noqa: B018 -- loaded on first use


def test_a_pt2_records_its_format_and_an_older_sidecar_means_pt2(tmp_path: Path) -> None:
    model, report = _report("export")
    saved = report.captures[0].save(tmp_path / "tiny.pt2")
    doc = json.loads(saved.sidecar.read_text())
    assert doc["format"] == "pt2"
    del doc["format"]  # as written before formats were recorded
    saved.sidecar.write_text(json.dumps(doc))
    loaded = ctxreplay.load(saved.path)
    assert isinstance(loaded, ctxreplay.LoadedCapture) and loaded.sidecar.format == "pt2"
    assert isinstance(loaded.program, torch.export.ExportedProgram)
    assert _runs_like(model, loaded.program.module(), loaded.binding)


def test_registration_refuses_a_taken_name_or_suffix(toy: ToyFormat) -> None:
    class SameSuffix(ToyFormat):
        name = "other_toy"

    class SameName(ToyFormat):
        suffix = ".toy2"

    for cls in (SameSuffix, SameName):
        with pytest.raises(ValueError, match="replace=True"):
            register_format(cls)
    assert get_format(toy.name) is toy and "other_toy" not in available_formats()
    with pytest.raises(ValueError, match="identifier"):
        register_format(type("Bad", (ToyFormat,), {"name": "not a name"}))
    with pytest.raises(TypeError, match="ArtifactFormat"):
        register_format(object())  # type: ignore[type-var]


def test_bytes_name_their_format(toy: ToyFormat) -> None:
    model, report = _report("symbolic")
    payload = artifact_bytes(report.captures[0].artifact)
    assert payload.startswith(toy.name.encode() + b"\0")
    assert _runs_like(model, artifact_from_bytes(payload), "native")
    with pytest.raises(UnknownFormatError):
        artifact_from_bytes(b"gone\0" + payload.partition(b"\0")[2])


_FORMAT_PLUGIN = """
from pathlib import Path
from ctxreplay.artifacts import ArtifactFormat

class Plugged(ArtifactFormat):
    name = "plugged_fmt"
    suffix = ".plugged"

    def can_save(self, artifact):
        return "holds nothing"

    def save(self, artifact, path):
        raise AssertionError

    def load(self, path):
        raise AssertionError

    def detect(self, path):
        return False
"""


def test_a_format_from_an_entry_point_is_registered_and_a_broken_one_listed_never_fatal(
        fake_dist: Any) -> None:
    """Formats live in the plugin registry probes and backends use: an installed
    package adds one through the ``ctxreplay.formats`` entry point, and one whose
    module is gone warns once, is named by the lookup, and breaks nothing."""
    from ctxreplay.artifacts.formats import ENTRY_POINT_GROUP, FormatRegistrationWarning

    fake_dist("fake_formats", {"plugged_fmt": "fake_format_{t}:Plugged",
                               "gone_fmt": "fake_missing_{t}:Gone"},
              {"fake_format_{t}": _FORMAT_PLUGIN}, group=ENTRY_POINT_GROUP)
    with pytest.warns(FormatRegistrationWarning, match="'gone_fmt' .* could not be registered"):
        names = list(available_formats())
    assert names[0] == "pt2" and "plugged_fmt" in names and "gone_fmt" not in names
    assert get_format("plugged_fmt").suffix == ".plugged"
    with pytest.raises(UnknownFormatError, match="is installed but could not be registered"):
        get_format("gone_fmt")
    assert get_format("pt2").name == "pt2"  # the built-in is untouched
