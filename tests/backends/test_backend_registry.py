"""The backend registry: names, registration, replacing, entry points.

Every test leaves the registry as it found it; the suite's leak oracle
(``conftest.py``) checks that after each one, and the last tests show it
catching a registration left behind, in a suite of its own too.
"""

from __future__ import annotations

import shutil
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from plugin_registries import MakeDist, registered, registry_changes
from torch import nn

import ctxreplay
from ctxreplay.backends import (
    AutoBackend,
    Backend,
    BackendRegistrationWarning,
    DynamoBackend,
    ExportBackend,
    SymbolicBackend,
    UnknownBackendError,
    available_backends,
    get_backend,
    register_backend,
    unregister_backend,
)
from ctxreplay.cli import main

BUILTINS = {"auto": AutoBackend, "export": ExportBackend, "dynamo": DynamoBackend,
            "symbolic": SymbolicBackend}


class Toy(Backend):
    """A toy backend: torch.export, counting its captures."""

    name = "toy"
    calls = 0

    def capture(self, module: nn.Module, args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> Any:
        Toy.calls += 1
        return ExportBackend().capture(module, args, kwargs)


def _capture_two_variants(backend: object) -> ctxreplay.CaptureReport:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with ctxreplay.capture_with(model, backend=backend) as session:
        model(torch.rand(2, 4))
        model(torch.rand(3, 4))
        model(torch.rand(3, 4))
    return session.finalize()


# -- the built-ins ---------------------------------------------------------------

def test_the_builtins_are_registered_like_any_backend() -> None:
    info = available_backends()
    assert set(BUILTINS) <= set(info)
    for name, cls in BUILTINS.items():
        assert (info[name].origin, info[name].distribution, info[name].loaded) == \
            ("builtin", None, True)
        # the docstring's first paragraph, as plain text
        assert info[name].description and "``" not in info[name].description
        plain = " ".join((cls.__doc__ or "").replace("``", "").split())
        assert plain.startswith(info[name].description)
        first, second = get_backend(name), get_backend(name)
        assert type(first) is cls and first.name == name
        assert first is not second  # each session gets its own (AutoBackend keeps attempts)
    assert list(info) == sorted(info)


def test_an_object_with_a_capture_method_keeps_working() -> None:
    backend = ExportBackend()
    assert get_backend(backend) is backend

    class Duck:
        name = "duck"

        def capture(self, module: nn.Module, args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> Any:
            return ExportBackend().capture(module, args, kwargs)

    duck = Duck()
    adapted = get_backend(duck)
    assert isinstance(adapted, Backend) and adapted.name == "duck"
    with pytest.raises(TypeError, match="capture"):
        get_backend(42)


# -- lookup ----------------------------------------------------------------------

def test_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(UnknownBackendError) as info:
        get_backend("exprot")
    err = info.value
    assert isinstance(err, ctxreplay.Error) and isinstance(err, ValueError)
    message = str(err)
    assert "unknown backend 'exprot'" in message
    assert "did you mean 'export'" in message
    for name, backend_info in available_backends().items():
        assert (name in message) is backend_info.loaded
    with pytest.raises(UnknownBackendError, match=r"known backends: .*symbolic"):
        unregister_backend("nope")
    # capture_with takes the same names, so it fails the same way
    with pytest.raises(UnknownBackendError, match="known backends"):
        ctxreplay.capture_with(nn.Linear(2, 2), backend="nope")


# -- registration ----------------------------------------------------------------

def test_a_runtime_backend_is_chosen_by_name_and_used() -> None:
    with pytest.raises(UnknownBackendError):  # not yet registered
        _capture_two_variants("toy")
    before = available_backends()
    assert register_backend(Toy) is Toy
    try:
        info = available_backends()["toy"]
        assert (info.origin, info.distribution, info.error) == ("runtime", None, None)
        assert info.description == "A toy backend: torch.export, counting its captures."
        Toy.calls = 0
        report = _capture_two_variants("toy")
        assert report.ok, report.failures
        assert [c.backend for c in report.captures] == ["toy", "toy"]
        assert Toy.calls == len(report.captures) == 2
    finally:
        assert unregister_backend("toy") is Toy
    assert available_backends() == before
    with pytest.raises(UnknownBackendError):
        get_backend("toy")


def test_a_registered_instance_is_handed_out_as_it_is() -> None:
    toy = Toy()
    register_backend(toy, name="toy_instance")
    try:
        assert get_backend("toy_instance") is toy
        Toy.calls = 0
        report = _capture_two_variants("toy_instance")
        # reports call it by its own name; the registry key is an alias
        assert [c.backend for c in report.captures] == ["toy", "toy"]
        assert Toy.calls == 2
    finally:
        assert unregister_backend("toy_instance") is toy


def test_as_a_decorator_keeps_the_class() -> None:
    @register_backend
    class Decorated(Toy):
        name = "toy_decorated"

    @register_backend(name="toy_aliased")
    class Aliased(Toy):
        pass

    try:
        assert isinstance(Decorated, type) and isinstance(Aliased, type)
        assert type(get_backend("toy_decorated")) is Decorated
        assert type(get_backend("toy_aliased")) is Aliased
        assert available_backends()["toy_aliased"].description == ""  # no docstring of its own
    finally:
        unregister_backend("toy_decorated")
        unregister_backend("toy_aliased")


def test_replacing_a_builtin_needs_replace_and_can_be_undone() -> None:
    class OtherExport(Toy):
        """Another export."""

        name = "export"

    with pytest.raises(ValueError, match=r"'export' is already registered \(builtin\)"):
        register_backend(OtherExport)
    assert type(get_backend("export")) is ExportBackend
    try:
        register_backend(OtherExport, replace=True)
        info = available_backends()["export"]
        assert (info.origin, info.description) == ("runtime", "Another export.")
        Toy.calls = 0
        report = _capture_two_variants("export")
        assert Toy.calls == len(report.captures) == 2
    finally:
        register_backend(ExportBackend, replace=True)
    assert type(get_backend("export")) is ExportBackend
    assert available_backends()["export"].origin == "builtin"


def test_a_duplicate_runtime_name_is_refused_unless_replace() -> None:
    first, second = Toy(), Toy()
    register_backend(first)
    try:
        with pytest.raises(ValueError, match=r"'toy' is already registered \(runtime\)"):
            register_backend(second)
        assert get_backend("toy") is first
        register_backend(second, replace=True)
        assert get_backend("toy") is second
    finally:
        unregister_backend("toy")


def test_invalid_registrations() -> None:
    before = available_backends()
    with pytest.raises(TypeError, match="capture"):
        register_backend(42)
    with pytest.raises(TypeError, match="capture"):
        register_backend(int)
    with pytest.raises(TypeError, match="abstract"):
        register_backend(Backend, name="abstract")

    class Nameless:
        def capture(self, module: nn.Module, args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> Any:
            return module

    with pytest.raises(ValueError, match="pass name="):
        register_backend(Nameless)
    with pytest.raises(ValueError, match="identifier"):
        register_backend(Toy, name="not an identifier")
    assert available_backends() == before


# -- entry points ----------------------------------------------------------------

FAKE_BACKENDS = """
    import torch

    import ctxreplay


    class GoodBackend(ctxreplay.backends.Backend):
        \"\"\"A fake backend: torch.export.\"\"\"

        name = "fake_good"

        def capture(self, module, args, kwargs):
            return torch.export.export(module, args, kwargs or None)


    good_instance = GoodBackend()
    not_a_backend = 42
"""


def test_entry_points_register_lazily_once_and_broken_ones_only_warn(
        fake_dist: MakeDist) -> None:
    fake_dist("fake_pkg", {
        "fake_good": "fake_backends_{t}:GoodBackend",
        "fake_instance": "fake_backends_{t}:good_instance",
        "fake_import_error": "fake_missing_module_{t}:backend",
        "fake_raising_import": "fake_raising_{t}:backend",
        "fake_not_a_backend": "fake_backends_{t}:not_a_backend",
        "export": "fake_backends_{t}:GoodBackend",
    }, {
        "fake_backends_{t}": FAKE_BACKENDS,
        "fake_raising_{t}": "raise RuntimeError('boom at import')\n",
    }, group="ctxreplay.backends")
    loaded = [m for m in sys.modules if m.startswith("fake_backends_")]
    assert not loaded, "entry points load on the first lookup, not before"
    with pytest.warns(BackendRegistrationWarning) as record:
        info = available_backends()
    # (a broken package installed where the suite runs is not this test's)
    messages = sorted(m for m in map(str, (w.message for w in record)) if "from fake-pkg" in m)
    assert len(messages) == 4, messages
    for name in ["fake_import_error", "fake_raising_import", "fake_not_a_backend", "export"]:
        assert any(f"backend entry point {name!r} from fake-pkg" in m for m in messages), name

    # The good ones are registered, with their distribution, under the entry
    # point's name.
    for name in ["fake_good", "fake_instance"]:
        assert (info[name].origin, info[name].distribution, info[name].error) == \
            ("entry_point", "fake-pkg", None)
        assert info[name].description == "A fake backend: torch.export."
    assert type(get_backend("fake_good")).__name__ == "GoodBackend"
    instance = get_backend("fake_instance")
    assert get_backend("fake_instance") is instance

    # The broken ones are listed with their error and cannot be used.
    errors = {n: info[n].error or "" for n in info
              if not info[n].loaded and info[n].distribution == "fake-pkg"}
    assert set(errors) == {"fake_import_error", "fake_raising_import", "fake_not_a_backend",
                           "export@fake-pkg"}
    assert errors["fake_import_error"].startswith("ModuleNotFoundError")
    assert errors["fake_raising_import"] == "RuntimeError: boom at import"
    assert errors["fake_not_a_backend"].startswith("TypeError")
    assert "already registered" in errors["export@fake-pkg"]
    with pytest.raises(UnknownBackendError):
        get_backend("fake_import_error")
    assert info["export"].origin == "builtin"
    assert type(get_backend("export")) is ExportBackend

    # Everything else still works, and the warnings came once.  (Only this
    # registry's: a broken probe package installed where the suite runs warns
    # when the probes load, as it should.)
    with warnings.catch_warnings():
        warnings.simplefilter("error", BackendRegistrationWarning)
        assert available_backends() == info
        report = _capture_two_variants("fake_good")
        assert report.ok, report.failures
        assert {c.backend for c in report.captures} == {"fake_good"}
        assert _capture_two_variants("auto").ok


def test_the_command_lists_every_backend(fake_dist: MakeDist,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    fake_dist("fake_pkg", {
        "fake_good": "fake_backends_{t}:GoodBackend",
        "fake_import_error": "fake_missing_module_{t}:backend",
    }, {"fake_backends_{t}": FAKE_BACKENDS}, group="ctxreplay.backends")
    register_backend(Toy)
    try:
        with pytest.warns(BackendRegistrationWarning):
            assert main(["backends"]) == 0
    finally:
        unregister_backend("toy")
    lines = capsys.readouterr().out.splitlines()
    named = {line.split()[0]: line for line in lines if not line.startswith(" ")}
    assert set(named) == set(BUILTINS) | {"toy", "fake_good", "fake_import_error"}
    for name in BUILTINS:
        assert named[name].split()[1] == "[builtin]"
    assert " [runtime] A toy backend" in named["toy"]
    assert " [entry_point, fake-pkg] A fake backend: torch.export." in named["fake_good"]
    broken = lines.index(named["fake_import_error"])
    assert lines[broken + 1].split()[:2] == ["ERROR:", "ModuleNotFoundError:"]


# -- the leak oracle -----------------------------------------------------------

def test_the_leak_oracle_sees_a_backend_left_registered() -> None:
    before = registered()
    register_backend(Toy)
    try:
        problems = registry_changes(before, registered())
    finally:
        unregister_backend("toy")
    assert len(problems) == 1 and problems[0].startswith("backend registry:"), problems
    assert "added ['toy']" in problems[0]
    assert registry_changes(before, registered()) == []


def test_the_leak_oracle_sees_a_builtin_replaced_by_a_lookalike() -> None:
    # same class, same origin, same description: only the object differs
    before = registered()
    register_backend(ExportBackend(strict=True), replace=True)
    try:
        assert available_backends()["export"] == before["backend registry"]["export"][0]
        problems = registry_changes(before, registered())
    finally:
        register_backend(ExportBackend, replace=True)
    assert len(problems) == 1 and "changed ['export']" in problems[0], problems
    assert registry_changes(before, registered()) == []


_LEAKING = '''
import ctxreplay


class Left(ctxreplay.backends.Backend):
    name = "left_behind"

    def capture(self, module, args, kwargs):
        return module


def test_leaves_a_backend_registered():
    ctxreplay.backends.register_backend(Left)


def test_cleans_up():
    ctxreplay.backends.register_backend(Left, name="cleaned_up")
    ctxreplay.backends.unregister_backend("cleaned_up")
'''


def test_the_suite_fails_a_test_that_leaves_a_backend_registered(
        pytester: pytest.Pytester) -> None:
    tests = Path(__file__).resolve().parents[1]
    shutil.copy(tests / "conftest.py", pytester.path / "conftest.py")
    for name in ("metadata_check.py", "plugin_registries.py"):
        shutil.copy(tests / "helpers" / name, pytester.path / name)
    pytester.makepyfile(test_leaking=_LEAKING)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, errors=1)
    out = result.stdout.str()
    assert "test_leaking.py::test_leaves_a_backend_registered leaked global state:" in out
    assert "backend registry: added ['left_behind'], removed [], changed []" in out
    assert "ERROR at teardown of test_cleans_up" not in out


def test_a_graph_holding_a_tensor_its_trace_made_is_refused() -> None:
    """Dynamo of torch 2.9 and earlier kept a tensor the forward stored in a
    dict of its module as a FakeTensor constant of the graph: an artifact
    that could never run, and ok at ``verify="signature"``.  The graph
    module is built here as torch left it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ctxreplay.backends.builtin import refuse_fake_tensors

    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    refuse_fake_tensors(gm)  # real tensors only: accepted
    with FakeTensorMode():
        made = torch.ones(3)
    gm._tensor_constant0 = made
    with pytest.raises(ValueError, match="_tensor_constant0"):
        refuse_fake_tensors(gm)
