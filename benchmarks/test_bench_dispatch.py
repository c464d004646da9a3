"""What an installed model costs beside the same model run eagerly, side by side.

* **dispatch** -- a stack of 32 ``Linear(32, 32)`` + ``tanh`` blocks, batch 2,
  one thread, captured under ``no_grad``: the bare model, the model with a
  no-op forward pre + post hook pair (with kwargs) on every block, and the
  model with its captures installed (every block call dispatched), in
  interleaved rounds.  Each overhead is per block call, over the bare block;
  the ratio is dispatch's over the hook pair's (target <= 2x).
* **static-cache decoding** -- a tiny Qwen2 (2 and 8 decoder layers)
  ``generate()`` of 32 new tokens with ``cache_implementation="static"``
  under inference mode, eager beside installed with ``object_args="dispatch"``
  (two copies of one model, interleaved rounds): tokens identical, and the
  installed model's tokens per second over eager's (target >= 0.95x for 2
  layers; reported for 8).
* **DynamicCache decoding** -- the same 2-layer Qwen2's ``generate()`` of 32
  new tokens with its default ``DynamicCache``: every call dispatched (each
  program's assignments to the cache written back), tokens identical, tokens
  per second installed over eager (target >= 0.95x).
* **compile** -- ``install(..., compile=torch.compile)`` on the demo's TinyDiT
  denoise loop (CPU bfloat16 autocast, inference mode) beside the eager loop
  and the installed loop without ``compile``; reported, no target.

Speed is printed, never asserted; outputs are.  Under ``--benchmark-disable``
the workloads shrink (and ``torch.compile`` uses its ``eager`` backend, which
compiles nothing) so the file runs in seconds.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from benchutil import (
    add_hook_pair,
    fast,
    interleaved_medians,
    one_thread,
    per_block_medians,
    report,
)
from torch import nn

import ctxreplay
from ctxreplay.demo import TinyDiT

N_BLOCKS = 32
DIM = 32


class TanhBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class TanhStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(TanhBlock() for _ in range(N_BLOCKS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


@pytest.fixture
def threads() -> Iterator[None]:
    with one_thread():
        yield


def test_dispatch_beside_a_hook_pair(benchmark: Any, threads: None,
                                     request: pytest.FixtureRequest) -> None:
    torch.manual_seed(0)
    base = TanhStack().eval()
    x = torch.rand(2, DIM)
    models = {k: copy.deepcopy(base) for k in ("bare", "hooks", "installed")}
    for b in models["hooks"].blocks:
        add_hook_pair(b)
    with ctxreplay.capture_with(models["installed"], targets="repeated") as session, \
            torch.no_grad():
        models["installed"](x)
    captured = session.finalize()
    assert captured.ok and len(captured.captures) == 1
    with ctxreplay.install(models["installed"], captured) as handle, torch.no_grad():
        outs = {k: m(x) for k, m in models.items()}
        assert all(torch.equal(outs["bare"], o) for o in outs.values())
        number, rounds = (10, 3) if fast(request.config) else (40, 101)
        fns = {k: (lambda m=m: m(x)) for k, m in models.items()}
        per_block = per_block_medians(benchmark, fns, N_BLOCKS, number=number, rounds=rounds)
        stats = handle.stats()
    assert stats.total_misses == 0 and stats.total_hits >= N_BLOCKS
    assert stats.unflattened == {}, stats.unflattened  # the fast path ran
    hooks = per_block["hooks"] - per_block["bare"]
    dispatch = per_block["installed"] - per_block["bare"]
    ratio = dispatch / hooks if hooks > 0 else float("nan")
    benchmark.extra_info.update(dispatch_ratio=ratio, dispatch_us=dispatch, hooks_us=hooks)
    report("installed dispatch / no-op hook pair, per block call", ratio, "<= 2x",
           f"bare block {per_block['bare']:.2f} us; the hook pair adds {hooks:.2f} us, "
           f"dispatch {dispatch:+.2f} us")


def _qwen2(layers: int) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.Qwen2ForCausalLM(config).eval()


def _generate_beside_eager(benchmark: Any, request: pytest.FixtureRequest, layers: int,
                           cache: str | None, max_variants: Callable[[int], int]
                           ) -> tuple[ctxreplay.CaptureReport, dict[str, float], int]:
    """A tiny Qwen2's greedy ``generate()``, captured and installed
    (``object_args="dispatch"``) beside an eager copy: tokens identical and
    every layer call of the prefill and each decode step dispatched; the
    report, the interleaved medians and the new tokens' count."""
    eager = _qwen2(layers)
    installed = copy.deepcopy(eager)
    new = 8 if fast(request.config) else 32
    prompt = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(1))
    options: dict[str, Any] = {"max_new_tokens": new, "do_sample": False, "pad_token_id": 0}
    if cache is not None:
        options["cache_implementation"] = cache

    def generate(model: nn.Module) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            with torch.inference_mode():
                out: torch.Tensor = model.generate(prompt, **options)
            return out
        return run

    with ctxreplay.capture_with(installed, targets="repeated",
                                max_variants=max_variants(new)) as session:
        generate(installed)()
    captured = session.finalize()
    with ctxreplay.install(installed, captured, object_args="dispatch") as handle:
        want, got = generate(eager)(), generate(installed)()
        assert torch.equal(got, want)
        stats = handle.stats()
        assert stats.total_hits == layers * new, stats
        assert stats.reasons == {}, stats.reasons
        assert stats.unflattened == {}, stats.unflattened
        rounds = 3 if fast(request.config) else 31
        med = benchmark.pedantic(
            interleaved_medians,
            args=({"eager": generate(eager), "installed": generate(installed)},),
            kwargs={"number": 1, "rounds": rounds}, rounds=1, iterations=1)
    return captured, med, new


