"""The persistent capture cache: what hits, what misses, and that a hit is
what a trace would have given.

The oracle is the test's own: forward hooks registered before the session
record every live call (``trust_oracle.record``), and each call is replayed
through the capture that claims it with that member's own weights
(``trust_oracle.unreproduced``) -- whether the capture was traced or loaded
from the cache.  Each "miss" test also shows that the entry it must not hit
would have been wrong for the changed model.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import trust_oracle
from capability import FOLDS
from metadata_check import assert_metadata_only
from torch import nn

import ctxreplay
from ctxreplay.cache.store import CacheDir, CacheWarning

SHAPES = ((2, 4, 8), (2, 6, 8), (1, 5, 8))
#: the captures (and cache entries) SHAPES makes: rows 4 and 6 folded into one
#: graph, and the batch-1 call on its own (a size of 1 is traced apart); where
#: ctxreplay does not fold (torch 2.7), one per shape
CAPTURES = 2 if FOLDS else 3
#: what each capture folds in beside its own call
FOLDED = [1, 0] if FOLDS else [0, 0, 0]


class Block(nn.Module):
    def __init__(self, dim: int = 8, hidden: int = 16, scale: float = 2.0) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x))) * self.scale


class Stack(nn.Module):
    def __init__(self, depth: int = 2, block: type[nn.Module] = Block, **kw: Any) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([block(**kw) for _ in range(depth)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def run(model: nn.Module, cache: Any, *, shapes: tuple[tuple[int, ...], ...] = SHAPES,
        dtype: torch.dtype = torch.bfloat16, verify: str = "signature",
        **kw: Any) -> tuple[ctxreplay.CaptureReport, list[trust_oracle.Call]]:
    """One live forward per shape under CPU autocast, then ``finalize()``;
    the oracle's record of every block call."""
    kw.setdefault("backend", "export")
    members = trust_oracle.members_of(model, "blocks")
    with trust_oracle.record(model, members) as calls:
        session = ctxreplay.capture_with(model, targets="repeated", verify=verify,
                                         cache=cache, **kw)
        with session, torch.no_grad(), torch.autocast("cpu", dtype=dtype):
            for shape in shapes:
                model(torch.rand(shape))
        report = session.finalize()
    return report, calls


def _first_shape(report: ctxreplay.CaptureReport) -> torch.Size:
    """The input shape of the report's first capture."""
    spec = next(iter(report.captures[0].signature.leaves()))[1]
    return torch.Size(spec.shape)


def entries(root: Path) -> list[str]:
    return [key for key, _, _ in CacheDir(root).entries()]


def cached(report: ctxreplay.CaptureReport) -> list[bool]:
    return [c.from_cache for c in report.captures]


