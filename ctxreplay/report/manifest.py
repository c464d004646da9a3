"""Every capture of a report on disk at once: one artifact file (a ``.pt2`` for a
torch.export program) and its sidecar per capture, and one ``manifest.json``
that indexes them.

The manifest is metadata only, like the report: per capture its record
(``Capture.to_json()``: scope, members, variant, signatures, snapshot,
fingerprint, fidelity), the files that hold it -- or, for a capture that
no artifact format can hold, the reason code -- and for the report its
failures, problems and the versions it was made with (ctxreplay, torch,
Python, device type and capability, autocast op policy).
``read_manifest`` reads one back strictly: every field it uses is checked,
a malformed one raises ``ValueError`` naming its JSON path.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import attrs

from .._base.environment import full_environment
from .._base.jsonread import loads, read_bool, read_int, read_list, read_mapping, read_str
from .._base.progress import Progress
from .._base.safefiles import file_digest, read_digest, write_inside
from .._base.version import __version__
from ..artifacts.formats import format_for
from ..artifacts.program import BRIEF_KEYS, BriefFields, ProgramMeta
from ..artifacts.saving import SavedArtifact
from ..artifacts.sidecar import ArtifactError, sidecar_path
from ..capture.results import Capture, CaptureFailure, Notice, Problem
from ..fidelity.verify import fidelity_status

__all__ = ["MANIFEST_NAME", "MANIFEST_SCHEMA", "NOT_SAVED_REASONS", "ManifestDoc", "ManifestEntry",
           "SavedManifest", "read_manifest", "save_all"]

_log = logging.getLogger("ctxreplay")

MANIFEST_SCHEMA = "ctxreplay.manifest/1"
MANIFEST_NAME = "manifest.json"

#: why ``save_all`` listed a capture as not saved: ``Capture.save`` refused it
#: (an ``ArtifactError`` reason), or another rank holds its artifact
NOT_SAVED_REASONS = ("backend_not_savable", "serialize_failed", "not_on_this_rank")


class _Report(Protocol):
    """What saving needs of a report (``ctxreplay.CaptureReport`` has it)."""

    @property
    def captures(self) -> tuple[Capture, ...]: ...
    @property
    def failures(self) -> tuple[CaptureFailure, ...]: ...
    @property
    def problems(self) -> tuple[Problem, ...]: ...
    @property
    def notices(self) -> tuple[Notice, ...]: ...
    @property
    def probes(self) -> tuple[str, ...]: ...
    @property
    def settings(self) -> dict[str, Any]: ...
    @property
    def ok(self) -> bool: ...
    @property
    def distributed(self) -> dict[str, Any] | None: ...
    @property
    def options(self) -> Any: ...


@attrs.frozen
class SavedManifest:
    """What ``report.save_all(directory)`` wrote.

    ``saved``: one :class:`ctxreplay.artifacts.SavedArtifact` per capture written by
    this process; ``not_saved``: ``(scope, variant, reason)`` of each
    capture that could not be written (no registered artifact format holds
    its artifact -- the built-in ``.pt2`` holds ``torch.export`` programs:
    ``backend_not_savable``; in a distributed report, a
    capture whose rank is not in the group now: ``not_on_this_rank``),
    recorded in the manifest with that reason.  ``elsewhere``: in a
    distributed report, ``(scope, variant, rank, saved file ok)`` of the
    captures the other ranks wrote.  Open the directory again with
    :func:`ctxreplay.load`.
    """

    directory: Path
    """The directory written into."""
    manifest: Path
    """Its ``manifest.json``."""
    saved: tuple[SavedArtifact, ...]
    """One ``SavedArtifact`` per capture this process wrote."""
    not_saved: tuple[tuple[str, int, str], ...]
    """``(scope, variant, reason)`` of each capture not written (a reason of
    ``NOT_SAVED_REASONS``)."""
    elsewhere: tuple[tuple[str, int, int, bool], ...] = ()
    """In a distributed report: ``(scope, variant, rank, saved file ok)`` of the captures the other
    ranks wrote."""

    @property
    def ok(self) -> bool:
        """Every capture was written and its file reproduces the live call."""
        return not self.not_saved and all(s.fidelity.ok for s in self.saved) and \
            all(e[3] for e in self.elsewhere)


def _file_stem(index: int, scope: str, variant: int) -> str:
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", scope).strip("._") or "module"
    return f"{index:03d}-{slug[:80]}-v{variant}"


def save_all(report: _Report, directory: str | os.PathLike[str], *,
             verify: bool = True,
             progress: Callable[[int, int, str], None] | None = None) -> SavedManifest:
    """Write every capture of ``report`` and ``manifest.json`` into ``directory``
    (created if missing).  See :meth:`ctxreplay.CaptureReport.save_all`.

    A distributed report: each rank writes the captures it holds (its
    ``Capture.rank``), the ranks exchange what they wrote, and the group's
    first rank writes the manifest; every rank must call it (as with
    ``finalize()``), and ``directory`` must be one every rank sees."""
    root = Path(os.fspath(directory))
    if root.exists() and not root.is_dir():
        raise NotADirectoryError(f"save_all: {str(root)!r} exists and is not a directory")
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    group = _Group.of(report)
    entries, saved = _save_here(report, root, group, verify, progress)
    elsewhere = _gather(report, group, entries)
    not_saved = [(c.scope, c.variant, entries[i]["not_saved"] or "not_on_this_rank")
                 for i, c in enumerate(report.captures)
                 if i not in entries or entries[i]["not_saved"] is not None]
    target = root / MANIFEST_NAME
    if group is None or group.first:
        write_manifest(target, _manifest_doc(report, entries))
    if group is not None:
        group.gather(None)  # no rank returns before the manifest is there
    result = SavedManifest(root, target, tuple(saved), tuple(not_saved), tuple(elsewhere))
    _summary(result, len(report.captures), time.perf_counter() - t0)
    return result


def _summary(result: SavedManifest, total: int, seconds: float) -> None:
    """One logging line: what was written and how each file was checked."""
    checks = [s.fidelity.checked for s in result.saved]
    _log.info("save_all: %d of %d captures written to %s in %.1f s (%d checked by their graph, "
              "%d run, %d unchecked, %d not ok, %d not saved)",
              len(result.saved), total, result.directory, seconds,
              checks.count(("graph",)), checks.count(("saved",)), checks.count(()),
              sum(not s.fidelity.ok for s in result.saved), len(result.not_saved))


#: a manifest entry before the capture is written (or for a capture not written)
_NO_FILES: dict[str, Any] = {"artifact": None, "sidecar": None, "lowered": None,
                             "saved_fidelity": None, "not_saved": None}


def _save_here(report: _Report, root: Path, group: _Group | None, verify: bool,
               callback: Callable[[int, int, str], None] | None
               ) -> tuple[dict[int, dict[str, Any]], list[SavedArtifact]]:
    """Write the captures this process holds: ``(report index -> manifest
    entry, what was written)``."""
    entries: dict[int, dict[str, Any]] = {}
    saved: list[SavedArtifact] = []
    mine = [i for i, c in enumerate(report.captures)
            # the rank that holds a capture writes it
            if group is None or c.rank is None or c.rank == group.rank]
    progress = Progress(len(mine), 0, callback, task="save_all", verb="saved", unit="capture")
    try:
        for i in mine:
            c = report.captures[i]
            entries[i] = _save_one(report, root, i, c, verify, group is None, saved)
            progress.step(f"{c.scope}#{c.variant}")
    finally:
        progress.close()
    return entries, saved


def _save_one(report: _Report, root: Path, i: int, c: Capture, verify: bool, alone: bool,
              saved: list[SavedArtifact]) -> dict[str, Any]:
    """Write capture ``i`` (``alone``: no process group is up); its manifest
    entry (``saved`` gains what was written)."""
    if report.distributed and c.rank is not None and alone and c.artifact is None:
        return {**_NO_FILES, "not_saved": "not_on_this_rank"}
    # the file takes the suffix of the format that will hold it; where
    # none can, Capture.save refuses it with the reason
    fmt, _ = format_for(c.artifact)
    path = root / f"{_file_stem(i, c.scope, c.variant)}{fmt.suffix if fmt else ''}"
    try:
        # Capture.save, so whatever wraps it (an audit) applies here too
        result = c.save(path, verify=verify)
    except ArtifactError as exc:
        return {**_NO_FILES, "not_saved": exc.reason}
    saved.append(result)
    digests = {result.path.name: result.digest,
               result.sidecar.name: file_digest(root, result.sidecar.name)}
    return {**_NO_FILES, "artifact": result.path.name, "sidecar": result.sidecar.name,
            "lowered": result.lowered, "saved_fidelity": result.fidelity.to_json(),
            "digests": digests}


def _gather(report: _Report, group: _Group | None, entries: dict[int, dict[str, Any]]
            ) -> list[tuple[str, int, int, bool]]:
    """In a distributed report, add the other ranks' entries to ``entries``;
    ``(scope, variant, rank, saved file ok)`` of each."""
    elsewhere: list[tuple[str, int, int, bool]] = []
    if group is None:
        return elsewhere
    for rank, theirs in group.gather(dict(entries)):
        for i, entry in theirs.items():
            if rank != group.rank:
                c = report.captures[i]
                entries[i] = entry
                ok = entry["not_saved"] is None and bool(entry["saved_fidelity"]["ok"])
                elsewhere.append((c.scope, c.variant, rank, ok))
    return elsewhere


def _manifest_doc(report: _Report, entries: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The manifest: each capture's record with its entry, and the report's
    metadata."""
    captures = [{"capture": c.to_json(),
                 **entries.get(i, {**_NO_FILES, "not_saved": "not_on_this_rank"})}
                for i, c in enumerate(report.captures)]
    doc = {
        "schema": MANIFEST_SCHEMA,
        "ctxreplay": __version__,
        "environment": full_environment(),
        "ok": report.ok,
        "probes": list(report.probes),
        "settings": dict(report.settings),
        "captures": captures,
        "failures": [f.to_json() for f in report.failures],
        "problems": [p.to_json() for p in report.problems],
        "notices": [n.to_json() for n in report.notices],
    }
    if report.distributed:
        doc["distributed"] = dict(report.distributed)
    return doc


