"""Artifact work at the cost of the capture: ``report.save_all(dir)`` of N
captures beside the ``finalize()`` that made them, in the same run, round by
round.  Target <= 1.0x, at each verification level.  The files hold the
programs finalize() checked, so each is written (``torch.export.save``),
read back (``Pt2Format.reload``: torch's archive reader and deserialiser)
and compared with the checked program by its graph and weights; none is
run.  The collector is held off while each is written and read
(``saving.collector_paused``).

N = 8 variants of a TinyDiT block, live under CPU bfloat16 autocast and
inference mode, replay embedded (the programs hold ``wrap_with_autocast``).
Speed is printed, never asserted.

What a saved file holds beyond its weights: a Wan transformer block (tiny
dims, diffusers) saved after calls at two latent sizes, 256 and 4096
tokens.  The files' example inputs are meta placeholders (target: a few
kB; torch's own save wrote ~4 kB per latent token at the 1.3B shape) and
the rest (graph, weight configs, archive headers) does not grow with the
latent.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
import warnings
import zipfile
from typing import Any

import pytest
import torch
from benchutil import fast, report
from torch import nn

import ctxreplay
from ctxreplay.demo import TinyDiT

DIM = 32
SHAPES = tuple((1, n) for n in (4, 6, 8, 10, 12, 14, 16, 18))


def _session(model: TinyDiT, shapes: tuple[tuple[int, int], ...],
             verify: str) -> ctxreplay.CaptureSession:
    # one capture per size (fold=False): save_all's cost per capture
    session = ctxreplay.capture_with(model, targets="repeated", backend="export",
                                     verify=verify, max_variants=len(shapes), fold=False)
    with session, torch.autocast("cpu", dtype=torch.bfloat16), torch.inference_mode():
        for b, t in shapes:
            model(torch.rand(b, t, DIM), torch.full((b,), 500.0))
    return session


@pytest.mark.parametrize("verify", ["signature", "execute"])
def test_save_all_vs_finalize(benchmark: Any, request: pytest.FixtureRequest,
                              verify: str) -> None:
    warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
    torch.manual_seed(0)
    model = TinyDiT(DIM, depth=2).eval()
    shapes = SHAPES[:2] if fast(request.config) else SHAPES
    rounds = 1 if fast(request.config) else 3

    def measure() -> tuple[float, float, int]:
        finals, saves = [], []
        n = 0
        for _ in range(rounds):
            session = _session(model, shapes, verify)
            t0 = time.perf_counter()
            rep = session.finalize()
            finals.append(time.perf_counter() - t0)
            assert rep.ok and len(rep.captures) == len(shapes), rep.problems
            with tempfile.TemporaryDirectory() as tmp:
                t0 = time.perf_counter()
                written = rep.save_all(tmp)
                saves.append(time.perf_counter() - t0)
            assert written.ok and len(written.saved) == len(shapes)
            # the files hold the programs finalize() checked: compared graph
            # to graph, at whichever level that check ran
            assert all(s.fidelity.checked == ("graph",) and not s.lowered
                       for s in written.saved)
            n = len(rep.captures)
        return statistics.median(saves), statistics.median(finals), n

    saves, finals, n = benchmark.pedantic(measure, rounds=1, iterations=1)
    ratio = saves / finals
    benchmark.extra_info["save_all_to_finalize_ratio"] = ratio
    report(f"save_all/finalize ratio [verify={verify}, {n} captures]", ratio, "<= 1.0",
           f"save_all {saves * 1e3:.0f} ms, finalize {finals * 1e3:.0f} ms")
    assert ratio > 0


def _beyond_weights(model: nn.Module, latent: tuple[int, ...]) -> tuple[int, int, int]:
    """The largest saved file's bytes beyond its weights, the largest
    example-input entry torch's archive holds, and the largest graph."""
    session = ctxreplay.capture_with(model, targets="repeated", verify="signature")
    with session, torch.inference_mode():
        model(torch.rand(latent), torch.tensor([500.0]), torch.rand(1, 8, 16))
    rep = session.finalize()
    assert rep.ok, rep.problems
    beyond = inputs = graph = 0
    with tempfile.TemporaryDirectory() as tmp:
        written = rep.save_all(tmp)
        assert written.ok
        for saved, capture in zip(written.saved, rep.captures):
            program = capture.artifact
            weights = sum(t.nbytes for t in (*program.state_dict.values(),
                                             *program.constants.values())
                          if isinstance(t, torch.Tensor))
            beyond = max(beyond, os.path.getsize(saved.path) - weights)
            with zipfile.ZipFile(saved.path) as archive:
                for info in archive.infolist():
                    # sample_inputs/model.pt; serialized_example_inputs.pt before 2.8
                    if "sample_inputs" in info.filename or "example_inputs" in info.filename:
                        inputs = max(inputs, info.file_size)
                    if info.filename.endswith(("model.json", "exported_program.json")):
                        graph = max(graph, info.file_size)
    return beyond, inputs, graph


@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning",
                            "ignore::DeprecationWarning")
def test_saved_bytes_beyond_weights(benchmark: Any) -> None:
    """Sizes, not times: pytest-benchmark times the two finalize + save_all."""
    real_models = pytest.importorskip("real_models")
    pytest.importorskip("diffusers")
    model = real_models.wan(num_layers=2)
    # (batch, channels, frames, height, width), patches of 1x2x2: 256 and 4096 tokens
    small, large = (1, 4, 1, 32, 32), (1, 4, 4, 64, 64)

    def measure() -> tuple[tuple[int, int, int], tuple[int, int, int]]:
        return _beyond_weights(model, small), _beyond_weights(model, large)

    (b_small, _, _), (b_large, inputs, graph) = benchmark.pedantic(measure, rounds=1,
                                                                  iterations=1)
    benchmark.extra_info.update(example_input_bytes=inputs, beyond_weights_bytes=b_large,
                                graph_bytes=graph)
    report("largest saved file's example-input bytes [Wan block, 4096 latent tokens]",
           float(inputs), "a few kB",
           f"bytes beyond the weights {b_large} at 4096 tokens, {b_small} at 256 "
           f"(graph JSON {graph}; the rest is weight configs and archive headers)")
    assert inputs < 4096 and abs(b_large - b_small) < 4096
