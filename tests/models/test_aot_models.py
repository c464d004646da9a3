"""Compiled ahead of time on the real stacks: a tiny diffusers Flux
transformer (joint and single blocks, keyword arguments, a ``None``
argument the graph holds itself) and a tiny transformers Qwen2 (decoder
layers) are captured, saved and compiled (``ctxreplay compile``) in a fresh
process; installed here, every block call runs its compiled program, within
bfloat16's tolerance of eager."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import real_models
import torch
from compiled_dirs import env
from torch import nn

import ctxreplay
from ctxreplay.compiling import TOLERANCES

pytestmark = [pytest.mark.models,
              pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning")]

_CALLS = '''
import torch

def _g(seed):
    return torch.Generator().manual_seed(seed)

def flux_call(model):
    return model(hidden_states=torch.rand(1, 16, 4, generator=_g(1)),
                 encoder_hidden_states=torch.rand(1, 4, 16, generator=_g(2)),
                 pooled_projections=torch.rand(1, 16, generator=_g(3)),
                 timestep=torch.tensor([0.5]), img_ids=torch.zeros(16, 3),
                 txt_ids=torch.zeros(4, 3)).sample

def qwen2_call(model):
    return model(torch.tensor([[1, 5, 9, 3, 7, 2]]), use_cache=False).logits
'''

_MAKE = _CALLS + '''
import json, sys
import real_models
import ctxreplay
from ctxreplay.compiling import compile_dir

which, directory = sys.argv[1], sys.argv[2]
model = getattr(real_models, which)()
with ctxreplay.capture_with(model, targets="repeated") as session:
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.inference_mode():
        globals()[f"{which}_call"](model)
report = session.finalize()
assert report.ok, report.summary
report.save_all(directory)
done = compile_dir(directory)
print(json.dumps({"compiled": list(done.compiled), "failed": done.failed,
                  "skipped": done.skipped}))
'''


def _calls() -> dict[str, Callable[[nn.Module], torch.Tensor]]:
    namespace: dict[str, Any] = {}
    exec(compile(_CALLS, "<calls>", "exec"), namespace)
    return {"flux": namespace["flux_call"], "qwen2": namespace["qwen2_call"]}


@pytest.mark.parametrize(("which", "captures"), [("flux", 3), ("qwen2", 1)])
def test_a_real_model_runs_its_compiled_blocks(which: str, captures: int,
                                               tmp_path: Path) -> None:
    directory = tmp_path / "captures"
    helpers = str(Path(real_models.__file__).parent)
    proc = subprocess.run([sys.executable, "-c", _MAKE, which, str(directory)],
                          env=env(PYTHONPATH=f"{env()['PYTHONPATH']}:{helpers}"),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    made = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(made["compiled"]) == captures and not made["failed"] and not made["skipped"]
    call = _calls()[which]
    model = getattr(real_models, which)()
    with ctxreplay.install(model, ctxreplay.load(directory)) as handle:
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.inference_mode():
            got = call(model)
        stats = handle.stats()
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.inference_mode():
        want = call(model)
    assert stats.total_misses == 0 and stats.uncompiled == {}
    assert len(stats.compiled) == len(handle.members) == sum(stats.hits.values())
    err = float((got.float() - want.float()).abs().max() / want.float().abs().max())
    assert err <= TOLERANCES[torch.bfloat16]
