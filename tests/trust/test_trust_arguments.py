"""Argument objects a forward changes.

A graph reproduces what a forward does to tensors (an in-place update of an
input is a mutated input, written back when the program runs) and nothing
of what it does to Python objects: a list it appends to, an attribute it
sets on an argument, transformers' ``DynamicCache`` assigning each layer a
longer ``keys``.  Such a capture is not ok (a ``Mismatch`` of field
``argument`` naming the type and attribute) and ``install`` never
dispatches it (``mutates_argument``).

The oracle is eager: the live objects after an installed call against the
same call run eagerly, generated tokens against ``generate()`` without
ctxreplay, the live cache tensors against eager's.  The negative controls
run the graph where the fix refuses it and show what it gets wrong.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import attrs
import pytest
import real_models
import torch
from torch import nn

import ctxreplay
from ctxreplay._base.torchcaps import CAPS
from ctxreplay.backends import ExportBackend
from ctxreplay.fidelity.verify import Fidelity

pytestmark = [pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning")]


def _argument_mismatches(report: ctxreplay.CaptureReport) -> list[ctxreplay.Mismatch]:
    return [m for c in report.captures for m in c.fidelity.mismatches if m.field == "argument"]


# -- small cases ---------------------------------------------------------------------

class Appends(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, log: list[Any]) -> torch.Tensor:
        y: torch.Tensor = self.lin(x)
        log.append(y.shape[0])
        return y


class State:
    def __init__(self) -> None:
        self.scale = 2.0


class HeldState:
    def __init__(self) -> None:
        self.bias = torch.ones(4)


class SetsAttribute(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, state: Any) -> torch.Tensor:
        y: torch.Tensor = self.lin(x)
        state.last = y  # a Python attribute set on the argument: no graph op
        return y


class IndexCopies(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, cache: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        cache.index_copy_(0, pos, self.lin(x))  # an in-place update: a mutated input
        out: torch.Tensor = cache.sum(0)
        return out


class UpdatesOtherwiseWhenExported(nn.Module):
    """Updates its input in place one way eagerly, another way in the graph
    (its outputs agree): only a check of the updated inputs tells."""

    def forward(self, x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        cache.add_(1.0 if torch.compiler.is_exporting() else 2.0)
        return x * 2


class EmptyCache:
    """A cache before its first update: no tensor inside, so a constant."""

    def __init__(self) -> None:
        self.layers: list[Any] = []


class ReadsCache(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, cache: EmptyCache) -> torch.Tensor:
        out: torch.Tensor = self.lin(x) * (len(cache.layers) + 1)
        return out


def _capture(model: nn.Module, *calls: tuple[Any, ...]) -> ctxreplay.CaptureReport:
    with ctxreplay.capture_with(model, verify="execute") as session, torch.no_grad():
        for args in calls:
            model(*args)
    return session.finalize()


def test_a_list_append_is_not_ok_and_runs_eagerly_once_installed() -> None:
    torch.manual_seed(0)
    model = Appends()
    x = torch.rand(2, 4)
    report = _capture(model, (x, []))
    assert not report.ok
    [m] = _argument_mismatches(report)
    assert (m.path, m.live) == ("args[1]", "list: appended (0 -> 1 items)")
    # the control: the graph, run as install would, leaves the list alone
    log: list[Any] = []
    report.captures[0].artifact.module()(x, log)
    assert log == []
    with ctxreplay.install(model, report) as handle, torch.no_grad():
        log = []
        model(x, log)
        assert log == [2]  # eager ran: the append happened, as without install
        assert handle.stats().reasons == {"mutates_argument": 1}


@pytest.mark.parametrize("state", [State, HeldState], ids=["plain", "holding_tensors"])
def test_an_attribute_set_on_an_argument_is_not_ok_and_named(state: type) -> None:
    torch.manual_seed(0)
    model = SetsAttribute()
    x = torch.rand(2, 4)
    report = _capture(model, (x, state()))
    assert not report.ok
    [m] = _argument_mismatches(report)
    assert m.path == "args[1].last"
    assert m.live == f"{state.__name__}.last: attribute set"
    for policy in ("eager", "dispatch"):
        with ctxreplay.install(model, report, object_args=policy) as handle, torch.no_grad():
            live = state()
            out = model(x, live)
            assert torch.equal(live.last, out)  # eager ran and set it
            assert handle.stats().reasons == {"mutates_argument": 1}


def test_an_in_place_tensor_update_is_ok_and_install_writes_the_live_tensor() -> None:
    torch.manual_seed(0)
    model = IndexCopies()
    x, pos = torch.rand(2, 4), torch.tensor([1, 3])
    report = _capture(model, (x, torch.zeros(5, 4), pos))
    assert report.ok and not _argument_mismatches(report)
    eager_cache = torch.zeros(5, 4)
    with torch.no_grad():
        expected = model(x, eager_cache, pos)
    assert eager_cache.abs().sum() > 0
    with ctxreplay.install(model, report) as handle, torch.no_grad():
        cache = torch.zeros(5, 4)
        out = model(x, cache, pos)
        assert handle.stats().total_hits == 1
    # the program wrote the live tensor as the eager forward does
    assert torch.equal(cache, eager_cache) and torch.equal(out, expected)


def test_an_in_place_update_the_graph_gets_wrong_is_not_ok() -> None:
    model = UpdatesOtherwiseWhenExported()
    x = torch.rand(2, 4)
    report = _capture(model, (x, torch.zeros(3)))
    assert not report.ok
    [m] = report.captures[0].fidelity.mismatches
    assert (m.path, m.field, m.level) == ("args[1]", "values", "execute")
    # the oracle: eager and the program agree on the output, not on the cache
    eager_cache, program_cache = torch.zeros(3), torch.zeros(3)
    assert torch.equal(model(x, eager_cache), report.captures[0].artifact.module()(
        x, program_cache))
    assert not torch.equal(eager_cache, program_cache)


def test_an_object_argument_bound_as_a_constant_runs_eagerly_by_default() -> None:
    # Holding no tensor, the cache is a constant of the graph (its length
    # read as 0); the default policy runs calls with object arguments
    # eagerly, the constant ones included.
    torch.manual_seed(0)
    model = ReadsCache()
    x = torch.rand(2, 4)
    report = _capture(model, (x, EmptyCache()))
    assert report.ok and report.captures[0].constants == ("args[1]",)
    with ctxreplay.install(model, report) as handle, torch.no_grad():
        model(x, EmptyCache())
        assert handle.stats().reasons == {"object_arguments": 1}
    with ctxreplay.install(model, report, object_args="dispatch") as handle, torch.no_grad():
        assert torch.equal(model(x, EmptyCache()), model.lin(x))
        assert handle.stats().total_hits == 1


# -- tiny Qwen2, generate() ------------------------------------------------------------

VOCAB = 128
_GEN: dict[str, Any] = {"max_new_tokens": 12, "do_sample": False, "pad_token_id": 0}


def _qwen2() -> nn.Module:
    return real_models.qwen2()


def _prompt() -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(1))


def _generate(model: nn.Module, **extra: Any) -> Any:
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.inference_mode():
        return model.generate(_prompt(), **_GEN, **extra)


def _installed_generate(model: nn.Module, captures: Any, object_args: str = "eager",
                        **extra: Any) -> tuple[Any, Any]:
    """``generate()`` under an install of ``captures``, and the install's stats."""
    with ctxreplay.install(model, captures, object_args=object_args) as handle:
        return _generate(model, **extra), handle.stats()


