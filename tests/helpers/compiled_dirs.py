"""A tiny model's saved captures compiled ahead of time, made in a fresh
process (compiling imports Inductor and changes process-wide state that a
test process should not carry), and a script that installs such a directory
in another fresh process with an empty Inductor cache and temp dir.

``MODEL`` is the source of the model both processes build (the same seed,
so the same weights): two repeated blocks -- LayerNorm, Linear, GELU,
Linear -- run under CPU bfloat16 autocast and inference mode on 4 x n x 32
inputs, n in 5, 7, 9 (one folded capture, n dynamic in [5, 9]; at n = 7 alone
where ctxreplay does not fold, see ``FOLDS``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from ctxreplay._base.torchcaps import CAPS

ROOT = Path(__file__).resolve().parents[2]

#: whether ctxreplay folds sizes on this torch (its programs check their size
#: guards): where not, the directories hold one fixed-size capture (n = 7)
#: and the tests call it at that size -- a fold's own cases assert there
#: that it does not fold
FOLDS = CAPS.export_guards_sizes


def call_sizes(*wanted: int) -> tuple[int, ...]:
    """``wanted`` where the captures fold; else ``7`` as often (a fixed-size
    capture serves only its own size)."""
    return wanted if FOLDS else (7,) * len(wanted)

MODEL = '''
import torch
from torch import nn

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(32)
        self.mlp = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))

    def forward(self, x):
        return self.mlp(self.norm(x))

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return x

def build():
    torch.manual_seed(0)
    return Model().eval()

SIZES = (5, 7, 9)
'''

_MAKE = MODEL + '''
import sys
import ctxreplay
from ctxreplay.cli import main

device, replay = sys.argv[2], sys.argv[4]
sizes = [int(n) for n in sys.argv[3].split(",")] if sys.argv[3] else SIZES
model = build().to(device)
with ctxreplay.capture_with(model, targets="repeated", verify="execute",
                            replay=replay) as session:
    with torch.autocast(device, dtype=torch.bfloat16), torch.inference_mode():
        for n in sizes:
            model(torch.rand(4, n, 32, device=device))
report = session.finalize()
# replayed around the trace, autocast is a need of the capture, not part of its
# graph: it reproduces its calls where that need holds (which report.ok does not count)
want = "ok" if replay == "embedded" else "ok_with_needs"
assert [c.fidelity.status for c in report.captures] == [want], report.summary
assert report.ok or replay != "embedded", report.summary
report.save_all(sys.argv[1])
sys.exit(main(["compile", sys.argv[1]]))
'''


def env(**extra: str) -> dict[str, str]:
    """The environment of a fresh process importing this worktree's ctxreplay."""
    out = dict(os.environ)
    out["PYTHONPATH"] = os.pathsep.join([str(ROOT), out.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    out.update(extra)
    return out


def make_compiled(directory: Path, device: str = "cpu", sizes: str | None = None,
                  replay: str = "embedded") -> str:
    """Capture (on ``device``; at ``sizes``, comma-separated, default ``SIZES``:
    one folded capture; with ``capture_with``'s ``replay``), save and
    ``ctxreplay compile`` the tiny model into ``directory`` in a fresh
    process; returns what the command printed."""
    if sizes is None:
        sizes = "" if FOLDS else "7"
    proc = subprocess.run([sys.executable, "-c", _MAKE, str(directory), device, sizes, replay],
                          env=env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def run_fresh(script: str, *args: str, **extra_env: str) -> dict[str, Any]:
    """Run ``MODEL + script`` in a fresh process; the script prints one JSON
    document last, which is returned."""
    proc = subprocess.run([sys.executable, "-c", MODEL + script, *args], env=env(**extra_env),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def set_compiled_field(directory: Path, field: str, value: Any) -> None:
    """Change one field of every compiled record in ``directory``'s manifest
    (``environment.cpu_isa``, ``ok``): a record made elsewhere, forged here."""
    path = directory / "manifest.json"
    doc = json.loads(path.read_text())
    for entry in doc["captures"]:
        record = entry["compiled"]
        *parents, leaf = field.split(".")
        for p in parents:
            record = record[p]
        record[leaf] = value
    path.write_text(json.dumps(doc))


def build_model() -> Any:
    """``MODEL``'s model in this process, its classes defined in ``__main__``
    as in the process that captured it (a member's identity names its class)."""
    namespace: dict[str, Any] = {"__name__": "__main__"}
    exec(compile(MODEL, "<compiled_dirs.MODEL>", "exec"), namespace)
    return namespace["build"]()
