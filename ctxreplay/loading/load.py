"""Using saved captures: ``load`` a manifest directory or one saved capture,
``check`` what it needs against this process (``needs``), call it guarded
(``guard``), run it with a member's weights (``weights``).
"""

from __future__ import annotations

import ast
import functools
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import attrs
from torch import nn

from .._base.safefiles import read_digest
from ..artifacts.formats import get_format
from ..artifacts.program import BriefFields, ProgramMeta
from ..artifacts.roles import OutputRole
from ..artifacts.sidecar import (
    ArtifactError,
    ArtifactSidecar,
    read_sidecar,
    sidecar_path,
    warn_unknown,
)
from ..capture.mutation import ARGUMENT_FIELD
from ..core.snapshots import ContextSnapshot, Unresolved
from ..fidelity.verify import combined_status
from ..report.manifest import ManifestEntry, read_manifest
from ..specs.dims import Folding
from ..specs.signature import CallSpec, Spec
from ..specs.specjson import call_unmatched, resolve_opaque, spec_from_json
from .compiled import CompiledProgram
from .detect import detect
from .guard import GuardedCapture
from .needs import (
    Difference,
    Needs,
    Probes,
    check_needs,
    devices_of,
    document_fidelity,
    merge_differences,
    probe_map,
)
from .trust import UNVERIFIED, FileChangedError, changed_files, verified_bytes
from .weights import Weights, bind_weights

_log = logging.getLogger("ctxreplay")

#: the most threads ``load`` hashes a directory's artifacts on
_HASHERS = 4

__all__ = ["LoadedCapture", "LoadedManifest", "load"]

