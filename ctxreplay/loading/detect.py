"""What kind of ctxreplay file a path is: ``detect``."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .._base.jsonread import loads
from ..artifacts.sidecar import SIDECAR_SCHEMA, sidecar_path
from ..report.manifest import MANIFEST_NAME, MANIFEST_SCHEMA

__all__ = ["EXPECTED_FILES", "detect"]

#: what ``load`` and the command line accept, in words
EXPECTED_FILES = ("a manifest directory or its manifest.json (report.save_all), a .pt2 "
                  "with its .pt2.json sidecar (Capture.save), a sidecar, or a report JSON "
                  "(report.save)")


def detect(path: str | os.PathLike[str]) -> tuple[str, Path, Any]:
    """``(kind, file, document)``: ``kind`` is ``"manifest"``, ``"artifact"``
    (a ``.pt2``; ``file`` is it), ``"sidecar"`` or ``"report"``; ``document``
    the parsed JSON (``None`` for a ``.pt2``).  Anything else raises
    ``ValueError`` naming what was expected."""
    given = Path(os.fspath(path))
    if given.is_dir():
        manifest = given / MANIFEST_NAME
        if not manifest.is_file():
            raise ValueError(f"$: a directory without {MANIFEST_NAME}; expected "
                             f"{EXPECTED_FILES} (in {given})")
        given = manifest
    if not given.exists():
        raise FileNotFoundError(f"{given}: no such file or directory")
    with given.open("rb") as f:
        head = f.read(4)
    if head == b"PK\x03\x04":  # a zip archive: what torch.export.save writes
        side = sidecar_path(given)
        if not side.is_file():
            raise ValueError(f"$: a .pt2 archive without its sidecar {side.name} "
                             f"(Capture.save writes it beside the .pt2) (in {given})")
        return "artifact", given, None
    try:
        data = loads(given.read_bytes(), "$", source=str(given))
    except ValueError:
        raise ValueError(f"$: not a ctxreplay file (neither a .pt2 archive nor a JSON "
                         f"document); expected {EXPECTED_FILES} (in {given})") from None
    schema = data.get("schema") if isinstance(data, Mapping) else None
    # by family: a reader of the kind then names an unsupported version
    families = {MANIFEST_SCHEMA: "manifest", SIDECAR_SCHEMA: "sidecar",
                "ctxreplay.report/": "report"}
    for prefix, kind in families.items():
        if isinstance(schema, str) and schema.startswith(prefix.partition("/")[0] + "/"):
            return kind, given, data
    shown = repr(schema[:60]) if isinstance(schema, str) else "none"
    raise ValueError(f"$.schema: a JSON document that is not a ctxreplay manifest, sidecar "
                     f"or report (schema {shown}); expected {EXPECTED_FILES} (in {given})")
