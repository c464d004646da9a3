"""A capture's ahead-of-time compiled program, as the manifest records it.

``ctxreplay compile DIR`` writes, beside each capture it compiles, an
AOTInductor package and a ``compiled`` record in the capture's manifest
entry: the package's file name, the member tensors the program takes
first (by name, in order), what it depends on (``compiled_environment``:
torch and its git revision, the machine and CPU ISA, the accelerator and
its capability; the C++ compiler that built it) and the verification
against the uncompiled program (the worst error per output and the
tolerance it was held to: numbers only).  ``unusable`` says why a record
cannot serve in this process -- install then runs the uncompiled capture.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from .._base.environment import COMPILED_GUARDED, compiled_environment
from .._base.jsonread import read_bool, read_int, read_list, read_mapping, read_str
from .._base.safefiles import read_digest
from .trust import changed_files

__all__ = ["COMPILED_FORMAT", "COMPILED_REASONS", "CompiledProgram", "OutputError"]

#: the one compiled format: an AOTInductor package (``aoti_compile_and_package``)
COMPILED_FORMAT = "aoti"

#: why a compiled program is not used (install runs the uncompiled capture):
#: its verification failed, its package file is gone, it was built for
#: another environment, this process cannot load it, it takes other member
#: tensors than the capture's program here, ``install(compile=...)``
#: compiles the programs itself -- or, for some calls only, autograd records
#: the call (grad mode on, a tensor that requires grad), which a compiled
#: program cannot serve
#: -- or its package is not what its record's digest says (``compiled_changed``),
#: or its record holds no digest (``compiled_unverified``): a package is native
#: code, run only where its digest holds
COMPILED_REASONS = ("compiled_failed", "compiled_missing", "compiled_environment",
                    "compiled_load_failed", "compiled_mismatch", "compiled_overridden",
                    "compiled_autograd", "compiled_changed", "compiled_unverified")


@attrs.frozen
class OutputError:
    """One value's worst error over the checked calls: ``max |compiled - uncompiled|
    / max |uncompiled|`` (0 where both are 0; exact for integer and bool values),
    and the tolerance its dtype is held to.  ``of``: ``"output"`` (``index``
    into the program's outputs), ``"state"`` (into ``CompiledProgram.state``: a
    member tensor as the call leaves it, which a program that writes its
    buffers changes) or ``"input"`` (into the call's tensors, as the call leaves
    them)."""

    index: int
    dtype: str
    error: float
    tolerance: float
    of: str = "output"

    @property
    def ok(self) -> bool:
        return self.error <= self.tolerance

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "dtype": self.dtype, "error": self.error,
                "tolerance": self.tolerance, "of": self.of}


def _float(value: object, path: str) -> float:
    if type(value) not in (int, float) or not math.isfinite(float(value)):  # type: ignore[arg-type]
        raise ValueError(f"{path}: expected a finite number, got {value!r}")
    return float(value)  # type: ignore[arg-type]


def _state_meta(value: object, path: str) -> tuple[tuple[tuple[int, ...], str, str], ...]:
    out = []
    for i, item in enumerate(read_list(value, path)):
        where = f"{path}[{i}]"
        triple = read_list(item, where)
        if len(triple) != 3:
            raise ValueError(f"{where}: expected [shape, dtype, device]")
        shape = tuple(read_int(n, f"{where}[0][{j}]", lo=0)
                      for j, n in enumerate(read_list(triple[0], f"{where}[0]")))
        out.append((shape, read_str(triple[1], f"{where}[1]"),
                    read_str(triple[2], f"{where}[2]")))
    return tuple(out)


def _specs(value: object, path: str) -> tuple[Any, Any] | None:
    """``[in_spec, out_spec]`` as torch's ``treespec_dumps`` documents (each
    ``[protocol, node]``), checked for shape here and by torch's reader at use."""
    if value is None:
        return None
    pair = read_list(value, path)
    if len(pair) != 2:
        raise ValueError(f"{path}: expected [in_spec, out_spec]")
    for i, spec in enumerate(pair):
        doc = read_list(spec, f"{path}[{i}]")
        if len(doc) != 2:
            raise ValueError(f"{path}[{i}]: expected [protocol, tree spec]")
        read_int(doc[0], f"{path}[{i}][0]", lo=0)
        read_mapping(doc[1], f"{path}[{i}][1]")
    return pair[0], pair[1]


