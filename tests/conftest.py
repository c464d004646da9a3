"""Two oracles for every test.

The leak oracle: every test must leave global torch state (and the probe and
backend registries) exactly as it found it.

The metadata oracle: every report any test's ``finalize()`` returns (or
attaches to the ``FidelityError`` that ``finalize(strict=True)`` raises),
every report ``explain()`` adds to, and every sidecar ``Capture.save``
writes is metadata only (tests/helpers/metadata_check.py); a violation fails the
test that produced it.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.utils.deterministic as det
from metadata_check import MetadataViolation, ReportAudit
from plugin_registries import fake_dist as fake_dist  # a fixture for every test module
from plugin_registries import registered, registry_changes
from torch._C._dynamo.guards import GlobalStateGuard

import ctxreplay
import ctxreplay.artifacts.saving
import ctxreplay.report.manifest
from ctxreplay.testing import GlobalState, global_state, state_changes

pytest_plugins = ["pytester"]  # tests/project/test_metadata_check.py runs the oracle on a suite


@pytest.fixture(autouse=True)
def _leak_oracle(request: pytest.FixtureRequest) -> Iterator[None]:
    held = registered()
    before = global_state()
    # Explicit names: a fresh observer, so no cached snapshot can hide a change.
    snap = ctxreplay.snapshot(ctxreplay.probes.default_probes())
    guard = GlobalStateGuard()
    yield
    problems = state_changes(guard, before, snap) + registry_changes(held, registered())
    if problems:
        _restore(before)
        pytest.fail(
            f"{request.node.nodeid} leaked global state:\n  - " + "\n  - ".join(problems),
            pytrace=False,
        )


def _restore(s: GlobalState) -> None:
    """Best effort, so that one leaking test does not fail every later one."""
    torch.set_default_dtype(s.default_dtype)
    torch.use_deterministic_algorithms(s.deterministic_algorithms,
                                       warn_only=s.deterministic_warn_only)
    det.fill_uninitialized_memory = s.fill_uninitialized_memory  # type: ignore[attr-defined]
    torch.backends.cudnn.enabled = s.cudnn_enabled
    torch.backends.cudnn.benchmark = s.cudnn_benchmark
    torch.backends.cudnn.deterministic = s.cudnn_deterministic
    torch.backends.cudnn.allow_tf32 = s.cudnn_allow_tf32
    torch.set_float32_matmul_precision(s.float32_matmul_precision)
    for device, enabled, dtype in s.autocast:
        torch.set_autocast_enabled(device, enabled)
        torch.set_autocast_dtype(device, dtype)
    torch.set_autocast_cache_enabled(s.autocast_cache_enabled)
    torch.set_grad_enabled(s.grad_enabled)
    torch.set_flush_denormal(all(s.denormal_mode))
    torch.backends.mkldnn.enabled = s.mkldnn_enabled
    torch.backends.mkldnn.deterministic = s.mkldnn_deterministic


# -- the metadata oracle ------------------------------------------------------------------

_AUDIT = ReportAudit()
_RAISED = pytest.StashKey[bool]()


@pytest.fixture(scope="session", autouse=True)
def _metadata_only_everywhere() -> Iterator[ReportAudit]:
    """Session-wide, so module-scoped fixtures' reports are checked too."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ctxreplay.CaptureSession, "finalize",
                   _AUDIT.wrap_finalize(ctxreplay.CaptureSession.finalize))
        mp.setattr(ctxreplay.CaptureReport, "explain",
                   _AUDIT.wrap_explain(ctxreplay.CaptureReport.explain))
        mp.setattr(ctxreplay.artifacts.saving, "save_capture",
                   _AUDIT.wrap_save(ctxreplay.artifacts.saving.save_capture))
        mp.setattr(ctxreplay.report.manifest, "write_manifest",
                   _AUDIT.wrap_manifest(ctxreplay.report.manifest.write_manifest))
        yield _AUDIT


@pytest.fixture(autouse=True)
def _metadata_oracle(request: pytest.FixtureRequest,
                     _metadata_only_everywhere: ReportAudit) -> Iterator[None]:
    yield
    found = _metadata_only_everywhere.reset()
    # a violation the test raised has failed it already; one it swallowed
    # (a broad except, a worker thread) fails it here
    if found and not request.node.stash.get(_RAISED, False):
        pytest.fail(f"{request.node.nodeid} produced a report that is not metadata-only:"
                    "\n  - " + "\n  - ".join(found), pytrace=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item,
                              call: pytest.CallInfo[None]) -> Iterator[None]:
    report = yield
    if call.excinfo is not None and call.excinfo.errisinstance(MetadataViolation):
        item.stash[_RAISED] = True
    return report


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Under pytest-xdist each worker audits its own reports: it hands its
    counts (and any unattributed violation) to the controller, which sums them."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["metadata_oracle"] = {"reports": _AUDIT.reports,
                                           "counts": dict(_AUDIT.counts),
                                           "leftover": _AUDIT.reset()}


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: object, error: object) -> None:
    """The controller's side of ``pytest_sessionfinish`` (a pytest-xdist hook)."""
    audit = getattr(node, "workeroutput", {}).get("metadata_oracle")
    if audit is None:
        return
    _AUDIT.reports += audit["reports"]
    for kind, n in audit["counts"].items():
        _AUDIT.counts[kind] = _AUDIT.counts.get(kind, 0) + n
    _WORKER_LEFTOVERS.extend(audit["leftover"])


_WORKER_LEFTOVERS: list[str] = []


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    counts = ", ".join(f"{n} {kind}" for kind, n in _AUDIT.counts.items())
    terminalreporter.write_line(f"metadata oracle: {_AUDIT.reports} distinct reports checked "
                                f"({counts}; a report is checked again after explain())")
    leftover = _AUDIT.reset() + _WORKER_LEFTOVERS
    if leftover:
        terminalreporter.write_line("metadata oracle: unattributed violations:\n  - "
                                    + "\n  - ".join(leftover), red=True)