class _Group:
    """The process group of a distributed report, while it is still up."""

    def __init__(self, group: Any, rank: int, ranks: list[int]) -> None:
        self.group, self.rank, self.ranks = group, rank, ranks
        self.first = rank == ranks[0]

    @classmethod
    def of(cls, report: _Report) -> _Group | None:
        info = report.distributed
        if not info:
            return None
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return None
        ranks = [int(r) for r in info.get("group_ranks", [])]
        if dist.get_rank() not in ranks:
            return None
        options = report.options
        group = getattr(options, "group", None) or dist.group.WORLD
        return cls(group, dist.get_rank(), ranks)

    def gather(self, obj: Any) -> list[tuple[int, Any]]:
        import torch.distributed as dist

        out: list[Any] = [None] * len(self.ranks)
        dist.all_gather_object(out, obj, group=self.group)
        return list(zip(self.ranks, out))


def write_manifest(path: Path, doc: Mapping[str, Any]) -> None:
    """Write the document last and atomically: a manifest never names a
    file that is not there yet (a fresh name in its directory, renamed over
    it: a symlink planted at either name is never written through)."""
    write_inside(path, json.dumps(doc, indent=2, sort_keys=True, allow_nan=False).encode())


# -- reading ----------------------------------------------------------------------

@attrs.frozen
class ManifestEntry(BriefFields):
    """One capture as the manifest records it."""

    index: int
    scope: str
    variant: int
    members: tuple[str, ...]
    weights_from: str
    #: what the record says of the program (``Capture.meta``'s codec; outputs
    #: JSON does not rebuild whole read as not known)
    meta: ProgramMeta
    #: ``Fidelity.status`` of the live check
    fidelity: str
    artifact: str | None
    sidecar: str | None
    lowered: bool | None
    #: ``Fidelity.status`` of the saved file's check (``None``: not saved)
    saved: str | None
    not_saved: str | None
    #: the capture's record (``Capture.to_json()``), validated where used
    capture: Mapping[str, Any] = attrs.field(repr=False)
    #: its ahead-of-time compiled program's record (``ctxreplay compile``),
    #: validated where used; ``None``: not compiled
    compiled: Mapping[str, Any] | None = attrs.field(default=None, repr=False)
    #: file name -> its content digest (``sha256:<hex>``) as written, for the
    #: artifact and the sidecar; empty in a manifest written before digests
    #: were recorded (its files are unverified)
    digests: Mapping[str, str] = attrs.field(factory=dict, repr=False)

    @property
    def label(self) -> str:
        return f"{self.scope}#{self.variant}"