@attrs.frozen
class CompiledProgram:
    """The ``compiled`` record of a manifest entry (see the module docstring)."""

    package: str
    """The package's file name, in the manifest's directory."""
    state: tuple[str, ...]
    """The member tensors the program takes before the call's tensors, in order."""
    environment: Mapping[str, Any]
    """``compiled_environment()`` where it was compiled."""
    compiler: str
    """The C++ compiler that built it (recorded, not compared)."""
    ok: bool
    """Whether every checked output was within its tolerance."""
    checked: tuple[str, ...]
    """The sizes it was checked at (``"args[0]: 4x7x32"``; one entry for fixed sizes)."""
    outputs: tuple[OutputError, ...]
    """Each output's worst error and tolerance, and those of the member tensors
    and call tensors a checked call left different (a program that writes
    them: its compiled program must write the same)."""
    dynamic: tuple[str, ...] = ()
    """A folded capture's dynamic dimensions it was compiled with (``Folding.describe``)."""
    seconds: float = 0.0
    """How long compiling it took."""
    reason: str | None = None
    """Why it failed its check, in words (``None`` when ``ok``)."""
    leaves: tuple[int, ...] | None = None
    """The positions of the call's leaves it takes (its tensors), where the call
    also has constant leaves (a ``None`` keyword argument) the graph holds itself;
    ``None``: every leaf."""
    fingerprint: str = ""
    """The fingerprint of the capture it was compiled from: a capture saved
    again over the same file is another program."""
    state_meta: tuple[tuple[tuple[int, ...], str, str], ...] = ()
    """Shape, dtype and device of each member tensor it takes (``state`` order)."""
    specs: tuple[Any, Any] | None = None
    """The capture's program's input and output structure (``treespec_dumps``
    documents, parsed: containers and keyword names, no values), so that
    install can run the compiled program without reading the uncompiled one
    first; ``None`` where torch cannot write it."""
    digest: str = ""
    """The package file's content digest, ``sha256:<hex>``, checked before it
    is loaded; empty in a record written before digests were recorded."""
    refused: tuple[str, str] | None = attrs.field(default=None, eq=False)
    """Why its package may not run here although the record holds (``(reason
    code, words)``: ``compiled_changed``, ``compiled_unverified``), found by
    ``checked_in`` when the directory was loaded; not written."""

    @property
    def error(self) -> float:
        """The worst relative error over the outputs (and the tensors written)."""
        return max((o.error for o in self.outputs), default=0.0)

    def to_json(self) -> dict[str, Any]:
        return {"format": COMPILED_FORMAT, "package": self.package, "state": list(self.state),
                "environment": dict(self.environment), "compiler": self.compiler,
                "ok": self.ok, "checked": list(self.checked),
                "outputs": [o.to_json() for o in self.outputs], "dynamic": list(self.dynamic),
                "seconds": round(self.seconds, 3), "reason": self.reason,
                "leaves": None if self.leaves is None else list(self.leaves),
                "fingerprint": self.fingerprint,
                "state_meta": [[list(shape), dtype, device]
                               for shape, dtype, device in self.state_meta],
                "specs": None if self.specs is None else list(self.specs),
                "digest": self.digest}

    @classmethod
    def from_json(cls, value: object, path: str) -> CompiledProgram:
        """The inverse of ``to_json``; ``ValueError`` naming the bad field."""
        keys = {"format", "package", "state", "environment", "compiler", "ok", "checked",
                "outputs", "dynamic", "seconds", "reason", "leaves", "fingerprint",
                "state_meta", "specs", "digest"}
        doc = read_mapping(value, path, keys=keys, required=keys - {
            "dynamic", "seconds", "reason", "leaves", "fingerprint", "state_meta", "specs",
            "digest"})
        read_str(doc["format"], f"{path}.format", choices={COMPILED_FORMAT})
        package = read_str(doc["package"], f"{path}.package", max_len=1024)
        if Path(package).name != package or package in ("", ".", ".."):
            raise ValueError(f"{path}.package: {package!r} must be a bare file name")
        env = read_mapping(doc["environment"], f"{path}.environment", required={"torch"})
        for k, v in env.items():
            if v is not None:
                read_str(v, f"{path}.environment.{k}", max_len=256)
        outputs = []
        for i, o in enumerate(read_list(doc["outputs"], f"{path}.outputs")):
            w = f"{path}.outputs[{i}]"
            m = read_mapping(o, w, keys={"index", "dtype", "error", "tolerance", "of"},
                             required={"index", "dtype", "error", "tolerance"})
            outputs.append(OutputError(read_int(m["index"], f"{w}.index", lo=0),
                                       read_str(m["dtype"], f"{w}.dtype"),
                                       _float(m["error"], f"{w}.error"),
                                       _float(m["tolerance"], f"{w}.tolerance"),
                                       read_str(m.get("of", "output"), f"{w}.of",
                                                choices={"output", "state", "input"})))
        reason = doc.get("reason")
        leaves = doc.get("leaves")
        return cls(
            package=package,
            state=tuple(read_str(s, f"{path}.state[{i}]", max_len=4096)
                        for i, s in enumerate(read_list(doc["state"], f"{path}.state"))),
            environment=dict(env),
            compiler=read_str(doc["compiler"], f"{path}.compiler", max_len=256),
            ok=read_bool(doc["ok"], f"{path}.ok"),
            checked=tuple(read_str(s, f"{path}.checked[{i}]", max_len=4096)
                          for i, s in enumerate(read_list(doc["checked"], f"{path}.checked"))),
            outputs=tuple(outputs),
            dynamic=tuple(read_str(s, f"{path}.dynamic[{i}]", max_len=4096)
                          for i, s in enumerate(read_list(doc.get("dynamic", []),
                                                          f"{path}.dynamic"))),
            seconds=_float(doc.get("seconds", 0.0), f"{path}.seconds"),
            reason=None if reason is None else read_str(reason, f"{path}.reason",
                                                        max_len=4096),
            leaves=None if leaves is None else tuple(
                read_int(v, f"{path}.leaves[{i}]", lo=0)
                for i, v in enumerate(read_list(leaves, f"{path}.leaves"))),
            fingerprint=read_str(doc.get("fingerprint", ""), f"{path}.fingerprint"),
            state_meta=_state_meta(doc.get("state_meta", []), f"{path}.state_meta"),
            specs=_specs(doc.get("specs"), f"{path}.specs"),
            digest="" if doc.get("digest", "") == "" else read_digest(doc["digest"],
                                                                    f"{path}.digest"))

    def checked_in(self, directory: Path) -> CompiledProgram:
        """This record with ``refused`` set where its package in ``directory``
        is not what its digest says, or no digest is recorded
        (``package_refused``)."""
        why = self.package_refused(directory)
        return self if why is None else attrs.evolve(self, refused=why)

    def package_refused(self, directory: Path) -> tuple[str, str] | None:
        """Why the package in ``directory`` may not be loaded -- ``(reason code,
        words)`` -- read once now; ``None`` when it holds its digest (or is
        missing: ``unusable`` says so)."""
        if not self.digest:
            return "compiled_unverified", f"its record holds no digest of its package " \
                f"{self.package} (compiled by a ctxreplay before they were recorded): a " \
                "package is native code, run only where its digest holds; compile again"
        if not (directory / self.package).exists() and \
                not (directory / self.package).is_symlink():
            return None
        why = changed_files(directory, {self.package: self.digest}, (self.package,))
        return None if why is None else ("compiled_changed", why)

    def unusable(self, directory: Path, fingerprint: str | None = None
                 ) -> tuple[str, str] | None:
        """Why this program cannot serve here -- ``(reason code, words)``, the
        code one of ``COMPILED_REASONS`` -- or ``None`` when it can.
        ``fingerprint``: the capture's, where known (it must be the one compiled)."""
        if self.refused is not None:
            return self.refused
        if fingerprint is not None and self.fingerprint not in ("", fingerprint):
            return "compiled_mismatch", "it was compiled from another capture than the one " \
                "saved now"
        if not self.ok:
            return "compiled_failed", f"its check against the uncompiled program failed " \
                f"({self.reason or 'an output beyond its tolerance'})"
        if not (directory / self.package).is_file():
            return "compiled_missing", f"its package {self.package} is missing"
        now = compiled_environment(str(self.environment.get("device") or "cpu"))
        for field in COMPILED_GUARDED:
            was = self.environment.get(field)
            if was != now.get(field):
                return "compiled_environment", f"compiled for {field} {was!r}, this " \
                    f"process has {now.get(field)!r}"
        return None
