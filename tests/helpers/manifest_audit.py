"""Every manifest a test writes goes through the suite's metadata checker:
``manifests_are_metadata_only`` (an autouse fixture for the modules that
import it), and the sentinel planted in models' inputs and attributes that no
manifest may hold."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from metadata_check import assert_metadata_only

import ctxreplay
import ctxreplay.report.manifest

#: planted in the model's inputs and attributes: never in a manifest
SENTINEL = "sentinel-prompt-7f3a"


@pytest.fixture(autouse=True)
def manifests_are_metadata_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    """Every manifest any test here writes goes through the suite's checker
    (sidecars are checked by conftest.py through ``save_capture``)."""
    written: list[Any] = []
    original = ctxreplay.report.manifest.write_manifest

    def checked(path: Path, doc: Any) -> None:
        assert_metadata_only(doc, sentinels=[SENTINEL])
        written.append(doc)
        original(path, doc)

    monkeypatch.setattr(ctxreplay.report.manifest, "write_manifest", checked)
    yield written
