"""Captures of a model with quantized weights, saved and installed in a fresh process.

The file of a program over wrapper-subclass weights was written lowered
(``run_decompositions`` unwraps each wrapper into ``parametrizations``
tensors the model does not have) because the check of the captured form
compared the weights with ``torch.equal``, an operator torchao's
``Int8Tensor`` does not implement: in a fresh process no member fit the
program and every call ran eagerly (``structure``).  The oracle is the
fresh process's own eager run of the same model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from quantized import KINDS, Int8Weight, stack_or_skip

import ctxreplay

pytestmark = [pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

_FRESH = textwrap.dedent("""
    import json, sys, warnings
    warnings.simplefilter("ignore")
    import torch
    import ctxreplay
    from quantized import Int8Weight, quantized_stack

    # a weight class of the user's own, trusted by name: torch's weights_only
    # reader (all ctxreplay reads a file with) then rebuilds it where a file
    # pickles it (torch 2.7's archives pickle every weight)
    torch.serialization.add_safe_globals([Int8Weight])

    model = quantized_stack(sys.argv[2])
    x = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(1))

    def calls():
        with torch.no_grad():
            a = model(x)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            b = model(x)
        return a, b

    eager = calls()
    source = ctxreplay.load(sys.argv[1])
    with ctxreplay.install(model, source) as handle:
        installed = calls()
    stats = handle.stats()
    print(json.dumps({"hits": sum(stats.hits.values()), "reasons": stats.reasons,
                      "weight": type(model.blocks[0].fc1.weight).__name__,
                      "equal": [e.dtype == i.dtype and torch.equal(e, i)
                                for e, i in zip(eager, installed)]}))
""")


def _fresh(directory: Path, kind: str) -> dict[str, Any]:
    helpers = str(Path(__file__).resolve().parents[1] / "helpers")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [helpers, *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.run([sys.executable, "-c", _FRESH, str(directory), kind],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.parametrize("kind", KINDS)
def test_quantized_captures_dispatch_in_a_fresh_process(tmp_path: Path, kind: str) -> None:
    model = stack_or_skip(kind)
    x = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(1))
    with ctxreplay.capture_with(model, targets="repeated", verify="execute") as session:
        with torch.no_grad():
            model(x)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            model(x)
    report = session.finalize()
    assert report.ok, report.failures
    # save_all reads each file back to check it, as a consumer reads it
    with torch.serialization.safe_globals([Int8Weight]):
        saved = report.save_all(tmp_path / "caps")
    assert saved.ok
    out = _fresh(tmp_path / "caps", kind)
    assert out["weight"] != "Parameter"  # the fresh model's weights are wrappers too
    assert out["hits"] == 2 * 3 and out["reasons"] == {}, out
    assert out["equal"] == [True, True]
