"""``compile_dir``: every capture of a saved directory compiled ahead of time.

Each capture's program is lifted (its member's tensors as inputs:
``lift``), exported again -- a folded capture with its dynamic dimensions
--, compiled and packaged by AOTInductor
(``torch._inductor.aoti_compile_and_package``) beside its ``.pt2``
(``<stem>.aoti.pt2``), checked against the uncompiled program
(``verify``), and recorded in the capture's manifest entry (``compiled``:
``loading.compiled.CompiledProgram``).  The manifest is rewritten
atomically after each capture, so an interrupted run keeps what it made.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.utils._pytree as pytree

from .._base.environment import compiled_environment
from .._base.progress import Progress, counted
from .._base.safefiles import file_digest, read_inside, written_inside
from .._base.torchcaps import aoti_package_loader
from ..dispatch.flat import Flat, flatten
from ..loading.compiled import CompiledProgram, OutputError
from ..loading.load import LoadedCapture, LoadedManifest, load
from ..report.manifest import MANIFEST_NAME, write_manifest
from .lift import NotLiftable, lifted, lifted_export
from .verify import compare, compute_tolerance, describe, inputs_of, size_points

__all__ = ["CompiledDir", "compile_dir"]

_log = logging.getLogger("ctxreplay")

#: the suffix of a compiled package beside a capture's ``.pt2``
PACKAGE_SUFFIX = ".aoti.pt2"


@attrs.frozen
class CompiledDir:
    """What ``compile_dir`` did: ``compiled`` (labels whose compiled program
    passed its check, this run or before), ``failed`` (label -> why its check
    failed: recorded, never used), ``skipped`` (label -> why it was not
    compiled: install runs its uncompiled program)."""

    directory: Path
    compiled: tuple[str, ...]
    failed: dict[str, str]
    skipped: dict[str, str]
    seconds: float

    @property
    def ok(self) -> bool:
        """Whether no compiled program failed its check."""
        return not self.failed


def compile_dir(directory: str | os.PathLike[str], *, force: bool = False,
                progress: Callable[[int, int, str], None] | None = None,
                inductor_configs: Mapping[str, Any] | None = None) -> CompiledDir:
    """Compile every capture saved in ``directory`` (``report.save_all``) with
    AOTInductor, check each against its uncompiled program and record it in
    the manifest; ``ctxreplay.install(model, ctxreplay.load(directory))`` then
    runs the compiled programs, in any process whose torch, machine and CPU
    ISA (or GPU architecture) are those it was compiled with.

    Args:
        directory: a directory written by ``report.save_all``.
        force: compile again captures compiled already.
        progress: ``(done, total, label)`` after each capture.
        inductor_configs: passed to ``aoti_compile_and_package``.

    Raises:
        ValueError: ``directory`` holds no manifest."""
    start = time.monotonic()
    root = Path(os.fspath(directory))
    if not (root / MANIFEST_NAME).is_file():
        raise ValueError(f"compile: {root} holds no {MANIFEST_NAME}; give a directory "
                         "written by report.save_all")
    src = load(root)
    assert isinstance(src, LoadedManifest)
    compiled: list[str] = []
    failed: dict[str, str] = {}
    # a capture whose files are not what the manifest recorded is never compiled
    skipped: dict[str, str] = {label: f"refused: {why}" for label, why in src.refused}
    bar = Progress(len(src.captures), 0, progress, task="compile", verb="compiled",
                   unit="capture", show_after=0.0)
    try:
        for cap in src.captures:
            result = _compile_or_keep(cap, root, force, inductor_configs)
            if isinstance(result, str):
                skipped[cap.label] = result
                _log.info("compile: %s not compiled: %s", cap.label, result)
            else:
                _record(root, cap, result)
                (compiled.append(cap.label) if result.ok else
                 failed.__setitem__(cap.label, result.reason or "beyond its tolerance"))
            bar.step(cap.label)
    finally:
        bar.close()
    done = CompiledDir(root, tuple(compiled), failed, skipped, time.monotonic() - start)
    _log.info("compile: %s: %s compiled, %d failed their check, %d not compiled (%.1f s)",
              root, counted(len(compiled), "capture"), len(failed), len(skipped), done.seconds)
    return done


def _compile_or_keep(cap: LoadedCapture, root: Path, force: bool,
                     configs: Mapping[str, Any] | None) -> CompiledProgram | str:
    """The capture's compiled record, made now or kept from before; or why
    it cannot be compiled."""
    if not force and cap.compiled is not None and \
            cap.compiled.unusable(root, cap.fingerprint) is None:
        return cap.compiled
    if cap.fidelity not in ("ok", "ok_with_needs"):
        return f"its capture is not ok (fidelity {cap.fidelity}): install never runs it"
    refused = cap.undispatchable()
    if refused:
        return f"install never runs it ({refused[0].kind}: {refused[0].found})"
    try:
        return _compile(cap, root, configs)
    except NotLiftable as exc:
        return str(exc)
    except Exception as exc:  # the compiler's own failure: this capture stays uncompiled
        _log.debug("compile: %s failed", cap.label, exc_info=True)
        return f"compiling failed ({type(exc).__name__}: {str(exc).splitlines()[0][:300]})"


def _compile(cap: LoadedCapture, root: Path,
             configs: Mapping[str, Any] | None) -> CompiledProgram:
    program = cap.program
    flat = flatten(program, keep_guards=cap.folding is not None)
    if not isinstance(flat, Flat):
        raise NotLiftable(f"its program cannot be flattened ({flat})")
    module, keep = lifted(program, flat)
    own = {**program.state_dict, **program.constants}
    state = [own[n].detach() for n in flat.state_names]
    args, kwargs = cap.example_inputs()
    leaves = flat.leaves(args, kwargs)
    taken = list(range(len(leaves))) if keep is None else list(keep)
    tensors = [leaves[i] for i in taken]
    if len(taken) != sum(isinstance(t, torch.Tensor) for t in leaves) or \
            not all(isinstance(t, torch.Tensor) for t in tensors):
        raise NotLiftable("the call's tensors are not the inputs its graph takes")
    tensors = [t.detach() for t in tensors]
    start = time.monotonic()
    package = root / (Path(cap.path.name).stem + PACKAGE_SUFFIX)
    _package(cap, module, (state, tensors), package, configs)
    seconds = time.monotonic() - start
    device = tensors[0].device.type if tensors else state[0].device.type if state else "cpu"
    checked, outputs = _check(cap, flat, package, state, (leaves, taken), device)
    worst = [o for o in outputs if not o.ok]
    reason = None if not worst else "; ".join(
        f"{_named(o, flat)} ({o.dtype}) off by {o.error:.3g} of its peak, tolerance "
        f"{o.tolerance:g}" for o in worst)
    return CompiledProgram(package.name, tuple(flat.state_names), compiled_environment(device),
                           _compiler(), not worst, tuple(checked), tuple(outputs),
                           tuple(cap.folding.describe()) if cap.folding else (), seconds,
                           reason, keep, cap.fingerprint,
                           tuple((shape, str(dtype).removeprefix("torch."), str(device))
                                 for shape, dtype, device in flat.state_meta),
                           _specs(flat), file_digest(root, package.name))


def _package(cap: LoadedCapture, module: Any, inputs: tuple[list[torch.Tensor], list[torch.Tensor]],
             package: Path, configs: Mapping[str, Any] | None) -> None:
    """``module`` exported on ``inputs`` (the member's tensors, the call's) and
    packaged by AOTInductor at ``package``, both inside what the capture needs
    around it.  AOTInductor lowers the exported program to ATen ops when it
    compiles it, and a state the capture does not carry in its graph (an
    autocast replayed around the trace, ``replay="ambient"``) takes effect on
    the graph only while it is in force: lowered outside it, the casts it
    makes are never recorded, and the package computes and returns float32
    where the capture returns bfloat16."""
    state, tensors = inputs
    with torch.no_grad(), cap.replay():
        exported = lifted_export(module, tuple(state + tensors), len(state), cap.folding)
        # packaged under a fresh name in the directory and renamed over the
        # package's: a symlink planted there is replaced, never written through
        written_inside(package, lambda tmp: torch._inductor.aoti_compile_and_package(
            exported, package_path=str(tmp),
            inductor_configs=dict(configs) if configs is not None else None))


def _named(o: OutputError, flat: Flat) -> str:
    if o.of == "state" and o.index < len(flat.state_names):
        return f"{flat.state_names[o.index]} as the call leaves it"
    return f"{o.of} {o.index}" if o.of == "output" else f"input {o.index} as the call leaves it"


def _check(cap: LoadedCapture, flat: Flat, package: Path, state: list[torch.Tensor],
           call: tuple[list[Any], list[int]], device: str
           ) -> tuple[list[str], list[OutputError]]:
    """The package run against the uncompiled program at every size point;
    each output's worst error.  ``call``: the example call's leaves, and the
    positions of those the package takes (its tensors)."""
    leaves, taken = call
    loader = aoti_package_loader(str(package), device)
    specs = [s for _, s in cap.sidecar.inputs]
    tensors = [leaves[i] for i in taken]
    points = [(describe(specs), tensors)]
    if len(specs) == len(tensors) and all(tuple(s.shape) == tuple(t.shape)
                                          for s, t in zip(specs, tensors)):
        points += [(label, inputs_of(made)) for label, made in size_points(cap.folding, specs)]
    floor = compute_tolerance(cap.program)
    worst: dict[tuple[str, int], OutputError] = {}
    for _, values in points:
        # each side on its own copies: a program that writes its buffers or
        # inputs (BatchNorm's running stats) must write the same values
        ref_state, ref_values = _copies(state), _copies(values)
        got_state, got_values = _copies(state), _copies(values)
        full = list(leaves)
        for i, t in zip(taken, ref_values):
            full[i] = t
        with torch.no_grad(), cap.replay():
            want = flat.fn(*ref_state, *full)
            got = loader.run([*got_state, *got_values])
        want = list(want) if isinstance(want, (list, tuple)) else [want]
        found = compare(got, want, floor) + \
            [o for o in compare(got_state, ref_state, floor, "state") + compare(
                got_values, ref_values, floor, "input") if o.error > 0 or
             not _same(state[o.index] if o.of == "state" else values[o.index],
                       got_state[o.index] if o.of == "state" else got_values[o.index])]
        for o in found:
            key = (o.of, o.index)
            if key not in worst or o.error > worst[key].error:
                worst[key] = o
    return [label for label, _ in points], [worst[k] for k in sorted(worst)]


def _copies(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.clone() for t in tensors]


def _same(before: torch.Tensor, after: torch.Tensor) -> bool:
    """Whether ``after`` still equals the value ``before`` holds (not written)."""
    return bool(torch.equal(before, after))


def _specs(flat: Flat) -> tuple[Any, Any] | None:
    """The program's in- and out-spec as torch writes them (parsed), or ``None``."""
    try:
        return (json.loads(pytree.treespec_dumps(flat.in_spec)),
                json.loads(pytree.treespec_dumps(flat.out_spec)))
    except Exception:  # a container torch's writer does not know: read the program
        return None


def _compiler() -> str:
    """The C++ compiler Inductor builds with, and its version (``g++ 12.2.0``)."""
    try:
        from torch._inductor import cpp_builder

        name = str(cpp_builder.get_cpp_compiler())
        info = str(cpp_builder.get_compiler_version_info(name))
    except Exception:  # an Inductor without these helpers: the name is unknown
        return "unknown"
    found = re.search(r"version (\d+(?:\.\d+)+)", info)
    return f"{Path(name).name} {found.group(1) if found else ''}".strip()


def _record(root: Path, cap: LoadedCapture, record: CompiledProgram) -> None:
    """Write ``record`` into the capture's manifest entry (atomically)."""
    path = root / MANIFEST_NAME
    doc = json.loads(read_inside(root, MANIFEST_NAME))
    for entry in doc["captures"]:
        if entry.get("artifact") == cap.path.name:
            entry["compiled"] = record.to_json()
            break
    write_manifest(path, doc)
