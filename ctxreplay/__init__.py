"""ctxreplay: faithful deferred graph capture for PyTorch.

Observe the ambient state of a live forward cheaply, key every variant by it,
and replay it when the graph is captured later.
"""

from __future__ import annotations

from . import probes as _builtin_probes  # noqa: F401  (registers the built-ins)
from ._collective import DistributedError
from ._version import __version__ as __version__
from .artifact import SavedArtifact
from .backends import Backend, BackendError
from .dispatch import DispatchStats, InstallHandle, install
from .explain import CaptureExplanation, Explanation, ProbeEffect
from .guard import GuardedCapture, GuardError, GuardWarning
from .loading import LoadedCapture, LoadedManifest, load
from .manifest import SavedManifest
from .needs import Difference
from .observer import ProbeObservationError, snapshot
from .probe import ContextProbe, NotPortableError
from .probes import ContextVarProbe, DistributedProbe, ForwardContextProbe
from .records import Capture, CaptureFailure, Notice, Problem
from .registry import (
    ProbeInfo,
    ProbeRegistrationWarning,
    UnknownProbeError,
    available_probes,
    default_probes,
    get_probe,
    register_probe,
    unregister_probe,
)
from .report import CaptureReport, FidelityError
from .session import CaptureSession, SessionError, capture_with
from .sidecar import ArtifactError, ArtifactSidecar, load_sidecar
from .snapshot import ContextSnapshot, ProbeDiff, UnknownProbeWarning
from .verify import Fidelity, Mismatch
from .weights import WeightsError

__all__ = [
    "ArtifactError",
    "ArtifactSidecar",
    "CaptureExplanation",
    "Explanation",
    "ProbeEffect",
    "SavedArtifact",
    "load_sidecar",
    "Difference",
    "DispatchStats",
    "GuardError",
    "GuardWarning",
    "GuardedCapture",
    "InstallHandle",
    "LoadedCapture",
    "LoadedManifest",
    "SavedManifest",
    "UnknownProbeWarning",
    "WeightsError",
    "install",
    "load",
    "Backend",
    "BackendError",
    "Capture",
    "CaptureFailure",
    "CaptureReport",
    "CaptureSession",
    "Fidelity",
    "FidelityError",
    "Mismatch",
    "Notice",
    "Problem",
    "ProbeObservationError",
    "SessionError",
    "capture_with",
    "ContextProbe",
    "ContextSnapshot",
    "ContextVarProbe",
    "DistributedError",
    "DistributedProbe",
    "ForwardContextProbe",
    "NotPortableError",
    "ProbeDiff",
    "ProbeInfo",
    "ProbeRegistrationWarning",
    "UnknownProbeError",
    "available_probes",
    "default_probes",
    "get_probe",
    "register_probe",
    "snapshot",
    "unregister_probe",
]
