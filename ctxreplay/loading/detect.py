"""What kind of ctxreplay file a path is: ``detect``."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .._base.jsonread import loads
from .._base.safefiles import inside
from ..artifacts.formats import available_formats, format_of_file
from ..artifacts.sidecar import SIDECAR_SCHEMA, sidecar_path
from ..report.manifest import MANIFEST_NAME, MANIFEST_SCHEMA

__all__ = ["detect", "expected_files"]


def expected_files() -> str:
    """What ``load`` and the command line accept, in words (each registered
    artifact format's files named by their suffix)."""
    artifacts = ", ".join(f"a {f.suffix} with its {sidecar_path(f.suffix).name} sidecar"
                          for f in available_formats().values())
    return (f"a manifest directory or its manifest.json (report.save_all), {artifacts} "
            "(Capture.save), a sidecar, or a report JSON (report.save)")


def detect(path: str | os.PathLike[str]) -> tuple[str, Path, Any]:
    """``(kind, file, document)``: ``kind`` is ``"manifest"``, ``"artifact"``
    (a file of a registered artifact format; ``file`` is it), ``"sidecar"`` or
    ``"report"``; ``document`` the parsed JSON (``None`` for an artifact).
    Anything else raises ``ValueError`` naming what was expected."""
    given = Path(os.fspath(path))
    if given.is_dir():
        manifest = given / MANIFEST_NAME
        if not manifest.is_file():
            raise ValueError(f"{given}: a directory without {MANIFEST_NAME}; expected "
                             f"{expected_files()}")
        given = manifest
    if given.name == MANIFEST_NAME:  # the index of a directory: it must be in it
        inside(given.parent, given.name)
    if not given.exists():
        raise FileNotFoundError(f"{given}: no such file or directory")
    fmt = format_of_file(given)
    if fmt is not None:
        side = sidecar_path(given)
        if not side.is_file():
            raise ValueError(f"{given}: a {fmt.description} without its sidecar {side.name} "
                             f"(Capture.save writes it beside the {fmt.suffix})")
        return "artifact", given, None
    try:
        data = loads(given.read_bytes(), "$", source=str(given))
    except ValueError:
        kinds = ", ".join(f"a {f.description}" for f in available_formats().values())
        raise ValueError(f"{given}: not a ctxreplay file (neither {kinds} nor a JSON "
                         f"document); expected {expected_files()}") from None
    schema = data.get("schema") if isinstance(data, Mapping) else None
    # by family: a reader of the kind then names an unsupported version
    families = {MANIFEST_SCHEMA: "manifest", SIDECAR_SCHEMA: "sidecar",
                "ctxreplay.report/": "report"}
    for prefix, kind in families.items():
        if isinstance(schema, str) and schema.startswith(prefix.partition("/")[0] + "/"):
            return kind, given, data
    shown = repr(schema[:60]) if isinstance(schema, str) else "none"
    raise ValueError(f"{given}: a JSON document that is not a ctxreplay manifest, sidecar "
                     f"or report (schema {shown}); expected {expected_files()}")
