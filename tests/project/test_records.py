"""No record holds more than 24 fields: a capture's record is a core and
parts, and each document's record holds the program's metadata record
instead of a copy of its fields."""

from __future__ import annotations

import attrs
import pytest

import ctxreplay
from ctxreplay.artifacts import ArtifactSidecar, ProgramMeta, SavedArtifact
from ctxreplay.cache.stored import Stored
from ctxreplay.dispatch.programs import Entry
from ctxreplay.report import CacheDetails, DistributedDetails, FoldDetails
from ctxreplay.report.manifest import ManifestDoc, ManifestEntry

MAX_FIELDS = 24

RECORDS = [ctxreplay.Capture, ProgramMeta, DistributedDetails, CacheDetails, FoldDetails,
           ArtifactSidecar, ManifestEntry, ManifestDoc, Stored, Entry, ctxreplay.LoadedCapture,
           ctxreplay.LoadedManifest, SavedArtifact, ctxreplay.CaptureReport,
           ctxreplay.CaptureFailure]


def too_many(cls: type) -> str | None:
    """Why ``cls`` holds too many fields, or ``None``."""
    n = len(attrs.fields(cls))
    return f"{cls.__qualname__} holds {n} fields (at most {MAX_FIELDS})" \
        if n > MAX_FIELDS else None


@pytest.mark.parametrize("cls", RECORDS, ids=lambda c: c.__qualname__)
def test_no_record_holds_more_than_24_fields(cls: type) -> None:
    assert too_many(cls) is None


def _package_records() -> list[type]:
    """Every attrs class defined in the package, each module imported."""
    import importlib
    import pkgutil

    out: list[type] = []
    for info in pkgutil.walk_packages(ctxreplay.__path__, "ctxreplay."):
        module = importlib.import_module(info.name)
        out += [v for v in vars(module).values() if isinstance(v, type) and attrs.has(v)
                and v.__module__ == module.__name__]
    return out


def test_no_record_anywhere_in_the_package_holds_more_than_24_fields() -> None:
    records = _package_records()
    assert ctxreplay.Capture in records and len(records) > 50  # the walk found them
    assert [why for cls in records if (why := too_many(cls))] == []


def test_the_count_catches_a_wide_record() -> None:
    wide = attrs.make_class("Wide", [f"f{i}" for i in range(MAX_FIELDS + 1)])
    assert too_many(wide) == f"Wide holds {MAX_FIELDS + 1} fields (at most {MAX_FIELDS})"


@pytest.mark.parametrize("cls", [ArtifactSidecar, ManifestEntry, Stored],
                         ids=lambda c: c.__qualname__)
def test_each_document_record_holds_the_program_record_not_a_copy(cls: type) -> None:
    fields = {f.name: f for f in attrs.fields(cls)}
    assert fields["meta"].type in (ProgramMeta, "ProgramMeta")
    copied = {f.name for f in attrs.fields(ProgramMeta)} & set(fields)
    assert copied == set(), f"{cls.__qualname__} copies {sorted(copied)}"