def _captured(model: nn.Module, **options: Any) -> ctxreplay.CaptureReport:
    extra = options.pop("generate", {})
    with ctxreplay.capture_with(model, targets="repeated", **options) as session:
        _generate(model, **extra)
    return session.finalize()


def _vouched(report: ctxreplay.CaptureReport) -> list[ctxreplay.Capture]:
    """The captures as a checker blind to argument objects would pass them."""
    return [attrs.evolve(c, fidelity=Fidelity(c.fidelity.level, True, (),
                                              c.fidelity.checked or ("signature",)))
            for c in report.captures]


@pytest.mark.models
@pytest.mark.parametrize("options", [{}, {"max_variants": 64,
                                          "ignore_attributes": ["layer_idx"]}],
                         ids=["default", "shared_across_layers"])
def test_qwen2_dynamic_cache_generate_installed_in_process_gives_eager_tokens(
        options: dict[str, Any]) -> None:
    model = _qwen2()
    eager = _generate(model)
    report = _captured(model, **options)
    if "max_variants" not in options and not CAPS.export_guards_sizes:
        _assert_over_the_limit_unfolded(model, report, eager)
        return
    # every layer call grows the DynamicCache by assignment: the program
    # returns the new keys and values, and the check compared them
    assert report.ok, report.problems
    assert all(c.assigned is not None and any(".keys" in "".join(p) for p in c.assigned.tensors)
               for c in report.captures)
    got, stats = _installed_generate(model, report)  # object arguments run eagerly
    assert torch.equal(got, eager), (got.tolist(), eager.tolist())
    assert stats.total_hits == 0 and set(stats.reasons) == {"object_arguments"}
    got, stats = _installed_generate(model, report, "dispatch")
    assert torch.equal(got, eager), (got.tolist(), eager.tolist())
    assert stats.total_hits == sum(c.calls for c in report.captures) and not stats.reasons
    # the control: the same programs dispatched by a dispatcher that does
    # not take their assignments off the outputs cannot run generate()
    with ctxreplay.install(model, _unwritten(report), object_args="dispatch"), \
            pytest.raises(AttributeError):
        _generate(model)


