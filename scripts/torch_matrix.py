#!/usr/bin/env python3
"""Run the suite and the demo on several torch releases, one venv each.

For every version X given on the command line:

1. ``make setup VENV=.venv-torch-X TORCH_SPEC=torch==X EXTRAS=test,models,docs``
   and ``TORCH_EXTRA=<the releases paired with it>`` (torchvision, torchao; the
   Makefile's own setup, so a matrix venv is built exactly like ``.venv``; a
   venv whose stamp is current is not touched);
2. ``make pytest ...`` -- the very pytest command ``make test`` runs -- with
   ``--junitxml`` into ``matrix-logs/X/junit.xml``;
3. ``make demo ...`` (``ctxreplay demo``), keeping its exit code;
4. ``mypy --strict ctxreplay`` against that venv's torch (the mypy of the dev
   venv, ``.venv``, with ``--python-executable``; nothing installed in the
   matrix venv), counting its errors: ``make test TORCH_SPEC=torch==X`` runs
   it too, and torch's type stubs differ by release.  "-" without ``.venv``.

``--extras test`` builds the venvs with the test extra alone (no
``transformers``, ``diffusers`` or ``accelerate``: the suite as a user without
the optional model packages runs it; the venv is ``.venv-torch-X-test``), and
``--broken-probe`` runs the suite and the demo with a package installed whose
``ctxreplay.probes`` entry point no longer loads (its module moved), put on
``PYTHONPATH``: a broken plugin must never stop either.

A failing step never stops the run: the next version goes on.  At the end one
table (torch, passed, failed, skipped, xfailed, errors, demo exit code, minutes)
is printed and written to ``--out``, followed by the failing test ids per
version.  Logs of every step stay in ``matrix-logs/X/``.

Standard (CUDA) torch builds take about 5 GB of disk each: the script checks
the free space before a venv is built and skips the version (reported in the
table) when less than ``--min-free-gb`` is left.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = "test,models,docs"  # what the suite needs (docs: the site build test); no lint tools


def broken_probe_site(where: Path) -> Path:
    """A folder holding the metadata of an installed package whose probe
    entry point names a module that no longer exists."""
    info = where / "moved_probe_pkg-1.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: moved-probe-pkg\n"
                                   "Version: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[ctxreplay.probes]\nmoved_probe = moved_probe_pkg_gone.probes:MovedProbe\n")
    return where

#: the releases installed beside each torch release (the Makefile's TORCH_EXTRA):
#: torchvision, built against it, so that tests/models/test_models.py's torchvision
#: test runs; torchao where its newest release needs a newer torch (torchao 0.18
#: imports ``torch.nn.functional.ScalingType``, which torch 2.7 lacks, and
#: transformers imports torchao when it is installed: every model test would fail
#: at import); peft 0.18.1 beside that torchao (peft 0.19 and later raise
#: ImportError at import where torchao is older than 0.16, which needs a newer
#: torch than 2.7).  No torchvision for 2.13.0: this machine's 2.13.0 is the CPU build
#: from local disk, and no PyPI torchvision loads beside a CPU-only torch wheel (a
#: platform limit the test skips with that reason).  A release not listed gets
#: neither.
PAIRED: dict[str, tuple[str, ...]] = {
    "2.7.0": ("torchvision==0.22.0", "torchao==0.12.0", "peft==0.18.1"),
    "2.9.1": ("torchvision==0.24.1",),
    "2.11.0": ("torchvision==0.26.0",),
    "2.13.0": (),
    "2.14.1": ("torchvision==0.29.1",),
}


@dataclass
class Result:
    torch: str
    setup_rc: int | None = None
    pytest_rc: int | None = None
    demo_rc: int | None = None
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    xfailed: int = 0
    errors: int = 0
    mypy_errors: int | None = None
    seconds: float = 0.0
    installed: str = "?"
    note: str = ""
    failures: list[str] = field(default_factory=list)
    skips: dict[str, int] = field(default_factory=dict)


def _run(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> int:
    with log.open("w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        return subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL, env=env).returncode


def _parse_junit(path: Path, r: Result) -> None:
    root = ET.parse(path).getroot()
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        kinds = {child.tag: child for child in case}
        if "failure" in kinds or "error" in kinds:
            tag = "failure" if "failure" in kinds else "error"
            msg = (kinds[tag].get("message") or "").strip().splitlines()
            line = msg[0][:160] if msg else ""
            if tag == "failure":
                r.failed += 1
            else:
                r.errors += 1
            r.failures.append(f"{tag}: {name}: {line}")
        elif "skipped" in kinds:
            sk = kinds["skipped"]
            if sk.get("type") == "pytest.xfail":
                r.xfailed += 1
            else:
                r.skipped += 1
                reason = (sk.get("message") or "").strip()[:120]
                r.skips[reason] = r.skips.get(reason, 0) + 1
        else:
            r.passed += 1


def _mypy(mypy: Path, py: Path, log: Path) -> int | None:
    if not mypy.exists():
        return None
    _run([str(mypy), "--strict", "--python-executable", str(py), "ctxreplay"], log)
    m = re.search(r"Found (\d+) errors?", log.read_text())
    return int(m.group(1)) if m else 0


def run_version(version: str, make: str, logs: Path, min_free_gb: float,
                mypy: Path, extras: str = EXTRAS, broken: Path | None = None) -> Result:
    r = Result(version)
    t0 = time.monotonic()
    venv = f".venv-torch-{version}" + ("" if extras == EXTRAS else f"-{extras.replace(',', '_')}")
    logs.mkdir(parents=True, exist_ok=True)
    common = [f"VENV={venv}", f"TORCH_SPEC=torch=={version}", f"EXTRAS={extras}"]
    env = None
    if broken is not None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(broken), *filter(None, [os.environ.get("PYTHONPATH")])])}
    paired = PAIRED.get(version, ())
    if paired:
        common.append("TORCH_EXTRA=" + " ".join(paired))
    free = shutil.disk_usage(ROOT).free / 2**30
    if not (ROOT / venv).exists() and free < min_free_gb:
        r.note = f"not built: {free:.1f} GB free < {min_free_gb} GB"
        return r
    print(f"== torch {version}: setup ({free:.0f} GB free)", flush=True)
    r.setup_rc = _run([*make.split(), "--no-print-directory", "setup", *common],
                      logs / "setup.log")
    if r.setup_rc != 0:
        r.note = "setup failed (see setup.log)"
        r.seconds = time.monotonic() - t0
        return r
    py = ROOT / venv / "bin" / "python"
    got = subprocess.run([str(py), "-c", "import torch; print(torch.__version__)"],
                         capture_output=True, text=True, cwd=ROOT)
    r.installed = got.stdout.strip() or "?"
    print(f"== torch {r.installed}: pytest", flush=True)
    junit = logs / "junit.xml"
    junit.unlink(missing_ok=True)
    r.pytest_rc = _run([*make.split(), "--no-print-directory", "pytest", *common,
                        f"PYTEST_EXTRA=--junitxml={junit}"], logs / "pytest.log", env)
    if junit.exists():
        _parse_junit(junit, r)
    else:
        r.note = f"no junit report (pytest exit {r.pytest_rc}; see pytest.log)"
    print(f"== torch {r.installed}: demo", flush=True)
    r.demo_rc = _run([*make.split(), "--no-print-directory", "demo", *common],
                     logs / "demo.log", env)
    print(f"== torch {r.installed}: mypy", flush=True)
    r.mypy_errors = _mypy(mypy, py, logs / "mypy.log")
    r.seconds = time.monotonic() - t0
    return r


def table(results: list[Result]) -> str:
    cols = ("torch", "passed", "failed", "skipped", "xfailed", "errors", "pytest exit",
            "demo exit", "mypy errors", "minutes", "note")
    rows = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in results:
        rows.append(f"| {r.installed if r.installed != '?' else r.torch} | {r.passed} | {r.failed}"
                    f" | {r.skipped} | {r.xfailed} | {r.errors}"
                    f" | {'-' if r.pytest_rc is None else r.pytest_rc}"
                    f" | {'-' if r.demo_rc is None else r.demo_rc}"
                    f" | {'-' if r.mypy_errors is None else r.mypy_errors}"
                    f" | {r.seconds / 60:.1f} | {r.note} |")
    return "\n".join(rows)


def details(results: list[Result]) -> str:
    out = []
    for r in results:
        out.append(f"\n### torch {r.torch}\n")
        if r.failures:
            out.extend(f"- {f}" for f in r.failures)
        else:
            out.append("- no failures or errors")
        for reason, n in sorted(r.skips.items()):
            out.append(f"- skipped x{n}: {reason}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("versions", nargs="+", help="torch releases, e.g. 2.7.0 2.13.0")
    ap.add_argument("--make", default=os.environ.get("MAKE", "make"))
    ap.add_argument("--out", default="matrix-results.md")
    ap.add_argument("--logs", default="matrix-logs")
    ap.add_argument("--min-free-gb", type=float, default=8.0)
    ap.add_argument("--extras", default=EXTRAS,
                    help="the extras each venv is built with ('test': no model packages)")
    ap.add_argument("--broken-probe", action="store_true",
                    help="run with a probe package installed whose entry point is broken")
    ap.add_argument("--mypy", default=".venv/bin/mypy",
                    help="the mypy run against each venv's torch (skipped if missing)")
    ns = ap.parse_args(argv)
    broken = broken_probe_site(ROOT / ns.logs / "broken-probe-site") if ns.broken_probe else None
    results = []
    for v in ns.versions:
        r = run_version(v, ns.make, ROOT / ns.logs / v, ns.min_free_gb, ROOT / ns.mypy,
                        ns.extras, broken)
        if ns.extras != EXTRAS or broken is not None:
            r.note = "; ".join(filter(None, [f"extras {ns.extras}" if ns.extras != EXTRAS
                                             else "", "a broken probe entry point installed"
                                             if broken is not None else "", r.note]))
        results.append(r)
        print(table(results[-1:]).splitlines()[-1], flush=True)
    stamp = time.strftime("%Y-%m-%d %H:%M")
    text = (f"# torch matrix ({stamp}, Python {sys.version.split()[0]})\n\n"
            f"{table(results)}\n\n## Failures and skips per version\n{details(results)}\n")
    (ROOT / ns.out).write_text(text)
    print("\n" + table(results))
    print(f"\nwritten to {ns.out}; logs in {ns.logs}/<version>/")
    ok = all(r.pytest_rc == 0 and r.demo_rc == 0 and not r.mypy_errors for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
