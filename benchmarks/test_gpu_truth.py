"""``gpu_truth.py`` (run by hand on a CUDA machine) skips cleanly without one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).with_name("gpu_truth.py")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device would run it for real")
def test_gpu_truth_skips_without_cuda() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "gpu_truth: skipped, no CUDA device"
