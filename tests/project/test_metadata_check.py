"""The metadata oracle itself (tests/helpers/metadata_check.py, installed for every
test by tests/conftest.py): every rule can fail, the library's own phrases
pass, and the wrapped ``finalize`` behaves exactly like the real one."""

from __future__ import annotations

import inspect
import json
import shutil
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_models import MatmulBlock, bf16
from metadata_check import (
    MAX_FLOATS,
    MAX_STRING,
    MetadataViolation,
    ReportAudit,
    assert_metadata_only,
    check_report,
    metadata_violations,
)

import ctxreplay
import ctxreplay.artifacts.saving
from ctxreplay import CaptureReport, CaptureSession, FidelityError

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

SENTINEL = "SENTINEL-7a2e-planted"
HINT = "not carried by the artifact: autocast=cpu:bfloat16, grad_mode=inference_mode"


# -- every rule can fail ----------------------------------------------------------------

@pytest.mark.parametrize(("bad", "expected"), [
    ({"x": object()}, "$.x: non-JSON value of type builtins.object"),
    ({"x": b"\x00"}, "$.x: non-JSON value of type builtins.bytes"),
    ({"x": torch.ones(2)}, "$.x: non-JSON value of type torch.Tensor"),
    ({"x": object()}, "$: not plain JSON (TypeError)"),
    ({"x": float("nan")}, "$.x: non-finite number"),
    ({"x": [float("-inf")]}, "$.x[0]: non-finite number"),
    ({"x": float("inf")}, "$: not plain JSON (ValueError)"),
    ({1: "a"}, "$: non-string key of type int"),
    ({"Message": "short"}, "$.Message: forbidden key"),
    ({"weights": [1, 2]}, "$.weights: forbidden key"),
    ({"nested": [{"source": "x"}]}, "$.nested[0].source: forbidden key"),
    ({"value": [1, 2]}, "$.value: 'value' holds a container"),
    ({"storage": {"a": 1}}, "$.storage: 'storage' holds a container"),
    ({"note": "x" * (MAX_STRING + 1)}, f"$.note: string of {MAX_STRING + 1} characters"),
    ({"k" * (MAX_STRING + 1): 1}, f"$.<key {'k' * 40!r}>: string of {MAX_STRING + 1}"),
    ({"note": "line one\nline two"}, "$.note: control character"),
    ({"note": "a\rb"}, "$.note: control character"),
    ({"note": "a\tb"}, "$.note: control character"),
    ({"note": "a\x1bb"}, "$.note: control character"),
    ({"note": "Traceback (most recent call last):"}, "$.note: looks like free text"),
    ({"note": 'File "model.py", line 3'}, "$.note: looks like free text"),
    ({"note": "tensor([0.5000, 0.2500])"}, "$.note: looks like free text"),
    ({"note": "Parameter containing:"}, "$.note: looks like free text"),
    ({"note": "def forward(self, x):"}, "$.note: looks like free text"),
    ({"note": "return x + 1"}, "$.note: looks like free text"),
    ({"note": "ValueError: bad=3"}, "$.note: looks like free text"),
    ({"note": "MyException: x"}, "$.note: looks like free text"),
    ({"note": "expected a tensor of shape 4"}, "$.note: reads like prose"),
    ({"Expected a tensor here": 1}, "$.<key 'Expected a tensor here'>: reads like prose"),
    ({"note": HINT}, "$.note: reads like prose"),  # the hint phrase, but not under "hint"
    ({"hint": "missing: autocast"}, "$.hint: 'hint' is not the library's phrase"),
    ({"hint": [HINT]}, "$.hint: 'hint' holds a list"),
    ({"hint": 3}, "$.hint: 'hint' holds a int"),
    ({"hint": "not carried by the artifact: p=x, the user wrote this"},
     "$.hint: reads like prose"),
    ({"hint": HINT + "\n"}, "$.hint: control character"),
    ({"shape": [0.5] * (MAX_FLOATS + 1)}, f"$.shape: {MAX_FLOATS + 1} floats in one list"),
    ({"x": [[0.5] * 100]}, "$.x[0]: 100 floats in one list"),
    ({"note": f"a {SENTINEL} b"}, f"$.note: contains the planted string {SENTINEL!r}"),
    ({SENTINEL: 1}, f"$.<key {SENTINEL!r}>: contains the planted string"),
    ({"note": SENTINEL}, f"$: sentinel {SENTINEL!r} in the serialized document"),
    ({"x": 0.123456789}, "$.x: planted number 0.123456789"),
    ({"x": [1, 0.123456789]}, "$.x[1]: planted number"),
])
def test_every_rule_rejects_its_violation(bad: dict[Any, Any], expected: str) -> None:
    problems = metadata_violations(bad, sentinels=[SENTINEL], sentinel_numbers=[0.123456789])
    assert any(p.startswith(expected) for p in problems), problems
    with pytest.raises(MetadataViolation) as info:
        assert_metadata_only(bad, sentinels=[SENTINEL], sentinel_numbers=[0.123456789])
    assert info.value.problems == problems


