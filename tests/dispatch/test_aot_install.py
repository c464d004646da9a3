"""``install`` of a directory ``ctxreplay compile`` compiled: the compiled
programs serve where the environment they were compiled for holds, and the
uncompiled capture runs -- with its reason in ``stats().uncompiled`` --
where it does not, where the check failed or the package is gone.  Every
guarantee of install holds on the compiled path: the member's own weights
(inputs of the compiled program, read on every call), the size guard,
``.to()`` falling back, ``remove()``.

The oracle is eager (the same model after ``remove()``): the uncompiled
program is bit-identical to it, the compiled one within bfloat16's
tolerance -- so a test that sees ``torch.equal`` also knows the compiled
program did not run.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from compiled_dirs import FOLDS, build_model, call_sizes, make_compiled, set_compiled_field

import ctxreplay
from ctxreplay.compiling import TOLERANCES

TOL = TOLERANCES[torch.bfloat16]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("aot") / "captures"
    make_compiled(directory)
    return directory


@pytest.fixture()
def copy(compiled: Path, tmp_path: Path) -> Path:
    """A copy of the compiled directory, to change."""
    return Path(shutil.copytree(compiled, tmp_path / "captures"))


def _run(model: Any, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.inference_mode():
        return [model(x) for x in xs]


def _installed(directory: Path, xs: list[torch.Tensor]
               ) -> tuple[list[torch.Tensor], list[torch.Tensor], ctxreplay.DispatchStats]:
    """Outputs installed and eager, and the stats."""
    model = build_model()
    with ctxreplay.install(model, ctxreplay.load(directory)) as handle:
        got = _run(model, xs)
        stats = handle.stats()
    return got, _run(model, xs), stats


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


XS = [torch.rand(4, n, 32, generator=torch.Generator().manual_seed(i))
      for i, n in enumerate(call_sizes(5, 8))]


def test_the_compiled_programs_serve_every_member(compiled: Path) -> None:
    got, want, stats = _installed(compiled, XS)
    (label,) = stats.hits
    assert stats.hits == {label: 4} and stats.total_misses == 0
    assert stats.compiled == (f"{label}@blocks.0", f"{label}@blocks.1")
    assert stats.uncompiled == {}
    assert all(_err(g, w) <= TOL for g, w in zip(got, want))


@pytest.mark.parametrize(("field", "value", "reason"), [
    ("environment.cpu_isa", "NO_SUCH_ISA", "compiled_environment"),
    ("environment.torch", "0.0.1", "compiled_environment"),
    ("environment.device", "cuda", "compiled_environment"),
    ("ok", False, "compiled_failed"),
    ("fingerprint", "another capture's", "compiled_mismatch"),
])
def test_a_record_that_does_not_hold_here_runs_the_uncompiled_capture(
        copy: Path, field: str, value: Any, reason: str) -> None:
    set_compiled_field(copy, field, value)
    got, want, stats = _installed(copy, XS)
    (label,) = stats.hits
    assert stats.uncompiled == {label: reason}
    assert stats.compiled == () and stats.hits == {label: 4} and stats.total_misses == 0
    # the uncompiled program: bit-identical to eager (the compiled one is not)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_the_reason_is_logged_in_words(copy: Path, caplog: pytest.LogCaptureFixture) -> None:
    set_compiled_field(copy, "environment.cpu_isa", "NO_SUCH_ISA")
    with caplog.at_level("WARNING", logger="ctxreplay"):
        _installed(copy, XS[:1])
    assert "compiled for cpu_isa 'NO_SUCH_ISA', this process has" in caplog.text
    assert "runs its uncompiled program" in caplog.text


def test_a_missing_package_runs_the_uncompiled_capture(copy: Path) -> None:
    for package in copy.glob("*.aoti.pt2"):
        package.unlink()
    _, _, stats = _installed(copy, XS[:1])
    assert list(stats.uncompiled.values()) == ["compiled_missing"] and stats.compiled == ()


def test_the_compiled_program_takes_the_member_weights_live(compiled: Path) -> None:
    model = build_model()
    twin = build_model()
    with ctxreplay.install(model, ctxreplay.load(compiled)) as handle:
        _run(model, XS[:1])
        with torch.no_grad():
            for m in (model, twin):  # an update in place: an optimizer step
                m.blocks[1].mlp[0].weight.mul_(-2.0)
        got = _run(model, XS)
        assert handle.stats().total_misses == 0 and handle.stats().compiled
    want = _run(twin, XS)
    assert all(_err(g, w) <= TOL for g, w in zip(got, want))
    # the weights changed the output: the program did not keep the old ones
    assert _err(got[0], _run(build_model(), XS[:1])[0]) > 10 * TOL


def test_a_replaced_weight_is_bound_again(compiled: Path) -> None:
    model = build_model()
    twin = build_model()
    with ctxreplay.install(model, ctxreplay.load(compiled)) as handle:
        _run(model, XS[:1])
        new = torch.nn.Parameter(torch.randn(64, 32, generator=torch.Generator().manual_seed(1)))
        model.blocks[0].mlp[0].weight = new
        twin.blocks[0].mlp[0].weight = torch.nn.Parameter(new.detach().clone())
        got = _run(model, XS)
        stats = handle.stats()
    assert stats.total_misses == 0 and len(stats.compiled) == 2
    assert all(_err(g, w) <= TOL for g, w in zip(got, _run(twin, XS)))


def test_a_weight_laid_out_anew_after_binding_runs_eagerly(compiled: Path) -> None:
    # the same shape, dtype and device, but a transposed layout: the compiled
    # code reads a weight with the strides it was built with, so the call
    # runs eagerly (reason "weights") and equals the eager twin's
    model = build_model()
    twin = build_model()
    with ctxreplay.install(model, ctxreplay.load(compiled)) as handle:
        _run(model, XS[:1])
        with torch.no_grad():
            for m in (model, twin):
                lin = m.blocks[0].mlp[0]
                lin.weight.data = lin.weight.data.t().contiguous().t().mul(-1.0)
        assert not model.blocks[0].mlp[0].weight.is_contiguous()
        got = _run(model, XS[:1])
        stats = handle.stats()
    assert stats.reasons == {"weights": 1}, stats.reasons
    assert _err(got[0], _run(twin, XS[:1])[0]) <= TOL


def test_sizes_outside_the_fold_and_a_converted_model_run_eagerly(compiled: Path) -> None:
    model = build_model()
    with ctxreplay.install(model, ctxreplay.load(compiled)) as handle:
        _run(model, XS[:1])
        _run(model, [torch.rand(4, 12, 32)])  # beyond the range it was compiled over
        assert handle.stats().reasons == {"signature": 2}
        # converted in place: the compiled program takes float32 weights
        model.blocks[0].mlp.to(torch.bfloat16)
        _run(model, XS[:1])
        stats = handle.stats()
    assert stats.reasons == {"signature": 2, "weights": 1} and stats.total_hits == 3
    assert stats.misses == {"blocks.0": 2, "blocks.1": 1}


def test_a_call_autograd_would_record_runs_the_uncompiled_function(compiled: Path) -> None:
    from ctxreplay.dispatch.aot import compiled_flat
    from ctxreplay.dispatch.flat import Flat, flatten

    (cap,) = ctxreplay.load(compiled).captures
    assert cap.compiled is not None
    flat = flatten(cap.program, keep_guards=True)
    assert isinstance(flat, Flat)
    made = compiled_flat(flat, cap.program, cap.compiled, compiled, guarded=True)
    assert isinstance(made, Flat)
    own = cap.program.state_dict
    state = [own[n].detach().requires_grad_(True) for n in flat.state_names]
    x = torch.rand(4, call_sizes(6)[0], 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (recorded,) = made.fn(*state, x)  # grad mode on: the compiled program computes none
        with torch.no_grad():
            (served,) = made.fn(*state, x)
    assert recorded.requires_grad and recorded.grad_fn is not None
    assert not served.requires_grad
    if FOLDS:  # the size guard still runs (a fold's; a fixed-size program has none)
        with pytest.raises(AssertionError, match="Guard failed"), torch.no_grad():
            made.fn(*state, torch.rand(4, 6, 16))


def test_hooks_keep_their_meaning_on_the_compiled_path(compiled: Path) -> None:
    model = build_model()
    seen: list[str] = []
    own = model.blocks[1].register_forward_hook(lambda *_: seen.append("member"))
    inner = model.blocks[0].mlp.register_forward_hook(lambda *_: seen.append("inner"))
    with ctxreplay.install(model, ctxreplay.load(compiled)) as handle:
        _run(model, XS[:1])
        stats = handle.stats()
    own.remove()
    inner.remove()
    # a hook inside a member: the graph would skip it, so that member runs eagerly;
    # the member's own hook runs around its compiled program
    assert seen == ["inner", "member"]
    assert stats.reasons == {"hooks": 1} and stats.total_hits == 1
    assert stats.compiled == (f"{next(iter(stats.hits))}@blocks.1",)

