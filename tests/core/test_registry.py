"""The probe registry: names, registration, defaults, entry points."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import pytest
import torch
from plugin_registries import MakeDist

import ctxreplay
from ctxreplay.probes import AutocastProbe

BUILTIN_DEFAULTS = ("autocast", "default_device", "default_dtype", "determinism",
                    "distributed", "grad_mode", "matmul_precision", "mode_stack", "numerics",
                    "sdpa_backend")
#: default probes that join the default set only while their framework is imported
INTEGRATIONS = {"diffusers_attention": "diffusers", "transformers_attention": "transformers"}


def defaults_now() -> tuple[str, ...]:
    """The built-in default set in this process: the torch probes, plus each
    integration whose framework an earlier test imported."""
    return tuple(sorted([*BUILTIN_DEFAULTS,
                         *(n for n, m in INTEGRATIONS.items() if m in sys.modules)]))


class Counter(ctxreplay.probes.ContextProbe[int]):
    """A runtime probe over a plain global."""

    name = "test_counter"
    description = "a counter for registry tests"
    value = 0

    def observe(self) -> int:
        return Counter.value

    def replay(self, state: int) -> AbstractContextManager[None]:
        return nullcontext()


@pytest.fixture
def cleanup() -> Iterator[list[str]]:
    """Names to unregister after the test, whatever happens."""
    names: list[str] = []
    yield names
    for name in names:
        if name in ctxreplay.probes.available_probes():
            ctxreplay.probes.unregister_probe(name)


# -- lookup ----------------------------------------------------------------------

def test_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(ctxreplay.probes.UnknownProbeError) as info:
        ctxreplay.probes.get_probe("autocats")
    err = info.value
    assert isinstance(err, KeyError) and isinstance(err, ValueError)
    message = str(err)
    assert "unknown probe 'autocats'" in message
    assert "did you mean 'autocast'" in message
    for name in ctxreplay.probes.available_probes():
        if ctxreplay.probes.available_probes()[name].loaded:
            assert name in message
    with pytest.raises(ValueError, match=r"known probes: .*grad_mode"):
        ctxreplay.probes.get_probe("nope")
    with pytest.raises(KeyError):
        ctxreplay.probes.unregister_probe("nope")


def test_builtin_info() -> None:
    info = ctxreplay.probes.available_probes()
    for name in [*BUILTIN_DEFAULTS, "rng"]:
        assert info[name].origin == "builtin"
        assert info[name].distribution is None
        assert info[name].error is None and info[name].loaded
        assert info[name].description
        assert info[name].description == ctxreplay.probes.get_probe(name).description
        assert info[name].default is (name != "rng")
    assert list(info) == sorted(info)


def test_default_probes() -> None:
    assert ctxreplay.probes.default_probes() == defaults_now()
    assert ctxreplay.snapshot().names == defaults_now()


# -- registration ----------------------------------------------------------------

def test_register_a_class(cleanup: list[str]) -> None:
    cleanup.append("test_counter")
    assert ctxreplay.probes.register_probe(Counter) is Counter
    probe = ctxreplay.probes.get_probe("test_counter")
    assert type(probe) is Counter
    info = ctxreplay.probes.available_probes()["test_counter"]
    assert (info.origin, info.distribution, info.default) == ("runtime", None, False)
    assert info.description == "a counter for registry tests"
    assert "test_counter" not in ctxreplay.probes.default_probes()


def test_register_an_instance(cleanup: list[str]) -> None:
    cleanup.append("test_counter")
    probe = Counter()
    assert ctxreplay.probes.register_probe(probe) is probe
    assert ctxreplay.probes.get_probe("test_counter") is probe


def test_register_as_a_decorator_keeps_the_class(cleanup: list[str]) -> None:
    cleanup.extend(["test_decorated", "test_decorated_replace"])

    @ctxreplay.probes.register_probe
    class Decorated(Counter):
        name = "test_decorated"

    assert isinstance(Decorated, type) and issubclass(Decorated, ctxreplay.probes.ContextProbe)
    assert type(ctxreplay.probes.get_probe("test_decorated")) is Decorated

    @ctxreplay.probes.register_probe(replace=True)
    class Decorated2(Counter):
        name = "test_decorated_replace"

    assert isinstance(Decorated2, type)
    assert type(ctxreplay.probes.get_probe("test_decorated_replace")) is Decorated2


def test_duplicate_names_are_refused_unless_replace(cleanup: list[str]) -> None:
    cleanup.append("test_counter")
    first, second = Counter(), Counter()
    ctxreplay.probes.register_probe(first)
    with pytest.raises(ValueError, match="'test_counter' is already registered"):
        ctxreplay.probes.register_probe(second)
    assert ctxreplay.probes.get_probe("test_counter") is first
    ctxreplay.probes.register_probe(second, replace=True)
    assert ctxreplay.probes.get_probe("test_counter") is second


def test_replacing_a_builtin_and_putting_it_back() -> None:
    original = ctxreplay.probes.get_probe("autocast")

    class OtherAutocast(AutocastProbe):
        description = "replacement"

    with pytest.raises(ValueError, match=r"already registered.*builtin"):
        ctxreplay.probes.register_probe(OtherAutocast)
    try:
        ctxreplay.probes.register_probe(OtherAutocast, replace=True)
        assert ctxreplay.probes.available_probes()["autocast"].description == "replacement"
        assert type(ctxreplay.snapshot().probes[0]) is OtherAutocast  # defaults re-resolved
    finally:
        ctxreplay.probes.register_probe(original, replace=True)
    assert ctxreplay.probes.get_probe("autocast") is original
    assert ctxreplay.probes.available_probes()["autocast"].origin == "builtin"


def test_invalid_registrations() -> None:
    with pytest.raises(TypeError, match="expected a ContextProbe"):
        ctxreplay.probes.register_probe(42)
    with pytest.raises(TypeError, match="expected a ContextProbe"):
        ctxreplay.probes.register_probe(int)

    class Nameless(Counter):
        name = "not an identifier"

    with pytest.raises(ValueError, match="identifier"):
        ctxreplay.probes.register_probe(Nameless)
    assert "not an identifier" not in ctxreplay.probes.available_probes()


def test_unregister(cleanup: list[str]) -> None:
    probe = ctxreplay.probes.register_probe(Counter())
    assert ctxreplay.probes.unregister_probe("test_counter") is probe
    assert "test_counter" not in ctxreplay.probes.available_probes()
    with pytest.raises(ctxreplay.probes.UnknownProbeError):
        ctxreplay.probes.get_probe("test_counter")


def test_a_runtime_default_probe_joins_the_default_snapshot(cleanup: list[str]) -> None:
    cleanup.append("test_default_counter")

    class DefaultCounter(Counter):
        name = "test_default_counter"
        default = True

    before = ctxreplay.snapshot()
    ctxreplay.probes.register_probe(DefaultCounter)
    assert "test_default_counter" in ctxreplay.probes.default_probes()
    assert ctxreplay.probes.available_probes()["test_default_counter"].default
    snap = ctxreplay.snapshot()
    assert snap.names == tuple(sorted([*defaults_now(), "test_default_counter"]))
    ctxreplay.probes.unregister_probe("test_default_counter")
    assert ctxreplay.snapshot() == before


def test_resolving_probes_for_a_snapshot() -> None:
    autocast = ctxreplay.probes.get_probe("autocast")
    assert ctxreplay.snapshot("autocast").names == ("autocast",)
    assert ctxreplay.snapshot(autocast).probes == (autocast,)
    assert ctxreplay.snapshot(["rng", autocast, "rng"]).names == ("autocast", "rng")
    assert ctxreplay.snapshot([Counter]).names == ("test_counter",)  # a class, unregistered
    with pytest.raises(TypeError, match="expected a name or a ContextProbe"):
        ctxreplay.snapshot([1])
    with pytest.raises(TypeError, match="probes must be"):
        ctxreplay.snapshot(1)
    with pytest.raises(ValueError, match="two different probes are named 'autocast'"):
        ctxreplay.snapshot([autocast, AutocastProbe()])
    with pytest.raises(ctxreplay.probes.UnknownProbeError, match="known probes"):
        ctxreplay.snapshot(["autocast", "nope"])


# -- entry points ----------------------------------------------------------------

def test_the_example_package_is_discovered_through_its_metadata() -> None:
    from ctxreplay_example_probe import probe

    info = ctxreplay.probes.available_probes()["example_forward_context"]
    assert info.origin == "entry_point"
    assert info.distribution == "ctxreplay-example-probe"
    assert info.error is None and not info.default
    assert ctxreplay.probes.get_probe("example_forward_context") is probe
    assert "example_forward_context" not in ctxreplay.probes.default_probes()


FAKE_PROBES = """
    from contextlib import nullcontext

    import ctxreplay


    class GoodProbe(ctxreplay.probes.ContextProbe):
        name = "fake_good"
        description = "a fake probe"

        def observe(self):
            return 0

        def replay(self, state):
            return nullcontext()


    class Mismatch(GoodProbe):
        name = "something_else"


    class Autocast(GoodProbe):
        name = "autocast"


    good_instance = GoodProbe()
    good_instance.name = "fake_instance"
    not_a_probe = 42