@pytest.fixture
def quiet() -> Iterator[list[warnings.WarningMessage]]:
    """Every warning raised inside, recorded (``always``: none deduplicated)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        yield seen


def cache_warnings(seen: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in seen if issubclass(w.category, CacheWarning)]


# -- hits -----------------------------------------------------------------------------

@pytest.mark.parametrize("verify", ["signature", "execute"])
def test_unchanged_model_hits_every_variant(tmp_path: Path, verify: str) -> None:
    torch.manual_seed(0)
    first, calls = run(Stack(), tmp_path, verify=verify)
    # rows 4 and 6 fold into one graph; the batch-1 call stays apart (size 1)
    n = len(first.captures)
    assert n == CAPTURES and [len(c.folded) for c in first.captures] == FOLDED
    assert first.ok and cached(first) == [False] * n
    assert len(entries(tmp_path)) == n
    assert trust_oracle.unreproduced(first, calls) == []

    torch.manual_seed(1)  # other weights: the cache holds none, so they must not matter
    model = Stack()
    second, calls = run(model, tmp_path, verify=verify)
    assert second.ok and cached(second) == [True] * n
    assert [c.folding for c in second.captures] == [c.folding for c in first.captures]
    assert second.cache == {"directory": str(tmp_path), "from_cache": n, "traced": 0,
                            "not_stored": {}}
    assert second.cache_summary is not None and f"{n} of {n}" in second.cache_summary
    if verify == "signature":  # a hit keeps no program in memory until it is used
        assert not any(c.artifact_loaded for c in second.captures)
    # the loaded programs reproduce every call of the second model, with its weights
    assert trust_oracle.unreproduced(second, calls) == []
    held = second.captures[0].artifact.state_dict
    assert held["up.weight"] is model.blocks[0].up.weight
    assert_metadata_only(second.to_json())


def test_weights_are_never_stored(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Stack(dim=64, hidden=512)
    report, _ = run(model, tmp_path, shapes=((1, 3, 64),))
    assert report.ok
    weight_bytes = sum(p.numel() * p.element_size() for p in model.blocks[0].parameters())
    stored = sum(f.stat().st_size for f in tmp_path.rglob("*") if f.is_file())
    assert weight_bytes > 250_000 and stored < weight_bytes / 4, (stored, weight_bytes)
    for path in tmp_path.rglob("record.json"):
        assert_metadata_only(json.loads(path.read_text()))


# -- misses ---------------------------------------------------------------------------

CHANGES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    # (model kwargs, run kwargs) of the changed second run
    "parameter shape": ({"hidden": 24}, {}),
    "plain attribute": ({"scale": 3.0}, {}),
    "snapshot": ({}, {"dtype": torch.float16}),
    "backend": ({}, {"backend": "auto"}),
    "replay mode": ({}, {"replay": "ambient"}),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_what_can_change_the_graph_misses(tmp_path: Path, change: str) -> None:
    model_kw, run_kw = CHANGES[change]
    torch.manual_seed(0)
    first, _ = run(Stack(), tmp_path)
    n = len(first.captures)  # a fold and the batch-1 call
    assert first.ok and len(entries(tmp_path)) == n
    torch.manual_seed(0)
    second, calls = run(Stack(**model_kw), tmp_path, **run_kw)
    assert second.ok and cached(second) == [False] * len(second.captures)
    assert len(entries(tmp_path)) == 2 * n  # stored beside, nothing overwritten
    assert trust_oracle.unreproduced(second, calls) == []
    if change in ("plain attribute", "snapshot"):
        # what a key without it would have hit: the first run's capture, wrong here
        wrong = [trust_oracle.replay_failure(first.captures[0], c) for c in calls
                 if c.leaves()[0].shape == _first_shape(first)]
        assert wrong and all(w is not None for w in wrong)


def test_another_torch_version_misses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    run(Stack(), tmp_path)
    monkeypatch.setattr(torch, "__version__", "2.99.0+other")
    second, calls = run(Stack(), tmp_path)
    assert second.ok and cached(second) == [False] * CAPTURES
    assert trust_oracle.unreproduced(second, calls) == []
    monkeypatch.undo()
    third, _ = run(Stack(), tmp_path)
    assert cached(third) == [True] * CAPTURES


BLOCK_SOURCE = '''
import torch
from torch import nn


class EditedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * FACTOR
'''


def _import_block(path: Path, factor: str) -> type[nn.Module]:
    path.write_text(BLOCK_SOURCE.replace("FACTOR", factor))
    spec = importlib.util.spec_from_file_location("ctxreplay_edited_block", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cls: type[nn.Module] = module.EditedBlock
    return cls


def test_a_source_edit_to_the_block_class_misses(tmp_path: Path) -> None:
    source = tmp_path / "edited_block.py"
    cache = tmp_path / "cache"
    torch.manual_seed(0)
    first, _ = run(Stack(block=_import_block(source, "2.0")), cache)
    assert first.ok and not any(cached(first))
    torch.manual_seed(0)  # the same weights, the same class name and attributes
    second, calls = run(Stack(block=_import_block(source, "3.0 + 1.0")), cache)
    assert second.ok and cached(second) and not any(cached(second))
    assert trust_oracle.unreproduced(second, calls) == []
    wrong = [trust_oracle.replay_failure(first.captures[0], c) for c in calls
             if c.leaves()[0].shape == _first_shape(first)]
    assert wrong and all(w is not None for w in wrong)  # what a hit would have given


# -- damaged entries ------------------------------------------------------------------

def _entry_dirs(root: Path) -> list[Path]:
    return sorted(p.parent for p in root.rglob("READY"))


def _rewrite_ready(entry: Path) -> None:
    """Make the checksums match whatever the entry now holds (a deliberate tamper)."""
    program, record = (entry / "program.bin").read_bytes(), (entry / "record.json").read_bytes()
    (entry / "READY").write_text(json.dumps({
        "record": hashlib.sha256(record).hexdigest(),
        "program": hashlib.sha256(program).hexdigest(), "program_bytes": len(program)}))


def test_a_tampered_graph_is_caught_by_execution_and_recaptured(
        tmp_path: Path, quiet: list[warnings.WarningMessage]) -> None:
    honest, other = tmp_path / "honest", tmp_path / "other"
    torch.manual_seed(0)
    run(Stack(), honest, verify="execute")
    torch.manual_seed(0)
    run(Stack(scale=-5.0), other, verify="execute")
    by_inputs = {json.dumps(rec["about"]["inputs"]): key
                 for key, rec, _ in CacheDir(other).entries() if rec}
    for key, rec, _ in CacheDir(honest).entries():
        assert rec is not None
        src = CacheDir(other).entry_path(by_inputs[json.dumps(rec["about"]["inputs"])])
        dst = CacheDir(honest).entry_path(key)
        (dst / "program.bin").write_bytes((src / "program.bin").read_bytes())
        _rewrite_ready(dst)
    torch.manual_seed(0)
    report, calls = run(Stack(), honest, verify="execute")
    assert report.ok and cached(report) == [False] * CAPTURES
    found = cache_warnings(quiet)
    assert len(found) == CAPTURES
    assert all("does not reproduce the live calls" in w for w in found)
    assert trust_oracle.unreproduced(report, calls) == []
    again, _ = run(Stack(), honest, verify="execute")  # recaptured and stored again
    assert cached(again) == [True] * CAPTURES


@pytest.mark.parametrize("damage", ["truncated", "flipped", "no READY"])
def test_a_damaged_entry_is_discarded_with_a_warning(
        tmp_path: Path, damage: str, quiet: list[warnings.WarningMessage]) -> None:
    torch.manual_seed(0)
    run(Stack(), tmp_path)
    entry = _entry_dirs(tmp_path)[0]
    program = entry / "program.bin"
    data = program.read_bytes()
    if damage == "truncated":
        program.write_bytes(data[: len(data) // 2])
    elif damage == "flipped":  # still a well-formed program, of another graph
        assert b"gelu" in data
        program.write_bytes(data.replace(b"gelu", b"relu"))
    else:
        (entry / "READY").unlink()
    report, calls = run(Stack(), tmp_path)
    assert report.ok and sorted(cached(report)) == [False] + [True] * (CAPTURES - 1)
    found = cache_warnings(quiet)
    assert len(found) == 1 and "discarded" in found[0] and entry.name[:16] in found[0]
    assert trust_oracle.unreproduced(report, calls) == []
    assert all(CacheDir(tmp_path).read(k) is not None for k in entries(tmp_path))
    assert len(entries(tmp_path)) == CAPTURES


def test_a_read_only_directory_is_read_and_never_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        quiet: list[warnings.WarningMessage]) -> None:
    torch.manual_seed(0)
    run(Stack(), tmp_path, shapes=SHAPES[:2])
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    real_mkdir = Path.mkdir

    def refuse(self: Path, *args: Any, **kwargs: Any) -> None:
        # a read-only file system, whoever runs the test (root ignores modes)
        if str(self).startswith(str(tmp_path)):
            raise OSError(30, "Read-only file system", str(self))
        real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", refuse)
    for _ in range(2):
        report, calls = run(Stack(), tmp_path)
        # the first two shapes' captures were stored; the batch-1 one cannot be
        assert report.ok and cached(report) == [True] * (CAPTURES - 1) + [False]
        assert trust_oracle.unreproduced(report, calls) == []
    found = cache_warnings(quiet)
    assert len(found) == 1 and "cannot be written" in found[0]
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before


# -- two processes at once ------------------------------------------------------------

#: the worker's captures: per block (the first's input needs no grad, the
#: second's does) one fold, or one per size where ctxreplay does not fold
WORKER_CAPTURES = 2 if FOLDS else 2 * 3

WORKER = '''
import sys, time, warnings
from pathlib import Path
import torch
from torch import nn
import ctxreplay

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.lin(x)) * 2

root, me = Path(sys.argv[1]), sys.argv[2]
model = nn.Sequential(Block(), Block())
session = ctxreplay.capture_with(model, targets="repeated", backend="export",
                                 cache=str(root / "cache"))
with session, torch.autocast("cpu", dtype=torch.bfloat16):
    for n in range(2, 5):
        model(torch.rand(n, 8))
(root / f"ready-{me}").touch()
deadline = time.time() + 120
while not (root / "go").exists() and time.time() < deadline:
    time.sleep(0.01)
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    report = session.finalize()
print(report.ok, sum(c.from_cache for c in report.captures), len(report.captures), len(seen))
'''


def test_two_processes_fill_one_cache_concurrently(tmp_path: Path) -> None:
    import os
    import subprocess
    import time

    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = [subprocess.Popen([sys.executable, str(script), str(tmp_path), str(i)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    deadline = time.time() + 240
    while not all((tmp_path / f"ready-{i}").exists() for i in range(2)):
        assert time.time() < deadline and all(p.poll() is None for p in procs), \
            [p.communicate() for p in procs if p.poll() is not None]
        time.sleep(0.05)
    (tmp_path / "go").touch()  # both finalize at once
    outs = [p.communicate(timeout=240) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    for out, _ in outs:
        ok, _hits, n, warned = out.split()
        # per block, rows 2, 3 and 4 folded into one graph (or one each, unfolded)
        assert ok == "True" and n == str(WORKER_CAPTURES) and warned == "0", outs
    cache = CacheDir(tmp_path / "cache")
    keys = entries(cache.root)
    assert len(keys) == WORKER_CAPTURES
    for key in keys:  # every entry complete and checksummed
        assert cache.read(key) is not None
    assert not list((cache.root / ".tmp").iterdir())  # no partial write left behind
    third = subprocess.run([sys.executable, str(script), str(tmp_path), "2"], env=env,
                           capture_output=True, text=True, timeout=240)
    assert third.returncode == 0, third.stderr
    assert third.stdout.split() == ["True", *[str(WORKER_CAPTURES)] * 2, "0"]


# -- options, environment, command ----------------------------------------------------

def test_the_environment_variable_and_false(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CTXREPLAY_CACHE", str(tmp_path))
    torch.manual_seed(0)
    run(Stack(), None)
    assert len(entries(tmp_path)) == CAPTURES
    report, _ = run(Stack(), None)
    assert cached(report) == [True] * CAPTURES
    off, _ = run(Stack(), False)
    assert cached(off) == [False] * CAPTURES and off.cache is None


@pytest.mark.parametrize("bad", [True, "", 3])
def test_a_bad_cache_value_names_it_and_the_choices(bad: Any) -> None:
    with pytest.raises(ValueError, match=r"cache: expected a directory path.*False"):
        ctxreplay.capture_with(Stack(), cache=bad)


def test_a_file_is_not_a_cache_directory(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    with pytest.raises(ValueError, match="not a directory"):
        ctxreplay.capture_with(Stack(), cache=tmp_path / "f")


def test_the_cache_command_and_inspect(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                       ) -> None:
    from ctxreplay.cli import main

    torch.manual_seed(0)
    run(Stack(), tmp_path / "c")
    report, _ = run(Stack(), tmp_path / "c")
    report.save(tmp_path / "report.json")
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "report.json")]) == 0
    out = capsys.readouterr().out
    assert out.count("[cache]") == CAPTURES + 1  # a marker per capture, and the legend
    assert f"{CAPTURES} captures loaded from it" in out
    assert main(["cache", "list", str(tmp_path / "c")]) == 0
    out = capsys.readouterr().out
    assert out.count("Block blocks.0#") == CAPTURES and f"{CAPTURES} entries" in out
    assert main(["cache", "size", str(tmp_path / "c")]) == 0
    assert f"{CAPTURES} entries" in capsys.readouterr().out
    assert main(["cache", "clear", str(tmp_path / "c")]) == 0
    assert f"removed {CAPTURES} entries" in capsys.readouterr().out
    assert entries(tmp_path / "c") == []


def test_a_cached_capture_saves_and_dispatches_like_a_traced_one(tmp_path: Path) -> None:
    torch.manual_seed(0)
    run(Stack(), tmp_path / "cache", shapes=SHAPES[:1])
    torch.manual_seed(2)
    model = Stack()
    report, _ = run(model, tmp_path / "cache", shapes=SHAPES[:1])
    assert cached(report) == [True]
    x = torch.rand(SHAPES[0])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(x)
    saved = report.captures[0].save(tmp_path / "c.pt2")  # loads the program, then writes it
    assert saved.fidelity is not None and saved.fidelity.ok
    loaded = ctxreplay.load(tmp_path / "c.pt2")
    assert isinstance(loaded, ctxreplay.LoadedCapture)
    for source in (report, loaded):
        with ctxreplay.install(model, source) as handle, torch.no_grad(), \
                torch.autocast("cpu", dtype=torch.bfloat16):
            got = model(x)
            assert handle.stats().total_misses == 0 and sum(handle.stats().hits.values()) == 2
        assert torch.equal(got, expected)  # each member ran the program with its own weights


# -- what a cache cannot keep ---------------------------------------------------------

LINEAR_JOB = '''
import sys, warnings
import torch
from torch import nn
import ctxreplay
from ctxreplay.cache.store import CacheWarning

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(16, 16), nn.Linear(16, 16)])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x

torch.manual_seed(0)
model = Net().eval()
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    with ctxreplay.capture_with(model, targets="repeated", cache=sys.argv[1]) as session, \\
            torch.no_grad():
        model(torch.rand(2, 16))
        model(torch.rand(5, 16))
    report = session.finalize()
print(report.ok, sum(c.from_cache for c in report.captures), len(report.captures),
      sum(issubclass(w.category, CacheWarning) for w in seen))
'''


def test_linear_blocks_under_no_grad_are_stored_and_loaded_in_a_new_process(
        tmp_path: Path) -> None:
    """``nn.Linear``'s forward argument is named ``input``: the program's
    placeholder of that name was renamed when the empty ``no_grad`` wrapper
    was dropped for serialising, torch's verifier refused the copy, and the
    cache stored nothing, silently."""
    import os
    import subprocess

    script = tmp_path / "job.py"
    script.write_text(LINEAR_JOB)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    outs = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, str(script), str(tmp_path / "cache")],
                              capture_output=True, text=True, env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        outs.append(proc.stdout.split())
    ok, hits, n, warned = outs[0]
    assert ok == "True" and hits == "0" and warned == "0" and int(n) >= 1, outs
    assert len(entries(tmp_path / "cache")) == int(n)
    assert outs[1] == ["True", n, n, "0"], outs  # every capture loaded


#: forward arguments named like a builtin (which torch's graph copy renames) or like
#: the nodes torch generates (``linear``, ``getitem``, ``submod_1``, ``wrap_with_...``)
NAMES = ("input", "type", "linear", "getitem", "submod_1", "wrap_with_set_grad_enabled")


def _named(name: str) -> type[nn.Module]:
    source = (f"def forward(self, {name}):\n"
              f"    return torch.relu(self.lin({name})) + {name}\n")
    namespace: dict[str, Any] = {"torch": torch}
    exec(source, namespace)

    def init(self: nn.Module) -> None:
        nn.Module.__init__(self)
        self.lin = nn.Linear(8, 8)

    return type(f"Takes_{name}", (nn.Module,), {"__init__": init,
                                                "forward": namespace["forward"]})


@pytest.mark.parametrize("name", NAMES)
def test_any_argument_name_is_stored_and_hits(tmp_path: Path, name: str,
                                              quiet: list[warnings.WarningMessage]) -> None:
    block = _named(name)

    def job(verify: str) -> ctxreplay.CaptureReport:
        torch.manual_seed(0)
        model = nn.Sequential(block(), block()).eval()
        with ctxreplay.capture_with(model, targets="repeated", verify=verify,
                                    cache=tmp_path) as session, torch.no_grad():
            model(torch.rand(2, 8))
        return session.finalize()

    first = job("signature")
    assert first.ok and cache_warnings(quiet) == []
    assert first.cache is not None and first.cache["not_stored"] == {}
    assert len(entries(tmp_path)) == len(first.captures)
    second = job("execute")  # the stored program loaded and run by value
    assert second.ok and cached(second) == [True] * len(second.captures)
    assert cache_warnings(quiet) == []


def test_a_capture_the_cache_cannot_keep_warns_once_with_its_cause(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        quiet: list[warnings.WarningMessage]) -> None:
    from ctxreplay.artifacts.pt2 import Pt2Format

    def refuse(self: Any, artifact: Any) -> bytes:
        raise RuntimeError("the serialiser refuses this graph")

    monkeypatch.setattr(Pt2Format, "program_bytes", refuse)
    torch.manual_seed(0)
    report, calls = run(Stack(), tmp_path)
    assert report.ok and trust_oracle.unreproduced(report, calls) == []
    labels = sorted(f"{c.scope}#{c.variant}" for c in report.captures)
    found = cache_warnings(quiet)
    assert len(found) == len(labels) == CAPTURES
    for label in labels:
        (one,) = [m for m in found if f" {label} " in m]
        assert "is not stored" in one and "the serialiser refuses this graph" in one
    assert report.cache is not None
    assert report.cache["not_stored"] == {label: "not_serialisable" for label in labels}
    assert report.cache_summary is not None and \
        f"{CAPTURES} of them could not be stored" in report.cache_summary
    assert entries(tmp_path) == []
    assert_metadata_only(report.to_json())