@attrs.frozen(eq=False)
class LoadedCapture(BriefFields):
    """One saved capture, opened by :func:`ctxreplay.load`.

    Its program holds the weights of ``weights_from`` -- the first member
    that ran the variant; run it for another member with
    ``module(weights=member)``.  ``check()`` says what differs between now
    and what it needs; ``guarded()`` is a callable that checks on every call;
    ``replay()`` establishes what it needs around a block of code.
    """

    path: Path
    """The artifact file (a ``.pt2`` for a torch.export program)."""
    sidecar: ArtifactSidecar = attrs.field(repr=False)
    """Its sidecar, read back."""
    members: tuple[str, ...]
    """The blocks the capture stands for."""
    weights_from: str
    """The member whose weights the program holds."""
    fidelity: str
    """``Fidelity.status`` of the live check and the saved file's check together: ``"ok"``,
    ``"ok_with_needs"`` (reproduces where its ``ambient_only`` states hold), ``"failed"`` or
    ``"unchecked"``."""
    environment: Mapping[str, Any] = attrs.field(repr=False)
    """Versions, device and autocast op policy it was made with."""
    merged: tuple[int, ...] = ()
    """Variants merged into this capture (``Capture.merged``)."""
    compiled: CompiledProgram | None = attrs.field(default=None, repr=False)
    """Its ahead-of-time compiled program (``ctxreplay compile``), beside ``path``;
    ``None``: not compiled."""
    digest: str | None = attrs.field(default=None, repr=False)
    """The artifact file's digest as its manifest (or, loaded alone, its
    sidecar) recorded it, ``sha256:<hex>``; the program is read only from
    bytes that hold it.  ``None``: none recorded -- the files are unverified
    (``check()`` says so)."""
    _cache: dict[str, Any] = attrs.field(factory=dict, repr=False, alias="cache")

    @property
    def scope(self) -> str:
        """The capture's variant table."""
        return self.sidecar.scope

    @property
    def variant(self) -> int:
        """The capture's variant number."""
        return self.sidecar.variant

    @property
    def label(self) -> str:
        """``scope#variant``."""
        return f"{self.scope}#{self.variant}"

    @property
    def meta(self) -> ProgramMeta:
        """What its sidecar records of the program (``Capture.meta``'s codec:
        backend, binding, fingerprint, embedded, ambient_only, output_roles)."""
        return self.sidecar.meta

    @property
    def output_roles(self) -> tuple[OutputRole, ...] | None:
        """What each output of the saved program's graph is, in order: the
        call's own output or a write of state (``None``: not recorded)."""
        return self.sidecar.output_roles

    @property
    def folding(self) -> Folding | None:
        """The dynamic sizes of a folded capture and the ranges it was
        verified over (``Capture.folding``); ``None`` for fixed sizes."""
        return self.sidecar.folding

    @property
    def snapshot(self) -> ContextSnapshot:
        """The context of the live call (unknown probes as opaque states)."""
        return self.sidecar.snapshot

    @property
    def ambient_only(self) -> tuple[str, ...]:
        """Probes whose non-neutral state must be re-established around each call (``check()`` says
        whether it holds; ``replay()`` establishes it)."""
        return self.sidecar.meta.ambient_only

    @property
    def identities(self) -> tuple[tuple[str, str], ...]:
        """``(member, identity digest)`` when it ran (``Capture.identities``)."""
        return self.sidecar.identities

    @property
    def ignore_attributes(self) -> tuple[str, ...]:
        """Attributes left out of the members' identities."""
        return self.sidecar.ignore_attributes

    @property
    def mutates_argument(self) -> bool:
        """Whether its check found the forward changing an argument object
        in Python (a ``Mismatch`` of field ``argument``: a cache growing),
        which no run of the program repeats."""
        return bool(self._argument_changes())

    @property
    def needs(self) -> Needs:
        """What the guard checks (see :func:`ctxreplay.load`)."""
        needs = self._cache.get("needs")
        if needs is None:
            side = self.sidecar
            specs = [s for _, s in side.inputs] + list(side.outputs or ())
            context = side.document.get("context")
            needs = Needs(self.label, side.snapshot, side.ambient_only,
                          dict(context) if isinstance(context, Mapping) else {},
                          self.environment, devices_of(specs), self.fidelity)
            self._cache["needs"] = needs
        return needs

    @property
    def verified(self) -> bool:
        """Whether its files were checked against recorded digests (``digest``)."""
        return self.digest is not None

    @property
    def program(self) -> Any:
        """The artifact, read by its format (loaded once, on first use): for a
        ``.pt2``, the ``torch.export.ExportedProgram``, read with nothing in
        the file run.  The bytes read are checked against ``digest`` first:
        ``FileChangedError`` naming the file where they differ."""
        program = self._cache.get("program")
        if program is None:
            data = verified_bytes(self.path.parent, self.path.name, self.digest)
            program = get_format(self.sidecar.format).load_bytes(data, str(self.path))
            self._cache["program"] = program
        return program

    def signature(self) -> CallSpec | None:
        """The captured call's signature, or ``None`` where the document does
        not carry it fully (an object argument, a string constant)."""
        try:
            return self.sidecar.signature()
        except ArtifactError:
            return None

    def call_document(self) -> dict[str, Any] | None:
        """The captured call's signature as its document writes it
        (``{"args": [...], "kwargs": [...]}``), where a live call in this
        process can be compared with it (``spec_to_json`` of the live call's
        spec equal to it); ``None`` where ``unmatched()`` says why not."""
        if self.unmatched() is not None:
            return None
        inputs = self.sidecar.document["inputs"]
        return {"args": inputs["args"], "kwargs": inputs["kwargs"]}

    def unmatched(self) -> str | None:
        """Why no live call can be compared with the captured one here -- the
        first part of its signature the document does not key (an object of
        a class defined inside a function, a constant compared by identity)
        -- or ``None`` when every part can be."""
        found = self._cache.get("unmatched", False)
        if found is False:
            found = self._cache["unmatched"] = call_unmatched(self.sidecar.document["inputs"])
        return found if isinstance(found, str) else None

    def outputs(self) -> Spec | None:
        """The live call's output structure, or ``None`` where the document
        does not carry it fully."""
        doc = self.sidecar.document.get("outputs")
        if doc is None:
            return None
        try:
            return resolve_opaque(spec_from_json(doc, "$.outputs"))
        except ValueError:
            return None

    def module(self, weights: Weights = None) -> nn.Module:
        """The program as a module: with its own weights (``weights_from``'s),
        or with another member's.

        Args:
            weights: a member module or its state dict (``None``: the
                program's own weights).

        Raises:
            WeightsError: the weights do not fit the program."""
        return bind_weights(self.program, weights, self.binding)

    def example_inputs(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Fresh inputs of the recorded signature (``ArtifactSidecar.example_inputs``)."""
        return self.sidecar.example_inputs()

    def check(self, *, ignore: Iterable[str] = ()) -> tuple[Difference, ...]:
        """What differs between now and what this capture needs, one
        :class:`Difference` per probe or field, and why ``install`` can
        never dispatch it where the files say so (kind ``dispatch``: its
        forward changes an argument object, a part of its signature no
        live call can be compared with); empty when all holds.

        Args:
            ignore: probe names not to check (you vouch for them)."""
        return check_needs(self.needs, ignore) + self.undispatchable() + self.unverified()

    def unverified(self) -> tuple[Difference, ...]:
        """A ``files`` difference where no digest of its files is recorded
        (``verified`` false); empty otherwise."""
        if self.verified:
            return ()
        return (Difference(self.path.name, "recorded digests of its files", UNVERIFIED,
                           "files", (self.label,)),)

    def undispatchable(self) -> tuple[Difference, ...]:
        """Why ``install`` never dispatches this capture, whatever the model
        and the state (``Difference.kind`` ``dispatch``, ``field`` the reason
        code ``DispatchStats`` counts); empty when nothing in its files says."""
        label = (self.label,)
        out = []
        changed = self._argument_changes()
        if changed:
            out.append(Difference(
                "mutates_argument", "a forward that leaves its argument objects as they were",
                f"its forward changes an argument object in Python ({changed[0]}"
                f"{f' and {len(changed) - 1} more' if len(changed) > 1 else ''}), which no "
                "run of the graph repeats", "dispatch", label))
        why = self.unmatched() or self._outputs_unbuilt()
        if why is not None:
            out.append(Difference("not_rebuildable", "a signature a live call can be compared "
                                  "with", why, "dispatch", label))
        return tuple(out)

    def _argument_changes(self) -> list[str]:
        """The argument changes its check found, as it words them (types and
        attribute names: ``DynamicCache.layers[0].keys: assigned (new Tensor)``)."""
        fid = self.sidecar.document.get("fidelity")
        found = fid.get("mismatches") if isinstance(fid, Mapping) else None
        out = [str(m.get("live")) for m in (found if isinstance(found, list) else ())
               if isinstance(m, Mapping) and m.get("field") == ARGUMENT_FIELD]
        # a program that returns the forward's assignments to argument
        # objects after its outputs: a loaded capture does not write them back
        assigned = self.sidecar.document.get("assigned")
        paths = assigned.get("named") if isinstance(assigned, Mapping) else None
        return out + [f"{p}: assigned (new Tensor), a program output a loaded capture does "
                      "not write back" for p in (paths if isinstance(paths, list) else ())]

    def _outputs_unbuilt(self) -> str | None:
        """Why the outputs a flattened program returns cannot be put back
        into the live call's structure, or ``None``."""
        doc = self.sidecar.document.get("outputs")
        if self.binding != "flattened" or doc is None:
            return None
        try:
            resolve_opaque(spec_from_json(doc, "outputs"),
                           advice="the program's flat outputs cannot be put back into it")
        except ValueError as exc:
            return str(exc)
        return None

    @contextmanager
    def replay(self) -> Iterator[None]:
        """Establish what the capture needs -- every probe at its neutral
        state, then each state it does not carry itself (``ambient_only``)
        as the live call had it -- and restore exactly on exit.  Raises
        ``ValueError`` for a needed state this process cannot establish (an
        unknown probe, a live state a document cannot carry)."""
        snap = self.snapshot
        needed = [n for n, s in snap.items() if isinstance(s, Unresolved)
                  and n in self.ambient_only]
        if needed:
            raise ValueError(f"{self.label}: cannot establish the state of "
                             f"{', '.join(needed)} here (not portable, or the probe is not "
                             "registered in this process)")
        with ExitStack() as stack:
            for name, probe, state in zip(snap.names, snap.probes, snap.states):
                if isinstance(state, Unresolved):
                    continue
                neutral = probe.neutral_state()
                if name in self.ambient_only:
                    stack.enter_context(probe.replay(state))
                elif neutral is not None:
                    stack.enter_context(probe.replay(neutral))
            yield

    def guarded(self, *, on_mismatch: str = "raise",
                fallback: Callable[..., Any] | None = None, weights: Weights = None,
                ignore: Iterable[str] = ()) -> GuardedCapture:
        """A callable that runs the program after checking, on each call,
        that the process still holds what the capture needs.

        Args:
            on_mismatch: on a difference, ``"raise"`` (:class:`GuardError`
                listing it), ``"warn"`` (:class:`GuardWarning` once per
                distinct state, then run) or ``"fallback"`` (call
                ``fallback`` with the same arguments instead).
            fallback: what to call instead, for ``on_mismatch="fallback"``.
            weights: a member module or its state dict, as for ``module()``.
            ignore: probe names not to check (you vouch for them).

        The guard also checks each call's sizes (a ``sizes`` difference): a
        fixed-size capture takes its captured shapes alone, a folded one the
        sizes in the ranges it was verified over."""
        return GuardedCapture(self.needs, self.module(weights), on_mismatch=on_mismatch,
                              fallback=fallback, ignore=ignore, folding=self.folding,
                              kwarg_order=_kwarg_order(self.sidecar.inputs),
                              shapes=tuple(spec.shape for _, spec in self.sidecar.inputs))



def _kwarg_order(leaves: Iterable[tuple[str, Any]]) -> tuple[str, ...]:
    """The keyword arguments' order in a captured call, from its leaf paths
    (``kwargs['name']...``)."""
    names: list[str] = []
    for path, _ in leaves:
        if path.startswith("kwargs["):
            name = path[len("kwargs["):].split("]", 1)[0]
            try:
                key = ast.literal_eval(name)
            except (ValueError, SyntaxError):
                continue
            if isinstance(key, str) and key not in names:
                names.append(key)
    return tuple(names)


@attrs.frozen(eq=False)
class LoadedManifest:
    """A directory written by ``report.save_all``, opened by :func:`ctxreplay.load`.

    ``captures``: every saved capture; ``not_saved``: ``(scope#variant,
    reason)`` of captures the report had that could not be written;
    ``failures``: ``(scope, variant, backend, reason)`` of variants that
    failed to capture; ``problems``: the report's problem codes; ``ok``:
    the report was ok when saved.  ``unknown_probes``: probes the files
    name that this process does not have."""

    path: Path
    """The ``manifest.json``."""
    ctxreplay_version: str
    """The ctxreplay version that wrote it."""
    environment: Mapping[str, Any] = attrs.field(repr=False)
    """Versions, device and autocast op policy it was made with."""
    ok: bool
    """Whether the report was ok when it was saved."""
    probes: tuple[str, ...]
    """The probes the session observed."""
    captures: tuple[LoadedCapture, ...]
    """Every saved capture."""
    not_saved: tuple[tuple[str, str], ...] = ()
    """``(scope#variant, reason)`` of captures the report had that were not written."""
    failures: tuple[tuple[str, int, str, str], ...] = ()
    """``(scope, variant, backend, reason)`` of variants that failed to capture."""
    problems: tuple[str, ...] = ()
    """The report's problem codes."""
    unknown_probes: tuple[str, ...] = ()
    """Probes the files name that this process does not have."""
    refused: tuple[tuple[str, str], ...] = ()
    """``(scope#variant, why)`` of captures whose files are not what the
    manifest recorded (swapped, edited, truncated, missing, or a symlink):
    not loaded, so never served; ``why`` names the file."""

    @property
    def directory(self) -> Path:
        """The directory the manifest is in."""
        return self.path.parent

    def __iter__(self) -> Iterator[LoadedCapture]:
        return iter(self.captures)

    def __len__(self) -> int:
        return len(self.captures)

    def check(self, *, ignore: Iterable[str] = ()) -> tuple[Difference, ...]:
        """What differs between now and what the captures need, each
        difference once, listing the captures it concerns (empty when all
        holds)."""
        ignore = tuple(ignore)
        refused = (Difference("files", "the files the manifest recorded", why, "files",
                              (label,)) for label, why in self.refused)
        return merge_differences([*refused,
                                  *(d for c in self.captures for d in c.check(ignore=ignore))])


# -- load ---------------------------------------------------------------------------

def _capture(side: ArtifactSidecar, members: tuple[str, ...], weights_from: str,
             fidelity: str, environment: Mapping[str, Any] | None,
             merged: tuple[int, ...] = (),
             compiled: CompiledProgram | None = None,
             digest: str | None = None) -> LoadedCapture:
    env = environment
    if env is None:
        doc_env = side.document.get("environment")
        env = doc_env if isinstance(doc_env, Mapping) else {"torch": side.torch_version}
    return LoadedCapture(side.artifact, side, members or side.members or (side.scope,),
                         weights_from or side.weights_from or
                         (members[0] if members else side.scope),
                         fidelity, env, merged, compiled, digest)


def _load_single(path: Path, probes: Probes) -> LoadedCapture:
    named = path if path.suffix == ".json" else sidecar_path(path)
    misplaced = changed_files(named.parent, None, (named.name,))
    if misplaced is not None:  # read nothing through a symlink
        raise FileChangedError(f"load: {misplaced}")
    side = read_sidecar(path, probe_map(probes))
    warn_unknown(side.snapshot.unknown, side.path.name)
    doc = side.document
    saved = None if doc.get("saved_fidelity") is None else document_fidelity(doc, "saved_fidelity")
    found = None if doc.get("artifact_digest") is None else \
        read_digest(doc["artifact_digest"], "$.artifact_digest")
    name = side.artifact.name
    why = changed_files(side.artifact.parent, None if found is None else {name: found},
                        (side.path.name, name))
    if why is not None:
        raise FileChangedError(f"load: {why}")
    if found is None:
        _log.warning("load: %s: %s", side.artifact, UNVERIFIED)
    return _capture(side, (), "", combined_status(document_fidelity(doc, "fidelity"), saved),
                    None, digest=found)


def _check_entry(e: ManifestEntry, side: ArtifactSidecar) -> None:
    where = f"$.captures[{e.index}]"
    for field, mine, theirs in (("scope", e.scope, side.scope),
                                ("variant", e.variant, side.variant),
                                ("fingerprint", e.fingerprint, side.fingerprint),
                                ("binding", e.binding, side.binding),
                                ("artifact", e.artifact, side.artifact.name)):
        if mine != theirs:
            raise ValueError(f"{where}.capture.{field}: does not match its sidecar "
                             f"{side.path.name}")


def _load_manifest(path: Path, data: Any, probes: Probes) -> LoadedManifest:
    try:
        doc = read_manifest(path, data)
    except ValueError as exc:
        raise ValueError(f"{exc} (in {path})") from None
    given = probe_map(probes)
    captures = []
    unknown: list[str] = []
    refused = []
    saved = [e for e in doc.entries if e.sidecar is not None and e.artifact is not None]
    not_saved = [(e.label, e.not_saved or "unknown") for e in doc.entries if e not in saved]
    with _artifact_checks(doc.directory, saved) as checks:
        for e, check in zip(saved, checks, strict=True):
            side, why = _entry_sidecar(doc.directory, e, given, path)
            why = why or check()
            if why is not None or side is None:  # refused; the others still serve
                _log.warning("load: %s refused: %s", e.label, why)
                refused.append((e.label, str(why)))
                continue
            unknown += side.snapshot.unknown
            merged = e.capture.get("merged", [])
            captures.append(_capture(side, e.members, e.weights_from,
                                     combined_status(e.fidelity, e.saved), doc.environment,
                                     tuple(m for m in merged if type(m) is int)
                                     if isinstance(merged, list) else (),
                                     _compiled(e, doc.directory, path),
                                     e.digests.get(str(e.artifact))))
    names = tuple(sorted(set(unknown)))
    warn_unknown(names, doc.path.name)
    if captures and not doc.entries[0].digests:
        _log.warning("load: %s: %s", doc.path, UNVERIFIED)
    return LoadedManifest(doc.path, doc.ctxreplay_version, doc.environment, doc.ok,
                          doc.probes, tuple(captures), tuple(not_saved),
                          doc.failures, doc.problems, names, tuple(refused))


@contextmanager
def _artifact_checks(directory: Path, entries: list[ManifestEntry]
                     ) -> Iterator[list[Callable[[], str | None]]]:
    """For each entry, what ``changed_files`` says of its artifact (read
    once, to hold it to its digest), as a call that waits for it.  Two or
    more are hashed on worker threads while the sidecars are read: ``sha256``
    of a file's bytes releases the GIL, so on a directory of many captures
    their hashing overlaps the parsing instead of adding to it."""
    def check(e: ManifestEntry) -> str | None:
        return changed_files(directory, dict(e.digests) or None, (str(e.artifact),))

    if len(entries) < 2:
        yield [functools.partial(check, e) for e in entries]
        return
    with ThreadPoolExecutor(max_workers=min(len(entries), _HASHERS)) as pool:
        yield [pool.submit(check, e).result for e in entries]


def _entry_sidecar(directory: Path, e: ManifestEntry, probes: Any,
                   manifest: Path) -> tuple[ArtifactSidecar | None, str | None]:
    """The sidecar of entry ``e``, read from the bytes its digest was checked
    on and held to the entry; or why it is refused (naming the file)."""
    assert e.sidecar is not None
    side_file = directory / e.sidecar
    try:
        data = verified_bytes(directory, e.sidecar, e.digests.get(e.sidecar))
    except FileNotFoundError:
        return None, f"{side_file}: is missing"
    except (ValueError, OSError) as exc:  # changed, a symlink, unreadable
        return None, str(exc)
    try:
        side = read_sidecar(side_file, probes, data=data)
    except ValueError as exc:
        raise ValueError(f"{exc} (in {side_file})") from None
    _check_entry(e, side)
    return side, None


def _compiled(e: ManifestEntry, directory: Path, manifest: Path) -> CompiledProgram | None:
    """Entry ``e``'s compiled record, its package checked against the digest
    it records (``CompiledProgram.refused`` says why one that is not may not run)."""
    if e.compiled is None:
        return None
    try:
        record = CompiledProgram.from_json(e.compiled, f"$.captures[{e.index}].compiled")
    except ValueError as exc:
        raise ValueError(f"{exc} (in {manifest})") from None
    return record.checked_in(directory)



def _statuses(captures: Iterable[LoadedCapture]) -> str:
    """``"7 ok, 1 failed"``: how many captures have each fidelity status."""
    counts: dict[str, int] = {}
    for c in captures:
        counts[c.fidelity] = counts.get(c.fidelity, 0) + 1
    return ", ".join(f"{n} {status}" for status, n in sorted(counts.items())) or "none"


def load(path: str | os.PathLike[str], *,
         probes: Probes = None) -> LoadedManifest | LoadedCapture:
    """Open a directory written by ``report.save_all`` (or its
    ``manifest.json``) as a :class:`LoadedManifest`, or one capture written
    by ``Capture.save`` (the artifact file or its ``.json`` sidecar) as a
    :class:`LoadedCapture`.

    Every document is validated strictly (a malformed field raises
    ``ValueError`` naming its JSON path; a wrong kind of file says what was
    expected).  Probes the documents name that this process does not have
    load as opaque states, with one :class:`ctxreplay.probes.UnknownProbeWarning`
    naming them; ``probes`` supplies instances for names the registry does
    not hold (a framework's forward-context probe).  Programs are loaded on
    first use.

    Args:
        path: a manifest directory or its ``manifest.json``, an artifact file
            (a ``.pt2``, or of a registered format) or its ``.json`` sidecar.
        probes: probe instances for names the registry does not hold.

    Returns:
        A :class:`LoadedManifest` for a manifest, a :class:`LoadedCapture`
        for one saved capture.

    Raises:
        ValueError: a malformed document (naming its JSON path) or a file of
            another kind.
    """
    kind, target, data = detect(path)
    if kind == "manifest":
        loaded = _load_manifest(target, data, probes)
        _log.info("load: %s: %d captures (%s) for %d members%s", loaded.directory,
                  len(loaded.captures), _statuses(loaded.captures),
                  len({m for c in loaded.captures for m in c.members}),
                  f"; {len(loaded.not_saved)} not saved" if loaded.not_saved else "")
        return loaded
    if kind in ("artifact", "sidecar"):
        one = _load_single(target, probes)
        _log.info("load: %s: %s (%s) for %s", one.path, one.label, one.fidelity,
                  ", ".join(one.members))
        return one
    raise ValueError(f"$.schema: a report holds no artifacts; write them with "
                     f"report.save_all(directory) and load that directory (in {target})")