@attrs.frozen
class ManifestDoc:
    """A manifest read back by :func:`read_manifest`."""

    path: Path
    ctxreplay_version: str
    environment: Mapping[str, Any]
    ok: bool
    probes: tuple[str, ...]
    entries: tuple[ManifestEntry, ...]
    #: ``(scope, variant, backend, reason)`` of each variant that failed to capture
    failures: tuple[tuple[str, int, str, str], ...]
    #: reason codes of the report's problems
    problems: tuple[str, ...]

    @property
    def directory(self) -> Path:
        return self.path.parent


_TOP_KEYS = {"schema", "ctxreplay", "environment", "ok", "probes", "settings", "captures",
             "failures", "problems", "notices", "distributed"}
_ENTRY_KEYS = {"capture", "artifact", "sidecar", "lowered", "saved_fidelity", "not_saved"}


def _names(value: object, path: str) -> tuple[str, ...]:
    return tuple(read_str(v, f"{path}[{i}]", max_len=4096)
                 for i, v in enumerate(read_list(value, path)))


def _file_name(value: object, path: str) -> str | None:
    if value is None:
        return None
    name = read_str(value, path, max_len=1024)
    if Path(name).name != name or name in ("", ".", ".."):
        raise ValueError(f"{path}: {name!r} must be a bare file name")
    return name


