"""``gpu_truth.py`` (run by hand on a CUDA machine) skips cleanly without one:
run with no CUDA device visible, whatever the machine holds."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).with_name("gpu_truth.py")


def test_gpu_truth_skips_without_cuda() -> None:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True,
                          timeout=300, check=False, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "gpu_truth: skipped, no CUDA device"
