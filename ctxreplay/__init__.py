"""ctxreplay: faithful deferred graph capture for PyTorch.

Observe the ambient state of a live forward cheaply, key every variant by it,
and replay it when the graph is captured later.

The everyday API is here.  Probe authoring (the contract, the registry, the
built-in probes) is under ``ctxreplay.probes``, capture backends under
``ctxreplay.backends``, the records a report and a saved file hand back under
``ctxreplay.report`` and ``ctxreplay.artifacts``, ahead-of-time compiling of a
saved directory (``ctxreplay compile DIR``) under ``ctxreplay.compiling``, and
test helpers under ``ctxreplay.testing``.
"""

from __future__ import annotations

from . import integrations as _integrations  # noqa: F401  (registers the integration probes)
from . import probes as _builtin_probes  # noqa: F401  (registers the built-ins)
from ._base.version import __version__ as __version__
from .artifacts.sidecar import ArtifactError, load_sidecar
from .capture.results import Capture, CaptureFailure, Notice, Problem
from .core.observer import snapshot
from .core.snapshots import ContextSnapshot
from .dispatch.install import DispatchStats, InstallHandle, install
from .engine.session import CaptureSession, SessionError, capture_with
from .errors import Error, Warning
from .fidelity.verify import Fidelity, Mismatch
from .loading.guard import GuardedCapture, GuardError, GuardWarning
from .loading.load import LoadedCapture, LoadedManifest, load
from .loading.needs import Difference
from .loading.weights import WeightsError
from .report.capture_report import CaptureReport, FidelityError
from .report.explain import Explanation
from .report.ranks import DistributedError

__all__ = [
    # capture and report
    "Capture",
    "CaptureFailure",
    "CaptureReport",
    "CaptureSession",
    "ContextSnapshot",
    "Explanation",
    "Fidelity",
    "Mismatch",
    "Notice",
    "Problem",
    "capture_with",
    "snapshot",
    # using artifacts
    "Difference",
    "DispatchStats",
    "GuardedCapture",
    "InstallHandle",
    "LoadedCapture",
    "LoadedManifest",
    "install",
    "load",
    "load_sidecar",
    # the errors
    "ArtifactError",
    "DistributedError",
    "Error",
    "FidelityError",
    "GuardError",
    "GuardWarning",
    "SessionError",
    "Warning",
    "WeightsError",
]
