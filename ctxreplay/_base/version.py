"""The version of ctxreplay and of the environment a document was made in."""

from __future__ import annotations

import platform
from typing import Any

import torch

__all__ = ["__version__", "environment"]

__version__ = "0.2.0"


def environment() -> dict[str, Any]:
    """ctxreplay, torch and Python versions, and the accelerator (metadata only)."""
    env: dict[str, Any] = {"ctxreplay": __version__, "torch": str(torch.__version__),
                           "python": platform.python_version(), "device": "cpu",
                           "capability": None, "cuda": torch.version.cuda}
    try:
        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            env["device"] = "cuda"
            env["capability"] = f"{major}.{minor}"
    except Exception:  # a broken driver: reported as CPU only
        pass
    return env
