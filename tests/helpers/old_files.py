"""Documents written by ctxreplay before a capture's record was split into a
core and parts (commit 6ae7929, torch 2.13.0+cpu), kept in ``old_files/`` so
the tests can show that what users saved then still loads, and that what is
written now has the same shape:

* ``saved/``: ``report.save_all`` of ``tiny_dit_report()`` -- its
  ``manifest.json`` and the capture's sidecar (the ``.pt2`` is not kept:
  ``program_file`` writes it again from a fresh capture of the same model,
  whose program is the same);
* ``cache_record.json``: the capture cache's record of that capture;
* ``capture.json``: ``Capture.to_json()`` of that capture (written with
  ``indent=1``, keys in the order the record gave them).

Each was written by running ``tiny_dit_report(cache=...)`` with that commit's
package on the import path."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

import ctxreplay
from ctxreplay.demo import TinyDiT

OLD_FILES = Path(__file__).parent / "old_files"
#: the saved capture's files, as ``save_all`` named them
ARTIFACT_NAME = "000-blocks.0-v0.pt2"
#: the default probes when the old files were written (no framework imported):
#: named, so a test run that has imported diffusers or transformers (whose
#: probes then join the default set) records the same snapshot
PROBES = ("autocast", "default_device", "default_dtype", "determinism", "distributed",
          "grad_mode", "matmul_precision", "mode_stack", "numerics", "sdpa_backend")


def tiny_dit_report(cache: Path | None = None) -> ctxreplay.CaptureReport:
    """The session the old files record: one block of a seeded TinyDiT,
    observed once under bfloat16 autocast and inference mode, checked by
    execution."""
    torch.manual_seed(0)
    model = TinyDiT(dim=8, depth=1, heads=2).eval()
    with ctxreplay.capture_with(model, targets="repeated", verify="execute", probes=PROBES,
                                cache=False if cache is None else cache) as session, \
            torch.autocast("cpu", dtype=torch.bfloat16), torch.inference_mode():
        model(torch.rand(1, 4, 8), torch.full((1,), 500.0))
    report = session.finalize()
    assert report.ok, report.failures
    return report


def old_json(name: str) -> Any:
    """An old document, parsed (``saved/manifest.json``, ``capture.json``...)."""
    return json.loads((OLD_FILES / name).read_text())


def old_saved_dir(directory: Path, capture: ctxreplay.Capture) -> Path:
    """The old ``save_all`` directory copied into ``directory``, with its
    artifact file written from ``capture`` (the same program, made now)."""
    target = directory / "saved"
    shutil.copytree(OLD_FILES / "saved", target)
    torch.export.save(capture.artifact, target / ARTIFACT_NAME)
    return target
