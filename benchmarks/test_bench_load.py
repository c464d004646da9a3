"""What checking a saved directory's files costs: ``ctxreplay.load(dir)`` of a
directory whose manifest records the digests of its files (each file read
once and hashed) beside ``load`` of the same directory with the digests
taken out of its manifest (as a ctxreplay before them wrote it: nothing
read but the documents), interleaved round by round.  Target <= 1.2x.  A
second row reads every program too (what ``install`` does), the bytes read
checked against their digest beside the same read unchecked.

Two directories: the one ``test_bench_artifacts`` loads (two
``Linear(32)`` blocks, one capture), and 8 variants of a TinyDiT block
(``fold=False``: one file each) saved after live calls under CPU bfloat16
autocast and inference mode -- 1.1 MB of files, where hashing them
(``sha256``, about 1 GB/s with SHA extensions) is most of the difference.  One
thread; the ``ctxreplay`` logger is silenced on both sides (the unverified
directory logs a line at each load).  Speed is printed, never asserted.
"""

from __future__ import annotations

import json
import logging
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from benchutil import Stack, fast, interleaved_medians, one_thread, report

import ctxreplay
from ctxreplay.demo import TinyDiT

DIM = 32
SHAPES = tuple((1, n) for n in (4, 6, 8, 10, 12, 14, 16, 18))


def _dit() -> ctxreplay.CaptureReport:
    torch.manual_seed(0)
    model = TinyDiT(DIM, depth=2).eval()
    session = ctxreplay.capture_with(model, targets="repeated", backend="export",
                                     max_variants=len(SHAPES), fold=False)
    with session, torch.autocast("cpu", dtype=torch.bfloat16), torch.inference_mode():
        for b, t in SHAPES:
            model(torch.rand(b, t, DIM), torch.full((b,), 500.0))
    return session.finalize()


def _stack() -> ctxreplay.CaptureReport:
    torch.manual_seed(0)
    model = Stack(n=2, dim=DIM).eval()
    with ctxreplay.capture_with(model, targets="repeated", backend="export") as session, \
            torch.no_grad():
        model(torch.rand(4, DIM))
    return session.finalize()


MADE = {"stack": (_stack, 1), "dit": (_dit, len(SHAPES))}


@pytest.fixture(scope="module", params=list(MADE))
def directories(request: pytest.FixtureRequest,
                tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, int]:
    """The saved directory, a copy whose manifest records no digests, and how
    many captures they hold."""
    warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
    make, n = MADE[request.param]
    rep = make()
    assert rep.ok and len(rep.captures) == n, rep.problems
    root = tmp_path_factory.mktemp(f"bench_load_{request.param}")
    checked = root / "digests"
    assert rep.save_all(checked).ok
    plain = Path(shutil.copytree(checked, root / "no_digests"))
    doc = json.loads((plain / "manifest.json").read_text())
    for entry in doc["captures"]:
        entry.pop("digests", None)
    (plain / "manifest.json").write_text(json.dumps(doc))
    return checked, plain, n


@pytest.fixture
def quiet() -> Iterator[None]:
    log = logging.getLogger("ctxreplay")
    was = log.disabled
    log.disabled = True
    try:
        with one_thread():
            yield
    finally:
        log.disabled = was


def _loaded(path: Path, verified: bool) -> ctxreplay.LoadedManifest:
    loaded = ctxreplay.load(path)
    assert isinstance(loaded, ctxreplay.LoadedManifest)
    assert loaded.captures and not loaded.refused
    assert all(c.verified is verified for c in loaded.captures)
    return loaded


def _programs(path: Path, verified: bool) -> None:
    for cap in _loaded(path, verified).captures:
        assert cap.program is not None


@pytest.mark.parametrize("what", ["load", "load+programs"])
def test_load_with_digests_vs_without(benchmark: Any, request: pytest.FixtureRequest,
                                      directories: tuple[Path, Path, int], quiet: None,
                                      what: str) -> None:
    checked, plain, n = directories
    run = _loaded if what == "load" else _programs
    if what == "load":
        number, rounds = (2, 3) if fast(request.config) else (40 // n, 31)
    else:
        number, rounds = (1, 2) if fast(request.config) else (2, 15)
    med = benchmark.pedantic(
        interleaved_medians,
        args=({"digests": lambda: run(checked, True), "none": lambda: run(plain, False)},),
        kwargs={"number": number, "rounds": rounds}, rounds=1, iterations=1)
    ratio = med["digests"] / med["none"]
    size = sum(f.stat().st_size for f in checked.iterdir())
    benchmark.extra_info[f"{what}_digest_ratio"] = ratio
    report(f"{what} with digests / without [{n} captures, {size / 1e3:.0f} kB]",
           ratio, "<= 1.2", f"with {med['digests'] * 1e3:.1f} ms, without "
           f"{med['none'] * 1e3:.1f} ms")
    assert ratio > 0
