"""Captures on disk: the artifact written in its format (the torch.export ``.pt2``
built in, others registered) with its metadata-only sidecar, checked against the
live call, and the sidecar read back strictly.

The records a saved file hands back are importable from here: ``SavedArtifact``
(``Capture.save``), ``ArtifactSidecar`` and ``load_sidecar``, ``ArtifactError``,
``ProgramMeta`` (what every document of a capture records of its program),
``OutputRole`` (what one output of its graph is);
and the seam a new artifact format plugs into: ``ArtifactFormat``,
``register_format``, ``unregister_format``, ``get_format``,
``available_formats``, ``UnknownFormatError``.
"""

from . import pt2 as pt2  # the built-in format: registers itself on import
from .formats import (
    ArtifactFormat,
    UnknownFormatError,
    available_formats,
    get_format,
    register_format,
    unregister_format,
)
from .program import ProgramMeta
from .roles import OutputRole
from .saving import SavedArtifact
from .sidecar import ArtifactError, ArtifactSidecar, load_sidecar

__all__ = ["ArtifactError", "ArtifactFormat", "ArtifactSidecar", "OutputRole", "ProgramMeta",
           "SavedArtifact", "UnknownFormatError", "available_formats", "get_format", "load_sidecar",
           "register_format", "unregister_format"]