def _assert_over_the_limit_unfolded(model: nn.Module, report: ctxreplay.CaptureReport,
                                    eager: torch.Tensor) -> None:
    """Where exported programs check no size guards (torch 2.7), sizes are not
    folded: each cache length is a variant of its own, past the default
    limit -- not ok, naming why nothing folded and the growing dims -- and
    install serves the captured calls and runs the rest eagerly."""
    assert not report.ok
    [problem] = report.problems
    assert problem.reason == "variant_limit" and problem.variants > (problem.limit or 0)
    assert any(n.startswith("fold:off:size_guards=False") for n in problem.names)
    assert any(n.startswith("dim:kwargs['cache']") for n in problem.names), problem.names
    got, stats = _installed_generate(model, report, "dispatch")
    assert torch.equal(got, eager), (got.tolist(), eager.tolist())
    assert stats.total_hits == sum(c.calls for c in report.captures) > 0
    assert set(stats.reasons) == {"signature"}


def _unwritten(report: ctxreplay.CaptureReport) -> list[ctxreplay.Capture]:
    """The captures as a dispatcher that does not write assignments back uses them."""
    return [attrs.evolve(c, assigned=None) for c in report.captures]


_FRESH = real_models.QWEN2_FRESH + textwrap.dedent("""
    def generate():
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.inference_mode():
            return model.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)
    eager = generate()
    out = {}
    for policy in ("eager", "dispatch"):
        with ctxreplay.install(model, ctxreplay.load(sys.argv[1]), object_args=policy) as h:
            out[policy] = generate().tolist()
            out[policy + "_hits"] = h.stats().total_hits
            out[policy + "_unusable"] = sorted(set(h.stats().unusable.values()))
    out["eager"] = eager.tolist()
    print(json.dumps(out))
""")


