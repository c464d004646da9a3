"""Recording a saved directory's digests again after a test edits its files
on purpose (a sidecar that names another device, a probe this process lacks):
what ``save_all`` would have recorded had it written them so.  Written with
``hashlib`` here, not with the library's digest code under test."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path


def sha256(path: Path) -> str:
    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


def redigest(directory: Path) -> None:
    """Each entry's ``digests`` in ``directory/manifest.json`` set to what its
    files hold now (the sidecars' own ``artifact_digest`` too), where the
    documents record them: a document of a ctxreplay that records none is
    left in its own form."""
    manifest = directory / "manifest.json"
    doc = json.loads(manifest.read_text())
    for entry in doc["captures"]:
        if entry.get("artifact") is None:
            continue
        side = directory / entry["sidecar"]
        side_doc = json.loads(side.read_text())
        if "artifact_digest" in side_doc:
            side_doc["artifact_digest"] = sha256(directory / entry["artifact"])
            side.write_text(json.dumps(side_doc, indent=2, sort_keys=True))
        if "digests" in entry:
            entry["digests"] = {entry["artifact"]: sha256(directory / entry["artifact"]),
                                entry["sidecar"]: sha256(side)}
    manifest.write_text(json.dumps(doc, indent=2, sort_keys=True))