"""


def test_broken_entry_points_warn_and_everything_else_works(fake_dist: MakeDist) -> None:
    fake_dist("fake_pkg", {
        "fake_good": "fake_probes_{t}:GoodProbe",
        "fake_instance": "fake_probes_{t}:good_instance",
        "fake_import_error": "fake_missing_module_{t}:probe",
        "fake_raising_import": "fake_raising_{t}:probe",
        "fake_not_a_probe": "fake_probes_{t}:not_a_probe",
        "fake_missing_attr": "fake_probes_{t}:nothing_here",
        "fake_mismatch": "fake_probes_{t}:Mismatch",
        "autocast": "fake_probes_{t}:Autocast",
    }, {
        "fake_probes_{t}": FAKE_PROBES,
        "fake_raising_{t}": "raise RuntimeError('boom at import')\n",
    })
    with pytest.warns(ctxreplay.probes.ProbeRegistrationWarning) as record:
        info = ctxreplay.probes.available_probes()
    # (a broken package installed where the suite runs is not this test's)
    messages = sorted(m for m in map(str, (w.message for w in record)) if "from fake-pkg" in m)
    assert len(messages) == 6, messages
    for name in ["fake_import_error", "fake_raising_import", "fake_not_a_probe",
                 "fake_missing_attr", "fake_mismatch", "autocast"]:
        assert any(f"entry point {name!r} from fake-pkg" in m for m in messages), name

    # The good ones are registered, with their distribution.
    for name in ["fake_good", "fake_instance"]:
        assert info[name].origin == "entry_point"
        assert info[name].distribution == "fake-pkg"
        assert info[name].error is None and info[name].description == "a fake probe"
        assert ctxreplay.probes.get_probe(name).observe() == 0

    # The broken ones are listed with their error and cannot be used.
    errors = {n: info[n].error or "" for n in info
              if not info[n].loaded and info[n].distribution == "fake-pkg"}
    assert set(errors) == {"fake_import_error", "fake_raising_import", "fake_not_a_probe",
                           "fake_missing_attr", "fake_mismatch", "autocast@fake-pkg"}
    assert "already registered" in errors["autocast@fake-pkg"]
    assert errors["fake_import_error"].startswith("ModuleNotFoundError")
    assert errors["fake_raising_import"] == "RuntimeError: boom at import"
    assert errors["fake_not_a_probe"].startswith("TypeError") and \
        "is not a ContextProbe" in errors["fake_not_a_probe"]
    assert errors["fake_missing_attr"].startswith("AttributeError")
    assert "'something_else'" in errors["fake_mismatch"]
    for name in errors:
        assert info[name].origin == "entry_point"
        assert info[name].distribution == "fake-pkg"
        assert not info[name].default
        if "@" not in name:  # the lookup agrees with the listing, and says why
            with pytest.raises(ctxreplay.probes.UnknownProbeError,
                               match=f"{name!r} from fake-pkg is installed but could not be "
                                     "registered"):
                ctxreplay.probes.get_probe(name)

    # A duplicate of a built-in name leaves the built-in in place, and is
    # listed under name@distribution with its error.
    assert info["autocast"].origin == "builtin" and info["autocast"].loaded
    assert type(ctxreplay.probes.get_probe("autocast")) is AutocastProbe

    # Everything else still works, and the warnings come once.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ctxreplay.probes.default_probes() == defaults_now()
        assert ctxreplay.probes.available_probes()["example_forward_context"].loaded
        with torch.autocast("cpu", dtype=torch.bfloat16):
            snap = ctxreplay.snapshot()
        with snap.replay():
            assert torch.is_autocast_enabled("cpu")
        assert ctxreplay.snapshot(["fake_good"]).names == ("fake_good",)


def test_the_same_name_from_two_distributions_registers_once(fake_dist: MakeDist) -> None:
    fake_dist("fake_one", {"fake_good": "fake_probes_{t}:GoodProbe"},
              {"fake_probes_{t}": FAKE_PROBES})
    fake_dist("fake_two", {"fake_good": "fake_probes_{t}:GoodProbe"}, {})
    with pytest.warns(ctxreplay.probes.ProbeRegistrationWarning, match="already registered"):
        info = ctxreplay.probes.available_probes()
    assert info["fake_good"].loaded
    dupes = [n for n in info if n.startswith("fake_good@")]
    assert len(dupes) == 1 and "already registered" in (info[dupes[0]].error or "")
    assert info["fake_good"].distribution in {"fake-one", "fake-two"}


def test_a_broken_entry_point_fixed_at_runtime(fake_dist: MakeDist,
                                               cleanup: list[str]) -> None:
    fake_dist("fake_pkg", {"test_counter": "fake_missing_module_{t}:probe"}, {})
    with pytest.warns(ctxreplay.probes.ProbeRegistrationWarning):
        assert not ctxreplay.probes.available_probes()["test_counter"].loaded
    cleanup.append("test_counter")
    ctxreplay.probes.register_probe(Counter)
    info = ctxreplay.probes.available_probes()["test_counter"]
    assert info.loaded and info.origin == "runtime"


def test_the_suite_collects_and_a_session_runs_with_a_broken_probe_package_installed(
        tmp_path: Path) -> None:
    """An installed package whose probe entry point no longer loads (its
    module moved) is listed with its error: it must never stop ctxreplay's
    own test collection (every test module imports ctxreplay and lists the
    probes), nor a user's session in that environment."""
    root = tmp_path / "site"
    info = root / "moved_probe_pkg-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: moved-probe-pkg\n"
                                   "Version: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[ctxreplay.probes]\nmoved_probe = moved_probe_pkg_gone.probes:MovedProbe\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(root), *filter(None, [os.environ.get("PYTHONPATH")])])}
    tests = Path(__file__).resolve().parents[1]
    collect = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         str(tests), str(tests.parent / "benchmarks")],
        capture_output=True, text=True, env=env, cwd=tests.parent, timeout=900)
    assert collect.returncode == 0, collect.stdout[-3000:] + collect.stderr[-3000:]
    assert " error" not in collect.stdout.splitlines()[-1], collect.stdout[-2000:]
    session = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import warnings, torch, ctxreplay
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            info = ctxreplay.probes.available_probes()["moved_probe"]
        assert not info.loaded and info.error.startswith("ModuleNotFoundError"), info
        assert any("moved_probe" in str(w.message) for w in seen)
        assert "moved_probe" not in ctxreplay.probes.default_probes()
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        with ctxreplay.capture_with(model) as session, torch.no_grad():
            model(torch.rand(2, 4))
        assert session.finalize().ok
        try:
            ctxreplay.probes.get_probe("moved_probe")
        except ctxreplay.probes.UnknownProbeError as exc:
            assert "could not be registered" in str(exc), exc
        else:
            raise AssertionError("a broken probe was looked up")
        print("ok")
    """)], capture_output=True, text=True, env=env, timeout=300)
    assert session.returncode == 0 and session.stdout.strip() == "ok", session.stderr[-3000:]