def _entry(value: object, i: int) -> ManifestEntry:
    where = f"$.captures[{i}]"
    doc = read_mapping(value, where, keys=_ENTRY_KEYS | {"compiled", "digests"},
                       required=_ENTRY_KEYS)
    cw = f"{where}.capture"
    cap = read_mapping(doc["capture"], cw, required={
        "scope", "variant", "members", "weights_from", *BRIEF_KEYS, "fidelity", "snapshot",
        "inputs", "outputs"})
    artifact = _file_name(doc["artifact"], f"{where}.artifact")
    side = _file_name(doc["sidecar"], f"{where}.sidecar")
    not_saved = None if doc["not_saved"] is None else read_str(doc["not_saved"],
                                                               f"{where}.not_saved")
    if (artifact is None) != (side is None) or (artifact is None) == (not_saved is None):
        raise ValueError(f"{where}: expected either artifact and sidecar file names or a "
                         "not_saved reason")
    if artifact is not None and side != sidecar_path(artifact).name:
        raise ValueError(f"{where}.sidecar: expected {sidecar_path(artifact).name!r}")
    saved = None if doc["saved_fidelity"] is None else \
        fidelity_status(doc["saved_fidelity"], f"{where}.saved_fidelity")
    return ManifestEntry(
        index=i,
        scope=read_str(cap["scope"], f"{cw}.scope", max_len=4096),
        variant=read_int(cap["variant"], f"{cw}.variant", lo=0),
        members=_names(cap["members"], f"{cw}.members"),
        weights_from=read_str(cap["weights_from"], f"{cw}.weights_from", max_len=4096),
        meta=ProgramMeta.from_json(cap, cw, rebuild_outputs=False),
        fidelity=fidelity_status(cap["fidelity"], f"{cw}.fidelity"),
        artifact=artifact, sidecar=side,
        lowered=None if doc["lowered"] is None else read_bool(doc["lowered"],
                                                              f"{where}.lowered"),
        saved=saved, not_saved=not_saved, capture=cap,
        compiled=None if doc.get("compiled") is None else read_mapping(doc["compiled"],
                                                                      f"{where}.compiled"),
        digests=_digests(doc.get("digests"), f"{where}.digests",
                         tuple(n for n in (artifact, side) if n is not None)))


