"""What compile-and-serve gives on one CUDA device, at a real model's size.

A Wan transformer at the 1.3B shape (30 blocks, dim 1536, a 9-frame
480x832 latent: 3510 video tokens, 512 text tokens), random weights from
its config, run under CUDA bfloat16 autocast.  One run measures, each in a
process of its own so that no cache or import is shared unless said:

1. ``make``: capture the blocks (``targets="repeated"``), save the
   directory and ``ctxreplay compile`` it (wall time of each);
2. ``aot``: a fresh process loads the directory, installs it, and times its
   first forward, then steady forwards beside eager, and the largest
   relative error of the installed output against eager's;
3. ``compile``: a fresh process with an empty inductor cache times
   ``torch.compile``'s first forward (cold), then steady forwards;
   ``compile`` again with that cache filled (warm).

It prints one JSON object and a Markdown table for docs/performance.md.
Without a CUDA device it says so and exits 0 (``--device cpu --tiny``
runs the same steps on a small model on the CPU, to check the script).

    python benchmarks/gpu_truth.py [--device cuda] [--tiny] [--rounds 10]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from aot_fresh import relative_error, steady

#: WanTransformer3DModel's config at the 1.3B shape, and a small one
SHAPES = {
    "1.3B": {"config": dict(patch_size=(1, 2, 2), num_attention_heads=12,
                            attention_head_dim=128, in_channels=16, out_channels=16,
                            text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30,
                            cross_attn_norm=True, qk_norm="rms_norm_across_heads"),
             "latent": (1, 16, 9, 60, 104), "text": (1, 512, 4096)},
    "tiny": {"config": dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8,
                            in_channels=4, out_channels=4, text_dim=16, freq_dim=16,
                            ffn_dim=32, num_layers=2, cross_attn_norm=True,
                            qk_norm="rms_norm_across_heads", rope_max_seq_len=32),
             "latent": (1, 4, 2, 8, 8), "text": (1, 4, 16)},
}


def build(shape: str, device: str) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The model (seeded weights, equal in every process) and one call's inputs."""
    from diffusers import WanTransformer3DModel

    spec = SHAPES[shape]
    torch.manual_seed(0)
    model = WanTransformer3DModel(**spec["config"]).eval().to(device)
    g = torch.Generator().manual_seed(1)
    inputs = {"hidden_states": torch.rand(*spec["latent"], generator=g).to(device),
              "encoder_hidden_states": torch.rand(*spec["text"], generator=g).to(device),
              "timestep": torch.tensor([500], device=device)}
    return model, inputs


def run(model: Any, inputs: dict[str, torch.Tensor], device: str) -> torch.Tensor:
    with torch.autocast(device, dtype=torch.bfloat16), torch.inference_mode():
        out: torch.Tensor = model(**inputs, return_dict=False)[0]
    if device == "cuda":
        torch.cuda.synchronize()
    return out


def child(mode: str, shape: str, device: str, directory: str, rounds: int) -> dict[str, Any]:
    """One fresh process's measurement (``main`` runs each as a subprocess)."""
    import copy

    import ctxreplay

    model, inputs = build(shape, device)
    if mode == "make":
        from ctxreplay.compiling import compile_dir

        t0 = time.perf_counter()
        with ctxreplay.capture_with(model, targets="repeated") as session:
            run(model, inputs, device)
        report = session.finalize()
        captured = time.perf_counter() - t0
        if not report.ok:
            return {"error": report.summary}
        report.save_all(directory)
        t0 = time.perf_counter()
        done = compile_dir(directory)
        return {"capture_s": captured, "compile_s": time.perf_counter() - t0,
                "captures": len(report.captures), "compiled": len(done.compiled),
                "failed": done.failed}
    eager = copy.deepcopy(model)
    want = run(eager, inputs, device)
    t0 = time.perf_counter()
    if mode == "aot":
        handle = ctxreplay.install(model, ctxreplay.load(directory))
        first = run(model, inputs, device)
        out: dict[str, Any] = {"first_s": time.perf_counter() - t0,
                               "error": relative_error(first, want)}
        stats = handle.stats()
        out.update(hits=stats.total_hits, misses=stats.total_misses,
                   served_compiled=len(stats.compiled))
        out["steady_s"] = steady({"eager": lambda: run(eager, inputs, device),
                                   "aot": lambda: run(model, inputs, device)}, rounds)
        return out
    compiled = torch.compile(model)
    first = run(compiled, inputs, device)
    out = {"first_s": time.perf_counter() - t0, "error": relative_error(first, want)}
    out["steady_s"] = steady({"eager": lambda: run(eager, inputs, device),
                               "compile": lambda: run(compiled, inputs, device)}, rounds)
    return out


def _spawn(mode: str, args: argparse.Namespace, directory: str, env: dict[str, str]
           ) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", mode, "--device", args.device,
           "--rounds", str(args.rounds), "--dir", directory, *(["--tiny"] if args.tiny else [])]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"],
                "wall_s": wall}
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    result["wall_s"] = wall
    return result


def table(r: dict[str, Any], card: str) -> str:
    """The Markdown rows for docs/performance.md, each against its target."""
    make, aot, cold, warm = r["make"], r["aot"], r["compile_cold"], r["compile_warm"]
    if any("error" in x and not isinstance(x.get("error"), float) for x in (make, aot, cold)):
        return f"one step failed: {json.dumps(r)}"
    eager = aot["steady_s"]["eager"]
    rows = [
        ("`ctxreplay compile` / torch.compile cold", make["compile_s"] / cold["first_s"], "<= 1"),
        ("first forward after install / torch.compile cold", aot["first_s"] / cold["first_s"],
         "<= 0.1"),
        ("first forward after install / torch.compile warm", aot["first_s"] / warm["first_s"],
         "-"),
        ("steady: eager / installed", eager / aot["steady_s"]["aot"], ">= 1.05"),
        # each against the eager run of its own process (the two ran apart)
        ("steady: installed speed-up / torch.compile's",
         (eager / aot["steady_s"]["aot"])
         / (cold["steady_s"]["eager"] / cold["steady_s"]["compile"]), ">= 0.95"),
    ]
    lines = [f"Measured on {card}, bf16 autocast, {r['shape']} Wan.", "",
             "| row | ratio | target |", "|---|---|---|"]
    lines += [f"| {name} | {value:.2f} | {target} |" for name, value, target in rows]
    lines.append(f"| installed output vs eager (max relative error) | {aot['error']:.2e} | - |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--tiny", action="store_true", help="the small model (checks the script)")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    shape = "tiny" if args.tiny else "1.3B"
    if args.child is not None:
        print(json.dumps(child(args.child, shape, args.device, args.dir, args.rounds)))
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_truth: skipped, no CUDA device")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        directory, cold_cache, aot_cache = (str(Path(tmp) / n) for n in ("dir", "cold", "aot"))
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=aot_cache)
        result: dict[str, Any] = {"shape": shape, "device": args.device}
        result["make"] = _spawn("make", args, directory, env)
        result["aot"] = _spawn("aot", args, directory, env)
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cold_cache)
        result["compile_cold"] = _spawn("compile", args, directory, env)
        result["compile_warm"] = _spawn("compile", args, directory, env)
    card = torch.cuda.get_device_name(0) if args.device == "cuda" else "the CPU"
    print(json.dumps(result))
    print(table(result, card))
    return 0


if __name__ == "__main__":
    sys.exit(main())