def test_a_sentinel_only_the_serialized_document_shows_is_caught() -> None:
    """Split across a key and its value, no single string holds it."""
    doc = {"scope": "Net"}
    assert metadata_violations(doc) == []
    assert metadata_violations(doc, sentinels=['scope": "Net']) == [
        "$: sentinel 'scope\": \"Net' in the serialized document"]


@pytest.mark.parametrize("good", [
    {"scope": "Net", "shape": [2, 8], "dtype": "bfloat16", "device": "cpu"},
    {"note": "x" * MAX_STRING},
    {"x": [0.5] * MAX_FLOATS},
    {"value": 0.5, "storage": None, "other": {"value": "torch.float32"}},
    {"status": "no effect", "context": {"matmul_precision": "highest -> high"}},
    {"hint": HINT},
    {"hint": "not carried by the artifact: autocast, grad_mode"},
    {"hint": None},
    {"describe": "<undescribable: Boom>", "exc_type": "Boom"},
    {"x": 0.123456788},
    [],
])
def test_metadata_passes(good: Any) -> None:
    assert metadata_violations(good, sentinels=[SENTINEL],
                               sentinel_numbers=[0.123456789]) == []
    assert_metadata_only(good, sentinels=[SENTINEL], sentinel_numbers=[0.123456789])


# -- reports -------------------------------------------------------------------------------

class _Doc:
    """Anything with a ``to_json``: what ``check_report`` reads."""

    def __init__(self, doc: Any) -> None:
        self.doc = doc

    def to_json(self) -> Any:
        return self.doc


def _report(**settings: Any) -> CaptureReport:
    return CaptureReport((), (), ("autocast",), dict(settings), {"variants": 0})


def test_check_report_returns_a_clean_report_and_rejects_others() -> None:
    report = _report(verify="signature")
    assert check_report(report) is report
    with pytest.raises(MetadataViolation, match="control character"):
        check_report(_report(note="a\nb"))
    with pytest.raises(MetadataViolation, match="planted string"):
        check_report(_report(note=SENTINEL), sentinels=[SENTINEL])
    with pytest.raises(MetadataViolation, match=r"json.dumps\(allow_nan=False\) fails"):
        check_report(_Doc({"x": float("nan")}))  # type: ignore[arg-type]
    with pytest.raises(MetadataViolation, match="does not survive a JSON round trip"):
        check_report(_Doc({"x": (1, 2)}))  # type: ignore[arg-type]


# -- the wrapped finalize ------------------------------------------------------------------

def test_every_finalize_of_the_suite_is_wrapped() -> None:
    wrapped = CaptureSession.finalize
    original = inspect.unwrap(wrapped)
    assert original is not wrapped  # tests/conftest.py installed the audit
    assert inspect.signature(wrapped) == inspect.signature(original)
    assert (wrapped.__name__, wrapped.__doc__) == (original.__name__, original.__doc__)
    assert inspect.unwrap(CaptureReport.explain) is not CaptureReport.explain
    assert inspect.unwrap(ctxreplay.artifacts.saving.save_capture) is not \
        ctxreplay.artifacts.saving.save_capture
    assert inspect.unwrap(ctxreplay.report.manifest.write_manifest) is not \
        ctxreplay.report.manifest.write_manifest


class _FakeSession:
    def __init__(self, outcome: CaptureReport | BaseException) -> None:
        self.outcome = outcome
        self.calls: list[bool] = []

    def finalize(self, *, strict: bool = False) -> CaptureReport:
        self.calls.append(strict)
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome


def test_the_wrapper_keeps_finalize_s_behaviour() -> None:
    audit = ReportAudit()
    finalize = audit.wrap_finalize(_FakeSession.finalize)
    good = _report()
    s = _FakeSession(good)
    assert finalize(s) is good and finalize(s, strict=True) is good
    assert s.calls == [False, True]
    with pytest.raises(TypeError):
        finalize(s, True)  # keyword-only, like the real one
    error = FidelityError(good)
    with pytest.raises(FidelityError) as info:
        finalize(_FakeSession(error), strict=True)
    assert info.value is error  # the very exception, untouched
    interrupt = KeyboardInterrupt()
    with pytest.raises(KeyboardInterrupt) as kb:
        finalize(_FakeSession(interrupt))
    assert kb.value is interrupt
    assert audit.counts["finalize"] == 2 and audit.counts["FidelityError"] == 1
    assert audit.reports == 1 and audit.reset() == []


