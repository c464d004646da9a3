"""The public faces, pinned: what each exports, and that every exception and
warning they export has one root to catch (``ctxreplay.Error`` /
``ctxreplay.Warning``), keeping the builtin base callers already catch."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from types import ModuleType

import pytest

import ctxreplay

FACES = {
    "ctxreplay": {
        "Capture", "CaptureFailure", "CaptureReport", "CaptureSession", "ContextSnapshot",
        "Explanation", "Fidelity", "Mismatch", "Notice", "Problem", "capture_with", "snapshot",
        "Difference", "DispatchStats", "GuardedCapture", "InstallHandle", "LoadedCapture",
        "LoadedManifest", "install", "load", "load_sidecar",
        "ArtifactError", "DistributedError", "Error", "FidelityError", "GuardError",
        "GuardWarning", "SessionError", "Warning", "WeightsError",
    },
    "ctxreplay.compiling": {"TOLERANCES", "CompiledDir", "compile_dir"},
    "ctxreplay.report": {"CaptureExplanation", "CaptureReport", "Explanation", "FidelityError",
                         "ProbeEffect", "SavedManifest", "CacheDetails", "DistributedDetails",
                         "FoldDetails"},
    "ctxreplay.artifacts": {"ArtifactError", "ArtifactSidecar", "OutputRole", "ProgramMeta",
                            "SavedArtifact", "load_sidecar",
                            "ArtifactFormat", "UnknownFormatError", "available_formats",
                            "get_format", "register_format", "unregister_format"},
    "ctxreplay.backends": {"AutoBackend", "Backend", "BackendError", "BackendInfo",
                           "BackendRegistrationWarning", "DynamoBackend", "ExportBackend",
                           "SymbolicBackend", "UnknownBackendError", "available_backends",
                           "classify_exception", "exception_message", "get_backend",
                           "register_backend", "unregister_backend"},
    "ctxreplay.testing": {"GlobalState", "check_probe", "global_state", "leak_check",
                          "state_changes"},
    "ctxreplay.integrations": {"DiffusersAttentionProbe", "DiffusersAttentionState",
                               "FrameworkStateError", "TransformersAttentionProbe",
                               "TransformersAttentionState", "lowering_math_sdpa", "math_sdpa"},
}

#: the probe-authoring part of ctxreplay.probes (the built-in probes are the rest)
PROBE_AUTHORING = {
    "ContextProbe", "NotPortableError", "ProbeDiff", "ProbeInfo", "ProbeObservationError",
    "ProbeRegistrationWarning", "UnknownProbeError", "UnknownProbeWarning", "available_probes",
    "default_probes", "get_probe", "register_probe", "unregister_probe",
}


@pytest.mark.parametrize("face", sorted(FACES))
def test_each_face_exports_what_it_promises(face: str) -> None:
    module = importlib.import_module(face)
    assert set(module.__all__) == FACES[face]
    assert len(module.__all__) == len(set(module.__all__)), "a name is listed twice"
    for name in module.__all__:
        assert hasattr(module, name), f"{face}.{name} is listed but missing"


def test_the_top_level_face_is_small_and_sorted_within_its_groups() -> None:
    names = ctxreplay.__all__
    assert len(names) <= 30
    groups = [names[:12], names[12:21], names[21:]]  # capture+report, artifacts, errors
    for group in groups:
        assert group == sorted(group)
    assert all(n.endswith(("Error", "Warning")) for n in groups[2])


def test_the_probes_face_holds_the_authoring_api_and_every_builtin() -> None:
    exported = set(ctxreplay.probes.__all__)
    assert exported >= PROBE_AUTHORING
    for name in exported - PROBE_AUTHORING:
        value = getattr(ctxreplay.probes, name)
        assert inspect.isclass(value) and value.__module__.startswith("ctxreplay.probes."), name


def _public_classes() -> dict[str, type]:
    found: dict[str, type] = {}
    modules: list[ModuleType] = [importlib.import_module(f) for f in FACES]
    modules.append(ctxreplay.probes)
    modules += [importlib.import_module(i.name) for i in
                pkgutil.walk_packages(ctxreplay.__path__, "ctxreplay.")]
    for module in modules:
        for name in getattr(module, "__all__", ()):
            value = getattr(module, name)
            if inspect.isclass(value) and issubclass(value, BaseException):
                found[f"{value.__module__}.{value.__qualname__}"] = value
    return found


def test_every_public_exception_is_a_ctxreplay_error_or_warning() -> None:
    classes = _public_classes()
    assert len(classes) >= 15  # the faces' errors and warnings, and the probes'
    for where, cls in classes.items():
        if issubclass(cls, Warning):
            assert issubclass(cls, ctxreplay.Warning), where
            assert not issubclass(cls, ctxreplay.Error), where
        else:
            assert issubclass(cls, ctxreplay.Error), where


def test_the_builtin_bases_callers_already_catch_are_kept() -> None:
    assert issubclass(ctxreplay.probes.UnknownProbeError, KeyError)
    assert issubclass(ctxreplay.probes.UnknownProbeError, ValueError)
    assert issubclass(ctxreplay.WeightsError, ValueError)
    assert issubclass(ctxreplay.probes.NotPortableError, TypeError)
    assert issubclass(ctxreplay.FidelityError, AssertionError)
    assert issubclass(ctxreplay.Warning, UserWarning)
    with pytest.raises(ctxreplay.Error, match="no-such-probe"):
        ctxreplay.probes.get_probe("no-such-probe")
