"""Probe authoring and the built-in probes: the ``ContextProbe`` contract, the
registry (``register_probe``, ``get_probe``, ``available_probes``,
``default_probes``) and its errors, and every built-in probe, each registered
through that public registry exactly as a downstream package's probe would be."""

from ..core.observer import ProbeObservationError
from ..core.probe import ContextProbe, NotPortableError
from ..core.registry import (
    ProbeInfo,
    ProbeRegistrationWarning,
    UnknownProbeError,
    available_probes,
    default_probes,
    get_probe,
    register_probe,
    unregister_probe,
)
from ..core.snapshots import ProbeDiff, UnknownProbeWarning
from . import (  # noqa: F401  (imported for registration)
    autocast,
    default_device,
    default_dtype,
    determinism,
    distributed,
    grad_mode,
    matmul_precision,
    mode_stack,
    numerics,
    rng,
    sdpa_backend,
)
from .autocast import AutocastProbe, AutocastState
from .contextvar import ContextVarProbe
from .default_device import DefaultDeviceProbe
from .default_dtype import DefaultDtypeProbe
from .determinism import DeterminismProbe, DeterminismState
from .distributed import DistributedProbe, DistributedState
from .forward_context import ForwardContextProbe, LiveState, LiveValueProbe
from .grad_mode import GradModeProbe, GradModeState
from .matmul_precision import MatmulPrecisionProbe, MatmulPrecisionState
from .mode_stack import ModeNotReplayableError, ModeStackProbe, ModeStackState
from .numerics import NumericsProbe, NumericsState
from .rng import RngProbe, RngState
from .sdpa_backend import SdpaBackendProbe, SdpaBackendState

__all__ = [
    # the contract and the registry
    "ContextProbe", "NotPortableError", "ProbeDiff", "ProbeInfo", "ProbeObservationError",
    "ProbeRegistrationWarning", "UnknownProbeError", "UnknownProbeWarning",
    "available_probes", "default_probes", "get_probe", "register_probe", "unregister_probe",
    # the built-in probes and their states
    "AutocastProbe", "AutocastState", "ContextVarProbe", "DefaultDeviceProbe",
    "DefaultDtypeProbe", "DeterminismProbe", "DeterminismState", "DistributedProbe",
    "DistributedState", "ForwardContextProbe",
    "GradModeProbe", "GradModeState", "LiveState", "LiveValueProbe", "MatmulPrecisionProbe",
    "MatmulPrecisionState", "ModeNotReplayableError", "ModeStackProbe", "ModeStackState",
    "NumericsProbe", "NumericsState", "RngProbe", "RngState", "SdpaBackendProbe",
    "SdpaBackendState",
]