def test_the_wrapper_rejects_a_bad_report_returned_or_raised() -> None:
    audit = ReportAudit()
    finalize = audit.wrap_finalize(_FakeSession.finalize)
    bad = _report(note="a\nb")
    with pytest.raises(MetadataViolation, match="finalize: report is not metadata-only"):
        finalize(_FakeSession(bad))
    error = FidelityError(bad)
    with pytest.raises(MetadataViolation, match="FidelityError: report") as info:
        finalize(_FakeSession(error), strict=True)
    assert info.value.__context__ is error
    found = audit.reset()
    assert len(found) == 2 and all("control character" in p for p in found)
    assert audit.reset() == []


def test_the_wrapped_explain_and_save_check_their_documents(tmp_path: Path) -> None:
    audit = ReportAudit()

    def explain(report: CaptureReport, model: object) -> str:
        report.settings["note"] = "the explanation wrote a sentence"
        return "result"

    report = _report()
    with pytest.raises(MetadataViolation, match="reads like prose"):
        audit.wrap_explain(explain)(report, None)

    sidecar = tmp_path / "a.pt2.json"

    class Saved:
        def __init__(self, doc: Any) -> None:
            sidecar.write_text(json.dumps(doc))
            self.sidecar = sidecar

    save = audit.wrap_save(Saved)
    assert save({"scope": "Net"}).sidecar == sidecar
    with pytest.raises(MetadataViolation, match=r"a\.pt2\.json: .*forbidden key"):
        save({"source": "x"})
    assert audit.counts["sidecar"] == 2 and len(audit.reset()) == 2

    written: list[Any] = []
    write = audit.wrap_manifest(lambda path, doc: written.append(doc))
    write(tmp_path / "manifest.json", {"scope": "Net"})
    with pytest.raises(MetadataViolation, match=r"manifest\.json: .*forbidden key"):
        write(tmp_path / "manifest.json", {"source": "x"})
    assert written == [{"scope": "Net"}]  # a bad manifest is never written
    assert audit.counts["manifest"] == 2 and len(audit.reset()) == 1


class _ProseProbe(ctxreplay.probes.ContextProbe[str]):
    """A custom probe whose description is a sentence: the library puts it
    into the report's ``context`` as it is."""

    name = "test_prose"

    def observe(self) -> str:
        return "x"

    def replay(self, state: str) -> AbstractContextManager[None]:
        return nullcontext()

    def describe(self, state: str) -> str:
        return "the user typed this whole sentence"


def test_the_suite_s_finalize_rejects_a_real_bad_report(
        _metadata_only_everywhere: ReportAudit) -> None:
    model = MatmulBlock()
    with ctxreplay.capture_with(model, probes=["autocast", _ProseProbe()],
                                backend="export") as s:
        model(torch.rand(4, 16))
    with pytest.raises(MetadataViolation, match=r"\.context\.test_prose: reads like prose"):
        s.finalize()
    # strict: the report the FidelityError carries is checked too
    with ctxreplay.capture_with(model, probes=["autocast", _ProseProbe()], backend="export",
                                replay="off") as s, bf16():
        model(torch.rand(4, 16))
    with pytest.raises(MetadataViolation, match="FidelityError: report") as info:
        s.finalize(strict=True)
    assert isinstance(info.value.__context__, FidelityError)
    # acknowledged here, or this test's teardown would fail it
    assert len(_metadata_only_everywhere.reset()) >= 2


_SWALLOWING = '''
from contextlib import nullcontext

import pytest
import torch
from engine_models import MatmulBlock

import ctxreplay


class Prose(ctxreplay.probes.ContextProbe[str]):
    name = "test_prose"

    def observe(self):
        return "x"

    def replay(self, state):
        return nullcontext()

    def describe(self, state):
        return "the user typed this whole sentence"


def _session():
    model = MatmulBlock()
    with ctxreplay.capture_with(model, probes=[Prose()], backend="export") as s:
        model(torch.rand(4, 16))
    return s


def test_swallowed():
    try:
        _session().finalize()
    except AssertionError:
        pass


def test_raised():
    _session().finalize()


def test_clean():
    model = MatmulBlock()
    with ctxreplay.capture_with(model, probes=["autocast"], backend="export") as s:
        model(torch.rand(4, 16))
    assert s.finalize().ok
'''


def test_a_swallowed_violation_still_fails_its_test(pytester: pytest.Pytester) -> None:
    tests = Path(__file__).resolve().parents[1]
    shutil.copy(tests / "conftest.py", pytester.path / "conftest.py")
    for name in ("metadata_check.py", "plugin_registries.py", "engine_models.py"):
        shutil.copy(tests / "helpers" / name, pytester.path / name)
    pytester.makepyfile(test_swallow=_SWALLOWING)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-W",
                                           "ignore::FutureWarning")
    result.assert_outcomes(passed=2, failed=1, errors=1)
    result.stdout.fnmatch_lines([
        "*ERROR at teardown of test_swallowed*",
        "*test_swallow.py::test_swallowed produced a report that is not metadata-only*",
    ])
    out = result.stdout.str()
    assert "ERROR at teardown of test_raised" not in out  # failed once, not twice
    assert "FAILED test_swallow.py::test_raised" in out
