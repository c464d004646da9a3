"""Captures on disk: the ``.pt2`` written with its metadata-only sidecar, checked
against the live call, and the sidecar read back strictly.

The records a saved file hands back are importable from here: ``SavedArtifact``
(``Capture.save``), ``ArtifactSidecar`` and ``load_sidecar``, ``ArtifactError``.
"""

from .saving import SavedArtifact
from .sidecar import ArtifactError, ArtifactSidecar, load_sidecar

__all__ = ["ArtifactError", "ArtifactSidecar", "SavedArtifact", "load_sidecar"]
