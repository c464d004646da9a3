"""``ctxreplay compile DIR``: each saved capture compiled ahead of time,
checked against its uncompiled program, recorded in the manifest -- and a
fresh process that installs the directory runs the compiled programs and
compiles nothing.

The directory is made once per module, in a fresh process
(``compiled_dirs.make_compiled``: a folded capture of two repeated blocks
under CPU bfloat16 autocast; AOTInductor takes ~10 s a capture here).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from compiled_dirs import FOLDS, call_sizes, make_compiled, run_fresh
from metadata_check import assert_metadata_only

import ctxreplay
from ctxreplay.compiling import TOLERANCES, compile_dir
from ctxreplay.specs.signature import TensorSpec


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    directory = tmp_path_factory.mktemp("aot") / "captures"
    return directory, make_compiled(directory)


def test_compile_records_the_program_its_check_and_what_it_depends_on(
        compiled: tuple[Path, str]) -> None:
    directory, _ = compiled
    (cap,) = ctxreplay.load(directory).captures
    rec = cap.compiled
    assert rec is not None and rec.ok and rec.reason is None
    assert (directory / rec.package).is_file() and rec.package.endswith(".aoti.pt2")
    assert rec.state == ("norm.weight", "norm.bias", "mlp.0.weight", "mlp.0.bias",
                         "mlp.2.weight", "mlp.2.bias")
    if FOLDS:  # the fold compiled with its dynamic dim, checked at its example size and both ends
        (dim,) = rec.dynamic
        assert dim.startswith("args[0][1] = ") and dim.endswith(" in [5, 9])")
        assert len(rec.checked) == 3 and set(rec.checked) == {"4x5x32", "4x7x32", "4x9x32"}
    else:  # a fixed-size capture, checked at its size
        assert rec.dynamic == () and rec.checked == ("4x7x32",)
    (out,) = rec.outputs
    assert out.dtype == "bfloat16" and out.tolerance == TOLERANCES[torch.bfloat16]
    assert 0.0 <= out.error <= out.tolerance
    assert rec.environment["torch"] == str(torch.__version__)
    assert rec.environment["cpu_isa"] == torch.backends.cpu.get_cpu_capability()
    assert rec.environment["device"] == "cpu" and rec.compiler



def test_the_record_is_metadata_only(compiled: tuple[Path, str]) -> None:
    directory, _ = compiled
    (cap,) = ctxreplay.load(directory).captures
    assert cap.compiled is not None
    assert_metadata_only(cap.compiled.to_json())


_FRESH = '''
import json, os, sys
from pathlib import Path
import ctxreplay
from torch._dynamo.utils import counters

model = build()
handle = ctxreplay.install(model, ctxreplay.load(sys.argv[1]))
xs = [torch.rand(4, n, 32, generator=torch.Generator().manual_seed(i))
      for i, n in enumerate(json.loads(sys.argv[2]))]
with torch.autocast("cpu", dtype=torch.bfloat16), torch.inference_mode():
    got = [model(x) for x in xs]
stats = handle.stats()
handle.remove()
with torch.autocast("cpu", dtype=torch.bfloat16), torch.inference_mode():
    want = [model(x) for x in xs]
cache = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
print(json.dumps({
    "errors": [float((g.float() - w.float()).abs().max() / w.float().abs().max())
               for g, w in zip(got, want)],
    "exact": all(torch.equal(g, w) for g, w in zip(got, want)),
    "hits": stats.hits, "misses": stats.total_misses, "compiled": list(stats.compiled),
    "uncompiled": stats.uncompiled, "frames": sum(counters["frames"].values()),
    "inductor": sum(counters["inductor"].values()),
    "cache_files": [str(p) for p in cache.rglob("*") if p.is_file()],
}))
'''


def test_a_fresh_process_runs_the_compiled_programs_and_compiles_nothing(
        compiled: tuple[Path, str], tmp_path: Path) -> None:
    directory, _ = compiled
    (cap,) = ctxreplay.load(directory).captures
    cache, tmp = tmp_path / "inductor-cache", tmp_path / "tmp"
    cache.mkdir()
    tmp.mkdir()
    got = run_fresh(_FRESH, str(directory), json.dumps(call_sizes(5, 6, 8, 9)),
                    TORCHINDUCTOR_CACHE_DIR=str(cache), TMPDIR=str(tmp))
    # every block call, at every size of the fold, served by the compiled program
    assert got["hits"] == {cap.label: 8} and got["misses"] == 0
    assert got["compiled"] == [f"{cap.label}@blocks.0", f"{cap.label}@blocks.1"]
    assert got["uncompiled"] == {}
    assert max(got["errors"]) <= TOLERANCES[torch.bfloat16]
    # nothing compiled at run time: no Dynamo frame, no Inductor work, no cache entry
    assert got["frames"] == 0 and got["inductor"] == 0 and got["cache_files"] == []


def test_compiling_again_keeps_what_is_compiled(compiled: tuple[Path, str]) -> None:
    directory, _ = compiled
    (before,) = ctxreplay.load(directory).captures
    done = compile_dir(directory)  # nothing to compile: no Inductor runs in this process
    (after,) = ctxreplay.load(directory).captures
    assert done.compiled == (before.label,) and not done.failed and not done.skipped
    assert after.compiled == before.compiled


def test_compile_dir_refuses_a_directory_without_a_manifest(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"holds no manifest\.json; give a directory written "
                       r"by report\.save_all"):
        compile_dir(tmp_path)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_capture_compiles_and_serves_compiled(tmp_path: Path) -> None:
    directory = tmp_path / "captures"
    make_compiled(directory, device="cuda")
    (cap,) = ctxreplay.load(directory).captures
    assert cap.compiled is not None and cap.compiled.ok
    assert cap.compiled.environment["device"] == "cuda"
    assert cap.compiled.environment["capability"] is not None
    got = run_fresh(_FRESH.replace("model = build()", "model = build().cuda()").replace(
        "torch.rand(4, n, 32, generator=torch.Generator().manual_seed(n))",
        "torch.rand(4, n, 32, generator=torch.Generator().manual_seed(n)).cuda()").replace(
        '"cpu", dtype', '"cuda", dtype'), str(directory),
        TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"))
    assert got["hits"] == {cap.label: 8} and got["uncompiled"] == {}
    assert len(got["compiled"]) == 2 and max(got["errors"]) <= TOLERANCES[torch.bfloat16]


class _Norm(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bn = torch.nn.BatchNorm1d(8)
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.bn(x))


def _norms() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(_Norm(), _Norm()).train(True)


def _saved(tmp_path: Path, *, grad: bool, verify: str = "execute") -> Path:
    model = _norms()
    with ctxreplay.capture_with(model, targets="repeated", verify=verify) as session, \
            torch.set_grad_enabled(grad):
        model(torch.rand(4, 8))
    session.finalize().save_all(tmp_path / "captures")
    return tmp_path / "captures"


def test_a_program_that_writes_its_buffers_is_checked_on_what_it_writes(
        tmp_path: Path) -> None:
    # BatchNorm in train mode updates its running stats in place: the compiled
    # program must write the same values into the member's buffers
    directory = _saved(tmp_path, grad=False)
    done = compile_dir(directory)
    (cap,) = ctxreplay.load(directory).captures
    assert done.compiled == (cap.label,) and cap.compiled is not None and cap.compiled.ok
    written = {cap.compiled.state[o.index] for o in cap.compiled.outputs if o.of == "state"}
    assert written == {"bn.running_mean", "bn.running_var", "bn.num_batches_tracked"}
    model, twin = _norms(), _norms()
    x = torch.rand(4, 8)
    with ctxreplay.install(model, ctxreplay.load(directory)) as handle, torch.no_grad():
        got = model(x)
        assert len(handle.stats().compiled) == 2 and handle.stats().total_misses == 0
    with torch.no_grad():
        want = twin(x)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    for a, b in zip(model.buffers(), twin.buffers()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert int(model[1].bn.num_batches_tracked) == 1


def test_calls_autograd_records_run_uncompiled_and_say_so(tmp_path: Path) -> None:
    directory = _saved(tmp_path, grad=True)
    done = compile_dir(directory)
    assert done.compiled and not done.failed and not done.skipped
    model, twin = _norms(), _norms()
    x = torch.rand(4, 8)
    with ctxreplay.install(model, ctxreplay.load(directory)) as handle:
        got = model(x)  # grad mode, weights that require grad: the uncompiled program
        stats = handle.stats()
    assert got.grad_fn is not None and stats.total_misses == 0
    assert set(stats.uncompiled.values()) == {"compiled_autograd"}
    torch.testing.assert_close(got, twin(x), rtol=0, atol=0)


def test_a_capture_that_is_not_ok_is_not_compiled(tmp_path: Path) -> None:
    directory = _saved(tmp_path, grad=False, verify="off")
    done = compile_dir(directory)
    assert list(done.skipped.values()) == [
        "its capture is not ok (fidelity unchecked): install never runs it"]


_FIXED = '''
import json, sys
import ctxreplay

model = build()
handle = ctxreplay.install(model, ctxreplay.load(sys.argv[1]))
x = torch.rand(4, 7, 32, generator=torch.Generator().manual_seed(7))
with torch.autocast("cpu", dtype=torch.bfloat16), torch.inference_mode():
    got = model(x)
stats = handle.stats()
handle.remove()
read = "torch._export.serde.serialize" in sys.modules
with torch.autocast("cpu", dtype=torch.bfloat16), torch.inference_mode():
    want = model(x)
print(json.dumps({
    "read": read, "compiled": list(stats.compiled), "hits": stats.total_hits,
    "uncompiled": stats.uncompiled,
    "error": float((got.float() - want.float()).abs().max() / want.float().abs().max()),
}))
'''


def test_a_fixed_size_capture_runs_compiled_without_reading_its_program(
        tmp_path: Path) -> None:
    directory = tmp_path / "captures"
    make_compiled(directory, sizes="7")
    (cap,) = ctxreplay.load(directory).captures
    assert cap.folding is None and cap.compiled is not None and cap.compiled.specs is not None
    got = run_fresh(_FIXED, str(directory))
    # served compiled with no .pt2 read: torch's deserialiser is never imported
    # (the uncompiled program is read only if a call needs it: one autograd records)
    assert got["read"] is False and got["hits"] == 2 and got["uncompiled"] == {}
    assert got["compiled"] == [f"{cap.label}@blocks.0", f"{cap.label}@blocks.1"]
    assert got["error"] <= TOLERANCES[torch.bfloat16]


_BLOCKS = '''
import json, sys
import ctxreplay

model = build()
handle = ctxreplay.install(model, ctxreplay.load(sys.argv[1]))
xs = [torch.rand(4, n, 32, generator=torch.Generator().manual_seed(n))
      for n in json.loads(sys.argv[2])]

def blocks():
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.inference_mode():
        return [b(x) for x in xs for b in model.blocks]

got = blocks()
stats = handle.stats()
handle.remove()
want = blocks()
print(json.dumps({
    "got": [str(g.dtype) for g in got], "want": [str(w.dtype) for w in want],
    "errors": [float((g.float() - w.float()).abs().max() / w.float().abs().max())
               for g, w in zip(got, want)],
    "hits": stats.total_hits, "misses": stats.total_misses, "compiled": list(stats.compiled),
    "uncompiled": stats.uncompiled,
}))
'''


def test_autocast_replayed_around_the_trace_is_compiled_into_the_package(
        tmp_path: Path) -> None:
    # replay="ambient": the capture's graph holds no casts, autocast is a need
    # around it; the package must compute in bfloat16 as the capture does
    # (one size: such captures are not folded)
    directory = tmp_path / "captures"
    make_compiled(directory, sizes="7", replay="ambient")
    (cap,) = ctxreplay.load(directory).captures
    assert "autocast" in cap.ambient_only and cap.fidelity == "ok_with_needs"
    assert cap.compiled is not None and cap.compiled.ok, cap.compiled
    assert [o.dtype for o in cap.compiled.outputs] == ["bfloat16"]
    got = run_fresh(_BLOCKS, str(directory), json.dumps([7, 7, 7]))
    # every block call served compiled, in the dtype eager and the live call returned
    assert got["hits"] == 6 and got["misses"] == 0 and got["uncompiled"] == {}
    assert got["compiled"] == [f"{cap.label}@blocks.0", f"{cap.label}@blocks.1"]
    live = cap.outputs()
    assert isinstance(live, TensorSpec) and live.dtype == torch.bfloat16
    assert got["got"] == got["want"] == ["torch.bfloat16"] * 6
    assert max(got["errors"]) <= TOLERANCES[torch.bfloat16]


_UNCOMPILED_CALLS = '''
import json, sys
import ctxreplay

model, twin = build(), build()
handle = ctxreplay.install(model, ctxreplay.load(sys.argv[1]))

def g(seed):
    return torch.Generator().manual_seed(seed)

calls = {"48 tokens": torch.rand(4, 48, 32, generator=g(1)),
         "float64": torch.rand(4, 7, 32, generator=g(2), dtype=torch.float64)}

def run(m, x):
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.inference_mode():
        try:
            return m(x)
        except RuntimeError as exc:  # what eager does too, compared below
            return f"{type(exc).__name__}: {exc}"

def both(name, x):
    got, want = run(model, x), run(twin, x)
    return {"got": got if isinstance(got, str) else str(got.dtype),
            "same": got == want if isinstance(want, str) else
            isinstance(got, torch.Tensor) and torch.equal(got, want),
            "reasons": dict(handle.stats().reasons)}

out = {name: both(name, x) for name, x in calls.items()}
for m in (model, twin):
    m.double()
out["float64 model"] = both("float64 model", calls["float64"])
stats = handle.stats()
out["hits"], out["misses"] = stats.total_hits, stats.misses
print(json.dumps(out))
'''


def test_calls_the_package_was_not_compiled_for_run_eagerly(
        compiled: tuple[Path, str]) -> None:
    # a token count beyond the sizes compiled and a float64 input: no capture's
    # signature, so each call runs eagerly, counted, and does what eager does
    directory, _ = compiled
    got = run_fresh(_UNCOMPILED_CALLS, str(directory))
    tokens, f64, f64_model = got["48 tokens"], got["float64"], got["float64 model"]
    assert tokens["same"] and tokens["got"] == "torch.float32"
    assert tokens["reasons"] == {"signature": 2}  # both blocks
    # CPU autocast leaves float64 uncast: eager's own LayerNorm refuses float32
    # weights beside a float64 input, and the installed model raises just that
    assert f64["same"] and f64["got"].startswith("RuntimeError: mixed dtype (CPU)")
    assert f64["reasons"] == {"signature": 3}
    # a float64 model takes it: eager's values, exactly
    assert f64_model["same"] and f64_model["got"] == "torch.float64"
    assert f64_model["reasons"] == {"signature": 5}
    assert got["hits"] == 0 and got["misses"] == {"blocks.0": 3, "blocks.1": 2}