def _report_tokens(benchmark: Any, what: str, target: str, med: dict[str, float],
                   new: int) -> None:
    ratio = med["eager"] / med["installed"]  # tokens per second, installed over eager
    benchmark.extra_info["tokens_per_second_ratio"] = ratio
    report(f"{what}, tokens/s installed / eager", ratio, target,
           f"{new} new tokens: eager {new / med['eager']:.0f} tok/s, installed "
           f"{new / med['installed']:.0f} tok/s")


@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning",
                            "ignore::DeprecationWarning")
@pytest.mark.parametrize("layers", [2, 8])
def test_static_cache_generate_beside_eager(benchmark: Any, threads: None, layers: int,
                                            request: pytest.FixtureRequest) -> None:
    # a decoder layer's identity holds its index: each layer is its own
    # variant, for the prefill and for the decode steps.  The decode steps
    # update the cache in place; the prefill's program returns the tensors
    # the cache's lazy set-up assigns: all dispatched
    _, med, new = _generate_beside_eager(benchmark, request, layers, "static",
                                         lambda _new: 4 * layers)
    _report_tokens(benchmark, f"static-cache generate(), {layers} layers",
                   ">= 0.95x" if layers == 2 else "reported", med, new)


@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning",
                            "ignore::DeprecationWarning")
def test_dynamic_cache_generate_beside_eager(benchmark: Any, threads: None,
                                             request: pytest.FixtureRequest) -> None:
    # the default DynamicCache: each layer, each cache length its own variant;
    # prefill and every decode step have the program's assignments written back
    layers = 2
    captured, med, new = _generate_beside_eager(benchmark, request, layers, None,
                                                lambda n: 2 * n * layers)
    assert captured.ok, captured.problems
    _report_tokens(benchmark, f"DynamicCache generate(), {layers} layers", ">= 0.95x",
                   med, new)


@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")
def test_compile_on_the_dit_denoise_loop(benchmark: Any, threads: None,
                                         request: pytest.FixtureRequest) -> None:
    quick = fast(request.config)
    steps = 3 if quick else 10
    torch.manual_seed(0)
    base = TinyDiT(64, depth=2 if quick else 6).eval()
    models = {k: copy.deepcopy(base) for k in ("eager", "installed", "compiled")}
    x0 = torch.rand(2, 32, 64)

    def loop(model: nn.Module) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            x = x0
            with torch.autocast("cpu", dtype=torch.bfloat16), torch.inference_mode():
                for step in range(steps):
                    x = model(x, torch.full((2,), 1000.0 * (steps - step) / steps))
            return x
        return run

    with ctxreplay.capture_with(models["installed"], targets="repeated") as session:
        loop(models["installed"])()
    captured = session.finalize()
    assert captured.ok
    compiler: Any = torch.compile if not quick else (
        lambda gm: torch.compile(gm, backend="eager"))
    handles = [ctxreplay.install(models["installed"], captured),
               ctxreplay.install(models["compiled"], captured, compile=compiler)]
    try:
        want = loop(models["eager"])()
        assert torch.equal(loop(models["installed"])(), want)
        t0 = time.perf_counter()
        compiled = loop(models["compiled"])()  # compiles each member once
        first = time.perf_counter() - t0
        torch.testing.assert_close(compiled, want, rtol=2e-2, atol=2e-2)
        assert handles[1].stats().total_misses == 0, handles[1].stats()
        fns = {k: loop(m) for k, m in models.items()}
        med = benchmark.pedantic(interleaved_medians, args=(fns,),
                                 kwargs={"number": 1, "rounds": 3 if quick else 15},
                                 rounds=1, iterations=1)
    finally:
        for h in handles:
            h.remove()
    ratio = med["eager"] / med["compiled"]
    benchmark.extra_info.update(compiled_speedup=ratio,
                                installed_speedup=med["eager"] / med["installed"])
    report("TinyDiT denoise loop, speed installed with compile=torch.compile / eager", ratio,
           "reported", f"{steps} steps: eager {med['eager'] * 1e3:.1f} ms, installed "
           f"{med['installed'] * 1e3:.1f} ms ({med['eager'] / med['installed']:.2f}x), "
           f"compiled {med['compiled'] * 1e3:.1f} ms; the first compiled loop "
           f"{first:.1f} s")