def _digests(value: object, path: str, files: tuple[str, ...]) -> dict[str, str]:
    """An entry's ``digests``: one per file it names, no other (``{}``: a
    manifest written before digests were recorded)."""
    if value is None:
        return {}
    doc = read_mapping(value, path, keys=set(files), required=set(files))
    return {name: read_digest(doc[name], f"{path}.{name}") for name in files}


def _failure(value: object, i: int) -> tuple[str, int, str, str]:
    where = f"$.failures[{i}]"
    doc = read_mapping(value, where, required={"scope", "variant", "backend", "reason"})
    return (read_str(doc["scope"], f"{where}.scope", max_len=4096),
            read_int(doc["variant"], f"{where}.variant", lo=0),
            read_str(doc["backend"], f"{where}.backend"),
            read_str(doc["reason"], f"{where}.reason"))


def read_manifest(path: str | os.PathLike[str], data: Any = None) -> ManifestDoc:
    """Read ``manifest.json`` (or the directory holding it) strictly.
    ``data``: the document, when the caller has parsed it already."""
    target = Path(os.fspath(path))
    if target.is_dir():
        target = target / MANIFEST_NAME
    if data is None:
        data = loads(target.read_bytes(), "$", source=str(target))
    doc = read_mapping(data, "$", keys=_TOP_KEYS, required=_TOP_KEYS - {"notices", "distributed"})
    schema = read_str(doc["schema"], "$.schema")
    if schema != MANIFEST_SCHEMA:
        raise ValueError(f"$.schema: unsupported schema {schema!r}; expected "
                         f"{MANIFEST_SCHEMA!r}")
    env = read_mapping(doc["environment"], "$.environment", required={"torch"})
    read_str(env["torch"], "$.environment.torch")
    entries = tuple(_entry(e, i) for i, e in enumerate(read_list(doc["captures"],
                                                                 "$.captures")))
    seen: dict[str, int] = {}
    for e in entries:
        for name in (e.artifact, e.sidecar):
            if name is not None and name in seen:
                raise ValueError(f"$.captures[{e.index}]: file {name!r} is also named by "
                                 f"$.captures[{seen[name]}]")
            if name is not None:
                seen[name] = e.index
    problems = tuple(read_str(read_mapping(p, f"$.problems[{i}]", required={"reason"})["reason"],
                              f"$.problems[{i}].reason")
                     for i, p in enumerate(read_list(doc["problems"], "$.problems")))
    return ManifestDoc(
        path=target,
        ctxreplay_version=read_str(doc["ctxreplay"], "$.ctxreplay"),
        environment=env,
        ok=read_bool(doc["ok"], "$.ok"),
        probes=_names(doc["probes"], "$.probes"),
        entries=entries,
        failures=tuple(_failure(f, i) for i, f in enumerate(read_list(doc["failures"],
                                                                      "$.failures"))),
        problems=problems,
    )


def entry_devices(entries: Sequence[Any]) -> set[str]:
    """Device types named by tensor specs anywhere in the given documents."""
    out: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, Mapping):
            t = node.get("tensor")
            if isinstance(t, Mapping) and isinstance(t.get("device"), str):
                out.add(t["device"].split(":")[0])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    for e in entries:
        walk(e)
    return out