@pytest.mark.models
def test_qwen2_dynamic_cache_generate_saved_loaded_installed_in_a_fresh_process(
        tmp_path: Path) -> None:
    model = _qwen2()
    eager = _generate(model).tolist()
    _captured(model).save_all(tmp_path / "caps")
    proc = subprocess.run([sys.executable, "-c", _FRESH, str(tmp_path / "caps")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["eager"] == eager  # the fresh process built the same model
    assert out["eager_hits"] == out["dispatch_hits"] == 0
    # refused for what the forward does to the cache, named as such
    assert out["eager_unusable"] == out["dispatch_unusable"] == ["mutates_argument"]
    assert out["eager"] == out["dispatch"] == eager


def _cache_tensors(result: Any) -> list[torch.Tensor]:
    cache = result.past_key_values
    return [t for layer in cache.layers for t in (layer.keys, layer.values)]


@pytest.mark.models
def test_qwen2_static_cache_generate_dispatches_decode_and_updates_the_live_cache() -> None:
    model = _qwen2()
    static = {"cache_implementation": "static", "return_dict_in_generate": True}
    eager = _generate(model, **static)
    report = _captured(model, generate=static)
    # the prefill calls initialise the lazily made cache (its tensors
    # assigned: the program returns them); the decode steps update its
    # tensors in place: both reproduced
    prefill = [c for c in report.captures if c.assigned is not None]
    decode = [c for c in report.captures if c not in prefill]
    assert prefill and decode and report.ok, report.problems
    assert sum(c.calls for c in decode) == 2 * (_GEN["max_new_tokens"] - 1)
    got, stats = _installed_generate(model, report, "dispatch", **static)
    assert stats.total_hits == sum(c.calls for c in report.captures)
    assert not stats.reasons
    assert torch.equal(got.sequences, eager.sequences)
    for live, want in zip(_cache_tensors(got), _cache_tensors(eager), strict=True):
        assert torch.equal(live, want)
    # the control: the prefill programs dispatched by a dispatcher that
    # does not take their assignments off the outputs cannot run generate()
    with ctxreplay.install(model, _unwritten(report), object_args="dispatch"), \
            pytest.raises(AttributeError):
        _generate(model, **static)


class Counted:
    def __init__(self) -> None:
        self.bias = torch.ones(4)
        self.calls = 0


class Counts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, state: Counted) -> torch.Tensor:
        state.calls += 1  # a Python-level change of the argument: no graph op
        out: torch.Tensor = self.lin(x) + state.bias
        return out


@pytest.mark.parametrize("backend", [ExportBackend(strict=True), "dynamo"],
                         ids=["strict_export", "dynamo"])
def test_a_change_dynamo_traces_past_is_seen_by_a_watched_run(backend: Any) -> None:
    # Strict export and the dynamo backend trace the forward with Dynamo,
    # not by running it in Python, so the trace's own walk of the
    # arguments sees nothing; at verify="signature" nothing else runs.  The
    # member's forward then runs once on fresh inputs, its arguments
    # watched: the change is named and the capture is not ok.
    torch.manual_seed(0)
    model = Counts()
    x = torch.rand(2, 4)
    with ctxreplay.capture_with(model, backend=backend,
                                verify="signature") as session, torch.no_grad():
        model(x, Counted())
    report = session.finalize()
    assert not report.ok
    if not report.captures:
        # Dynamo of torch 2.7-2.11 cannot trace this forward ("Unsupported
        # method call"): nothing is captured, and the report says so
        assert [(f.backend, f.reason) for f in report.failures] == [
            (report.failures[0].backend, "unsupported_graph")]
        return
    [m] = _argument_mismatches(report)
    assert (m.path, m.live) == ("args[1].calls", "Counted.calls: assigned (new int)")
    if not isinstance(report.captures[0].artifact, torch.export.ExportedProgram):
        return  # dynamo's graph module: install never dispatches it
    with ctxreplay.install(model, report) as handle, torch.no_grad():
        live = Counted()
        model(x, live)
        assert handle.stats().reasons == {"mutates_argument": 1}
    assert live.calls == 1  # eager ran


def test_a_forward_given_only_tensors_is_not_run_again_at_signature() -> None:
    # the watched run is only for calls whose inputs hold something the
    # forward could change in Python
    runs: list[int] = []

    class Plain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.lin(x) + y
            return out

    torch.manual_seed(0)
    model = Plain()
    model.register_forward_pre_hook(lambda m, a: runs.append(1) and None)
    x = torch.rand(2, 4)
    with ctxreplay.capture_with(model, backend="dynamo",
                                verify="signature") as session, torch.no_grad():
        model(x, x)
    live_runs = len(runs)
    report = session.finalize()
    assert report.ok, report.problems
    assert report.captures[0].fidelity.checked == ("signature",)
    assert live_runs == 1 and len(runs) == 1


class KeepsAverage(nn.Module):
    """Updates a parameter in place (an average kept as a frozen Parameter)
    and reads a list argument."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.avg = nn.Parameter(torch.zeros(4), requires_grad=False)

    def forward(self, x: torch.Tensor, extra: list[torch.Tensor]) -> torch.Tensor:
        self.avg.mul_(0.5).add_(x.mean(0))
        out: torch.Tensor = self.lin(x) + self.avg + extra[0]
        return out


def test_the_run_watching_arguments_leaves_the_live_weights_alone() -> None:
    torch.manual_seed(0)
    model = KeepsAverage().eval()
    with ctxreplay.capture_with(model, backend=ExportBackend(strict=True),
                                verify="signature") as session, torch.no_grad():
        model(torch.ones(2, 4), [torch.zeros(4)])
    live = model.avg.detach().clone()
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    report = session.finalize()
    # the watched run happened (its inputs hold a list) -- where Dynamo can
    # trace the forward (torch 2.7 and 2.9 cannot: a failure says so)
    assert report.captures or [f.reason for f in report.failures] == ["unsupported_graph"]
    assert torch.equal(model.avg.detach(), live)
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
