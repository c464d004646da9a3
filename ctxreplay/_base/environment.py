"""The environment a document records: ctxreplay, torch and Python
versions, the accelerator present and its capability, and -- for saved
captures -- torch's autocast op policy.

Metadata only: versions, device types, capability strings and short
digests.  Every torch query is feature-detected (torch 2.5-2.14 differ).
"""

from __future__ import annotations

import functools
import hashlib
import platform
from typing import Any

import torch

from .version import __version__

__all__ = ["ACCELERATORS", "COMPILED_GUARDED", "autocast_policy", "capability",
           "compiled_environment", "device_available", "environment", "full_environment"]

#: device types an artifact's tensors may live on besides the CPU
ACCELERATORS = ("cuda", "xpu", "mps", "hpu", "mtia", "privateuseone")

# autocast dispatch keys by device type (the names torch's dispatcher uses)
_AUTOCAST_KEYS = {"cpu": "AutocastCPU", "cuda": "AutocastCUDA", "xpu": "AutocastXPU",
                  "mps": "AutocastMPS", "hpu": "AutocastHPU",
                  "privateuseone": "AutocastPrivateUse1"}


@functools.cache
def autocast_policy() -> dict[str, str]:
    """Device type -> a digest of torch's own operators (``aten::``) that its
    autocast has a kernel for on it (``_dispatch_get_registrations_for_dispatch_key``):
    two builds whose autocast casts different operators have different
    digests.  Another library's operators are left out: they register with
    autocast when that library is imported (``import torchvision`` adds
    ``torchvision::nms`` and ``roi_align`` to AutocastCPU), so the digest
    would say whether a process had imported it, not what torch casts.  A
    device type whose key this torch lacks is left out."""
    get = getattr(torch._C, "_dispatch_get_registrations_for_dispatch_key", None)
    if get is None:  # pragma: no cover - a torch without the query
        return {}
    out: dict[str, str] = {}
    for device, key in _AUTOCAST_KEYS.items():
        try:
            ops = sorted(name for name in map(str, get(key)) if name.startswith("aten::"))
        except Exception:  # this torch has no such dispatch key
            continue
        if ops:
            out[device] = hashlib.sha256("\n".join(ops).encode()).hexdigest()[:16]
    return dict(out)


def device_available(device_type: str) -> bool:
    """Whether tensors of ``device_type`` can be made in this process."""
    if device_type in ("cpu", "meta"):
        return True
    module = getattr(torch, device_type, None)
    check = getattr(module, "is_available", None)
    if check is None:
        return False
    try:
        return bool(check())
    except Exception:  # a broken driver: not available
        return False


def capability(device_type: str) -> str | None:
    """``"major.minor"`` of the current ``device_type`` accelerator, where
    torch reports one (CUDA, ROCm; XPU has no such notion here)."""
    if device_type != "cuda" or not device_available("cuda"):
        return None
    try:
        major, minor = torch.cuda.get_device_capability()
    except Exception:  # a broken driver: unknown
        return None
    return f"{major}.{minor}"


def environment() -> dict[str, Any]:
    """ctxreplay, torch and Python versions, and the accelerator (metadata only)."""
    cuda = capability("cuda")
    return {"ctxreplay": __version__, "torch": str(torch.__version__),
            "python": platform.python_version(), "device": "cpu" if cuda is None else "cuda",
            "capability": cuda, "cuda": torch.version.cuda}


def full_environment() -> dict[str, Any]:
    """``environment()`` plus the autocast op policy digests: what a saved
    capture records, since the same block under the same autocast traces
    differently where torch's autocast casts other operators."""
    env = environment()
    env["autocast_policy"] = autocast_policy()
    return env


#: the fields of ``compiled_environment`` a compiled program is loaded only
#: where they are equal: its shared library calls into this torch's C++
#: runtime (the release and its git revision), runs the machine's
#: instructions (the CPU's architecture and the vector ISA Inductor chose
#: its kernels for: an AVX512 kernel faults on an AVX2 machine) or the
#: accelerator's (CUDA compute capability).  The C++ compiler is recorded,
#: not compared: it ran when the program was compiled, and none runs at load.
COMPILED_GUARDED = ("torch", "torch_git", "machine", "cpu_isa", "device", "capability")


def compiled_environment(device_type: str) -> dict[str, str | None]:
    """What an ahead-of-time compiled program for ``device_type`` depends on
    (metadata only): the fields of ``COMPILED_GUARDED`` read now."""
    cpu = getattr(torch.backends, "cpu", None)
    try:
        isa = str(cpu.get_cpu_capability()) if cpu is not None else None
    except Exception:  # a torch without the query: unknown, so never equal to a record
        isa = None
    return {"torch": str(torch.__version__),
            "torch_git": str(getattr(torch.version, "git_version", "") or ""),
            "machine": platform.machine(), "cpu_isa": isa,
            # a device this process cannot reach is never the one it was compiled for
            "device": device_type if device_available(device_type)
            else f"{device_type} (not available)",
            "capability": capability(device_type) if device_type != "cpu" else None}
