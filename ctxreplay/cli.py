"""The ``ctxreplay`` command."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import textwrap
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ._base.jsonread import loads
from ._base.version import __version__
from .artifacts.formats import format_of_file
from .artifacts.roles import OutputRole, roles_from_json
from .artifacts.sidecar import read_sidecar
from .backends.registry import available_backends
from .core.observer import snapshot
from .core.registry import available_probes, get_probe
from .core.snapshots import describe_state
from .demo import run_demo
from .fidelity.verify import fidelity_status
from .loading.compiled import CompiledProgram
from .loading.detect import detect
from .loading.load import LoadedManifest, load
from .loading.needs import Needs, merge_differences, needs_from_document, static_differences
from .loading.trust import changed_files
from .report.explain import Explanation
from .report.manifest import ManifestDoc, read_manifest

__all__ = ["main"]


def _registry_listing(rows: Iterable[tuple[str, list[str], str, str | None]],
                      notes: dict[str, str] | None = None) -> int:
    """Print ``(name, flags, description, error)`` rows: one line a name (the
    description wrapped under itself), the error of a broken entry point,
    and a name's note (why a probe is inactive)."""
    # the terminal's width (88 when stdout is not a terminal)
    width = max(60, shutil.get_terminal_size((88, 24)).columns)
    for name, flags, description, error in rows:
        print(textwrap.fill(description or "-", width=width,
                            initial_indent=f"{name:20s} [{', '.join(flags)}] ",
                            subsequent_indent=" " * 21, break_on_hyphens=False,
                            break_long_words=False))
        if error:
            print(f"{'':20s} ERROR: {error}")
        if notes and name in notes:
            print(f"{'':20s} {notes[name]}")
    return 0


def _probes(_: argparse.Namespace) -> int:
    # a probe that needs a framework says whether it is active, and why not
    infos = available_probes()
    notes = {name: f"inactive: {info.inactive}" for name, info in infos.items()
             if info.inactive}
    needs = {name for name in infos if _requires(name)}
    return _registry_listing(
        ((name, ["default" if info.default else "opt-in", info.origin,
                 *filter(None, [info.distribution]),
                 *(["inactive" if info.inactive else "active"] if name in needs else [])],
          info.description, info.error)
         for name, info in infos.items()), notes)


def _requires(name: str) -> tuple[str, ...]:
    try:
        return tuple(get_probe(name).requires)
    except Exception:  # a broken entry point: listed with its error
        return ()


def _backends(_: argparse.Namespace) -> int:
    return _registry_listing(
        (name, [info.origin, *filter(None, [info.distribution])], info.description, info.error)
        for name, info in available_backends().items())


def _snapshot(ns: argparse.Namespace) -> int:
    snap = snapshot(ns.probes or None)
    if ns.json:
        print(json.dumps(snap.to_json(), indent=2, sort_keys=True))
    else:
        for name, text in snap.describe().items():
            print(f"{name:20s} {text}")
    return 0


def _demo(ns: argparse.Namespace) -> int:
    report, _base, ok = run_demo(depth=ns.depth)
    if ns.json:
        report.save(ns.json)
        print(f"report written to {ns.json}")
    return 0 if ok else 1


def _explain(ns: argparse.Namespace) -> int:
    data = Path(ns.report).read_bytes()
    fmt = format_of_file(Path(ns.report))
    if fmt is not None:
        raise ValueError(f"{ns.report}: a saved capture ({fmt.description}), not a report; "
                         "explain reads a report written by report.save() (see ctxreplay "
                         "inspect for saved captures)")
    doc = loads(data, "$", source=ns.report)
    if not isinstance(doc, Mapping) or not str(doc.get("schema", "")).startswith(
            "ctxreplay.report/"):
        raise ValueError(f"{ns.report}: not a report written by report.save() (see ctxreplay "
                         "inspect for manifests and sidecars)")
    try:
        explanation = Explanation.from_report_json(doc)
    except ValueError as exc:
        raise ValueError(f"{ns.report}: {exc}") from None
    if not explanation.captures:
        print(f"ctxreplay: {ns.report} holds no explain results; compute them with "
              "report.explain(model) before report.save() (ctxreplay demo --json does)",
              file=sys.stderr)
        return 1
    print(explanation.table(width=shutil.get_terminal_size((88, 24)).columns))
    return 0


# -- inspect and check ---------------------------------------------------------------

def _table(head: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head) - 1)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)) + "  " + head[-1]]
    lines.append("-" * len(lines[0]))
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) + "  " + r[-1] for r in rows]
    return "\n".join(lines)


def _tensors(node: Any, out: list[str]) -> None:
    if isinstance(node, Mapping):
        t = node.get("tensor")
        if isinstance(t, Mapping):
            shape = ",".join(str(d) for d in t.get("shape", []))
            out.append(f"{t.get('dtype', '?')}[{shape}]")
            return
        for v in node.values():
            _tensors(v, out)
    elif isinstance(node, list):
        for v in node:
            _tensors(v, out)


def _signature(inputs: Any) -> str:
    found: list[str] = []
    if isinstance(inputs, Mapping):
        _tensors([inputs.get("args"), inputs.get("kwargs")], found)
    shown = " ".join(found[:3]) + (f" +{len(found) - 3}" if len(found) > 3 else "")
    return shown or "-"


def _members(names: Sequence[str]) -> str:
    if len(names) <= 2:
        return ",".join(names) or "-"
    return f"{names[0]},{names[1]} +{len(names) - 2}"


def _fidelity(doc: Any) -> str:
    if not isinstance(doc, Mapping):
        return "-"
    checked = "+".join(str(c) for c in doc.get("checked", [])) or str(doc.get("level", "?"))
    try:
        status = fidelity_status(doc, "fidelity")
    except ValueError:
        return "unreadable"
    words = {"ok": "ok", "ok_with_needs": "ok where its needs hold", "failed": "NOT OK",
             "unchecked": "not checked"}[status]
    return f"{words} ({checked})"


def _environment(env: Any) -> str:
    if not isinstance(env, Mapping):
        return "environment not recorded"
    device = str(env.get("device", "?"))
    if env.get("capability"):
        device += f" {env['capability']}"
    return (f"ctxreplay {env.get('ctxreplay', '?')}, torch {env.get('torch', '?')}, "
            f"python {env.get('python', '?')}, device {device}")


def _checked(c: Mapping[str, Any]) -> str:
    """Calls checked by value of the calls the capture stands for."""
    checked, calls = c.get("checked"), c.get("calls")
    if type(checked) is not int or type(calls) is not int:
        return "-"
    return f"{checked}/{calls}"


def _sizes(dynamic: Any) -> str:
    """A folded capture's ranges, ``" (folded: s0 4..12)"``; empty otherwise."""
    if not isinstance(dynamic, Mapping) or not isinstance(dynamic.get("ranges"), list):
        return ""
    ranges = [f"{r.get('name')} {r.get('low')}..{r.get('high')}"
              for r in dynamic["ranges"] if isinstance(r, Mapping)]
    return f" (folded: {', '.join(ranges)})" if ranges else ""


def _capture_rows(caps: list[tuple[Mapping[str, Any], str, str]]) -> list[tuple[str, ...]]:
    return [(f"{c.get('scope')}#{c.get('variant')}", _members(c.get("members", [])),
             str(c.get("weights_from") or "-"),
             _signature(c.get("inputs")) + _sizes(c.get("dynamic")),
             _fidelity(c.get("fidelity")) + (" [cache]" if c.get("from_cache") is True else ""),
             _checked(c), saved, where) for c, saved, where in caps]


def _cache_line(data: Mapping[str, Any]) -> list[str]:
    """The report's capture cache summary, where it used one."""
    cache = data.get("cache")
    if not isinstance(cache, Mapping):
        return []
    refused = cache.get("not_stored")
    lines = [f"capture cache {cache.get('directory')}: {cache.get('from_cache')} captures "
             f"loaded from it and checked ([cache]), {cache.get('traced')} traced"]
    if isinstance(refused, Mapping):
        lines += [f"  not stored: {label} ({why})" for label, why in refused.items()]
    return lines


_HEAD = ("capture", "members", "weights", "inputs", "fidelity", "checked", "saved", "file")


def _failure_lines(failures: Any, problems: Any) -> list[str]:
    lines = []
    for f in failures if isinstance(failures, list) else []:
        if isinstance(f, Mapping):
            lines.append(f"failed: {f.get('scope')}#{f.get('variant')} {f.get('reason')} "
                         f"({f.get('backend')})")
    for p in problems if isinstance(problems, list) else []:
        if isinstance(p, Mapping):
            lines.append(f"problem: {p.get('reason')}" +
                         (f" ({p.get('scope')})" if p.get("scope") else ""))
    return lines


def _roles_line(label: str, roles: Sequence[OutputRole] | None) -> str:
    """What each output of a capture's graph is, in order: ``graph outputs
    of label: 0 out (output), 1 kwargs['cache'].keys (assigned)``."""
    if roles is None:
        return f"graph outputs of {label}: roles not recorded"
    shown = ", ".join(f"{i} {r.path} ({r.kind})" for i, r in enumerate(roles))
    return f"graph outputs of {label}: {shown or '-'}"


def _report_roles(caps: Sequence[Mapping[str, Any]]) -> list[str]:
    return [_roles_line(f"{c.get('scope')}#{c.get('variant')}",
                        roles_from_json(c.get("output_roles"), f"$.captures[{i}].output_roles"))
            for i, c in enumerate(caps)]


def _inspect(ns: argparse.Namespace) -> int:
    kind, target, data = detect(ns.path)
    caps: list[tuple[Mapping[str, Any], str, str]] = []
    changed: list[str] = []
    if kind == "manifest":
        doc = read_manifest(target, data)
        for e in doc.entries:
            ok = {"failed": "NOT OK", "unchecked": "unchecked"}.get(e.saved or "", "ok")
            saved = f"no: {e.not_saved}" if e.not_saved else ok
            caps.append((e.capture, saved, e.artifact or "-"))
        print(f"manifest {target} ({_count(len(doc.entries), 'capture')}; report "
              f"{'ok' if doc.ok else 'not ok'}; {_environment(doc.environment)})")
        extra = _failure_lines(data.get("failures"), data.get("problems"))
        extra += _cache_line(data)
        extra += [_compiled_line(e.label, e.compiled, f"$.captures[{e.index}].compiled")
                  for e in doc.entries if e.compiled is not None]
        extra += [_roles_line(e.label, e.meta.output_roles) for e in doc.entries]
        changed = _changed_entries(doc)
        extra += changed
    elif kind == "report":
        for c in data.get("captures", []) if isinstance(data.get("captures"), list) else []:
            if isinstance(c, Mapping):
                caps.append((c, "-", "-"))
        print(f"report {target} ({_count(len(caps), 'capture')}; "
              f"{'ok' if data.get('ok') is True else 'not ok'}; "
              f"{_environment(data.get('environment'))})")
        extra = _failure_lines(data.get("failures"), data.get("problems")) + \
            _cache_line(data) + _report_roles([c for c, _, _ in caps])
    else:
        side = read_sidecar(target)
        doc_ = side.document
        saved = _fidelity(doc_.get("saved_fidelity"))
        caps.append(({**doc_, "weights_from": side.weights_from, "members": side.members},
                      saved, side.artifact.name))
        print(f"saved capture {side.artifact} ({_environment(doc_.get('environment'))})")
        described = side.snapshot.describe()
        extra = [_roles_line(f"{side.scope}#{side.variant}", side.output_roles)]
        extra += [f"context: {name}={text}" for name, text in described.items()]
        # a probe replayed partly inside the trace and partly around it (grad
        # mode under inference mode) is carried in part and needed in part
        carried = [f"{n} (in part)" if n in side.ambient_only else n for n in side.embedded]
        needed = [f"{n}={described[n]}" if n in described else n for n in side.ambient_only]
        extra.append(f"carried by the artifact: {', '.join(carried) or '-'}; to "
                     f"re-establish where it runs: {', '.join(needed) or '-'}")
    print(_table(_HEAD, _capture_rows(caps)))
    for line in extra:
        print(line)
    return 1 if kind == "manifest" and changed else 0


def _changed_entries(doc: ManifestDoc) -> list[str]:
    """``refused: label: why`` of each entry whose files are not what the
    manifest recorded (``load`` refuses them)."""
    out = []
    for e in doc.entries:
        if e.sidecar is not None and e.artifact is not None:
            why = changed_files(doc.directory, dict(e.digests) or None, (e.sidecar, e.artifact))
            if why is not None:
                out.append(f"refused: {e.label}: {why}")
    return out


def _compiled_line(label: str, doc: Mapping[str, Any], where: str) -> str:
    """``compiled: label -> package (ok, error ...; for torch ..., cpu_isa ...)``."""
    rec = CompiledProgram.from_json(doc, where)
    env = rec.environment
    target = f"cpu_isa {env.get('cpu_isa')}" if env.get("device") == "cpu" else \
        f"{env.get('device')} {env.get('capability')}"
    verdict = "ok" if rec.ok else "FAILED its check"
    return (f"compiled: {label} -> {rec.package} ({verdict}, error {rec.error:.2g}; for torch "
            f"{env.get('torch')}, {env.get('machine')} {target})")


def _compiled_here(label: str, record: CompiledProgram, directory: Path,
                   fingerprint: str) -> str:
    """Whether ``label``'s compiled program runs in this process, and if not why."""
    why = record.unusable(directory, fingerprint)
    if why is None:
        return f"compiled: {label} runs its compiled program ({record.package})"
    return f"compiled: {label} runs uncompiled here: {why[1]} ({why[0]})"


def _check(ns: argparse.Namespace) -> int:
    kind, target, data = detect(ns.path)
    notes: list[str] = []
    needs: list[Needs] = []
    # compiled programs that do not hold here leave their captures usable
    # (install runs them uncompiled): said, not counted as a difference
    compiled: list[str] = []
    if kind == "report":
        caps = data.get("captures", [])
        if not isinstance(caps, list):
            raise ValueError("$.captures: expected a list")
        env = data.get("environment")
        needs = [needs_from_document(c, env if isinstance(env, Mapping) else None,
                                     f"$.captures[{i}]") for i, c in enumerate(caps)]
        if data.get("ok") is not True:
            notes.append("the report was not ok when saved")
    else:
        src = load(target)
        captures = src.captures if isinstance(src, LoadedManifest) else (src,)
        needs = [c.needs for c in captures]
        compiled = [_compiled_here(c.label, c.compiled, c.path.parent, c.fingerprint)
                    for c in captures if c.compiled is not None]
        # a file that is not what was saved, or one no digest vouches for, is
        # a finding: never an ok over files nothing checked
        notes += [d.text for c in captures for d in c.unverified()]
        notes += [f"compiled: {c.label}: {c.compiled.refused[1]} ({c.compiled.refused[0]})"
                  for c in captures if c.compiled is not None and c.compiled.refused is not None
                  and c.compiled.refused[0] == "compiled_changed"]
        if isinstance(src, LoadedManifest):
            notes += [f"refused: {label}: {why}" for label, why in src.refused]
            notes += [f"not saved: {label} ({reason})" for label, reason in src.not_saved]
            notes += [f"failed: {s}#{v} {reason} ({backend})"
                      for s, v, backend, reason in src.failures]
            notes += [f"problem: {reason}" for reason in src.problems]
    found = merge_differences(d for n in needs for d in static_differences(n, ns.ignore))
    # the ambient states a caller must establish around each call: a command
    # line process has none of them, so they are listed, not checked
    around: dict[str, list[str]] = {}
    for n in needs:
        for name, probe, state in zip(n.snapshot.names, n.snapshot.probes, n.snapshot.states):
            if name in n.ambient_only and name not in ns.ignore:
                around.setdefault(f"{name}={describe_state(probe, state)}", []).append(n.label)
    for d in found:
        print(d.text)
    for line in notes:
        print(line)
    for what, labels in around.items():
        shown = ", ".join(labels[:4]) + (", ..." if len(labels) > 4 else "")
        print(f"establish around each call: {what} [{shown}]")
    for line in compiled:
        print(line)
    if found or notes:
        print(f"ctxreplay check: {target}: NOT OK ({len(found)} differences, "
              f"{len(notes)} other findings)", file=sys.stderr)
        return 1
    print(f"ok: {target} can run in this environment, as it was verified "
          f"({_count(len(needs), 'capture')})")
    return 0


def _compile(ns: argparse.Namespace) -> int:
    """``ctxreplay compile DIR``: each capture compiled ahead of time, checked, recorded."""
    from .compiling import compile_dir

    done = compile_dir(ns.dir, force=ns.force)
    src = load(done.directory)
    assert isinstance(src, LoadedManifest)
    for label, why in src.refused:
        print(f"{label}: not compiled: {why}")
    for cap in src.captures:
        rec = cap.compiled
        if cap.label in done.skipped:
            print(f"{cap.label}: not compiled: {done.skipped[cap.label]}")
        elif rec is not None:
            verdict = "ok" if rec.ok else f"FAILED its check: {rec.reason}"
            print(f"{cap.label}: {rec.package}: {verdict}, error {rec.error:.3g} at "
                  f"{_count(len(rec.checked), 'size')}"
                  + (f"; dynamic {'; '.join(rec.dynamic)}" if rec.dynamic else ""))
    print(f"ctxreplay compile: {done.directory}: {len(done.compiled)} compiled, "
          f"{len(done.failed)} failed their check, {len(done.skipped)} not compiled "
          f"({done.seconds:.1f} s)")
    return 1 if done.failed or src.refused else 0


def _cache(ns: argparse.Namespace) -> int:
    """``ctxreplay cache list|size|clear [DIR]``."""
    import os
    from pathlib import Path

    from .cache.store import CacheDir

    where = ns.dir or os.environ.get("CTXREPLAY_CACHE")
    if not where:
        raise ValueError("cache: give a directory, or set CTXREPLAY_CACHE")
    if not Path(where).is_dir():
        # a typo must not read as an empty cache
        raise ValueError(f"cache: {where}: no such directory"
                         + ("" if ns.dir else " (from $CTXREPLAY_CACHE)"))
    store = CacheDir(Path(where))
    if ns.action == "clear":
        print(f"removed {_count(store.clear(), 'entry', 'entries')} from {where}")
        return 0
    n, size = store.size()
    if ns.action == "size":
        print(f"{where}: {_count(n, 'entry', 'entries')}, {_bytes(size)}")
        return 0
    rows: list[tuple[str, ...]] = []
    for key, rec, nbytes in store.entries():
        about = rec.get("about", {}) if rec is not None else {}
        rows.append((key[:16], f"{about.get('class', '?')} {about.get('scope', '?')}"
                     f"#{about.get('variant', '?')}", _signature(about.get("inputs")),
                     f"{about.get('backend', '?')}/{about.get('replay', '?')}",
                     str(about.get("verify", "unreadable")), str(about.get("torch", "?")),
                     _bytes(nbytes)))
    print(_table(("key", "captured from", "inputs", "backend/replay", "verified", "torch",
                  "size"), rows))
    print(f"{where}: {_count(n, 'entry', 'entries')}, {_bytes(size)}")
    return 0


def _count(n: int, one: str, many: str | None = None) -> str:
    """``1 capture``, ``2 captures``."""
    return f"{n} {one if n == 1 else many or one + 's'}"


def _bytes(n: int) -> str:
    """A size in readable decimal units: ``512 B``, ``40.3 kB``, ``1.2 GB``."""
    if n < 1000:
        return f"{n} B"
    size, unit = n / 1e3, "kB"
    for bigger in ("MB", "GB", "TB"):
        if size < 1000:
            break
        size, unit = size / 1e3, bigger
    return f"{size:.1f} {unit}"


def _utf8(arg: str) -> bool:
    """Whether ``arg`` encodes as UTF-8: bytes the file system encoding could not
    decode arrive as lone surrogates (``surrogateescape``), which do not."""
    try:
        arg.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="ctxreplay", description="Faithful deferred graph capture for PyTorch.")
    parser.add_argument("--version", action="version", version=f"ctxreplay {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("probes", help="list registered probes")
    p.set_defaults(func=_probes)
    p = sub.add_parser("backends", help="list registered capture backends")
    p.set_defaults(func=_backends)
    p = sub.add_parser("snapshot", help="print the current ambient state")
    p.add_argument("probes", nargs="*", help="probe names (default: the default set)")
    p.add_argument("--json", action="store_true", help="print the snapshot document")
    p.set_defaults(func=_snapshot)
    p = sub.add_parser("demo", help="capture a small DiT under bf16 autocast, with and "
                                    "without replay")
    p.add_argument("--json", metavar="PATH", help="write the metadata-only report")
    p.add_argument("--depth", type=int, default=6, help="number of blocks")
    p.set_defaults(func=_demo)
    p = sub.add_parser("explain", help="print which probes changed each captured graph, "
                                       "from a report written with explain results")
    p.add_argument("report", metavar="REPORT.json", help="a report written by report.save() "
                   "(e.g. ctxreplay demo --json PATH)")
    p.set_defaults(func=_explain)
    p = sub.add_parser("inspect", help="print the captures, members, signatures, fidelity and "
                                       "failures of a saved artifact")
    p.add_argument("path", metavar="PATH", help="a manifest directory (report.save_all), a "
                   "manifest.json, a saved capture (Capture.save) or its sidecar, or a "
                   "report JSON")
    p.set_defaults(func=_inspect)
    p = sub.add_parser("check", help="check a saved artifact against this process; exit 1 "
                                     "when something it needs differs")
    p.add_argument("path", metavar="PATH", help="as for inspect")
    p.add_argument("--ignore", action="append", default=[], metavar="PROBE",
                   help="a probe not to check (you vouch for it); repeatable")
    p.set_defaults(func=_check)
    p = sub.add_parser("compile", help="compile every capture of a saved directory ahead of "
                                       "time (AOTInductor), check and record each; exit 1 "
                                       "when one fails its check")
    p.add_argument("dir", metavar="DIR", help="a directory written by report.save_all")
    p.add_argument("--force", action="store_true", help="compile again what is compiled")
    p.set_defaults(func=_compile)
    p = sub.add_parser("cache", help="list, size or clear a capture cache directory")
    p.add_argument("action", choices=("list", "size", "clear"))
    p.add_argument("dir", metavar="DIR", nargs="?", help="the cache directory (default: "
                   "$CTXREPLAY_CACHE)")
    p.set_defaults(func=_cache)
    args = list(sys.argv[1:] if argv is None else argv)
    bad = next((a for a in args if not _utf8(a)), None)
    if bad is not None:  # printing it back would raise UnicodeEncodeError
        print(f"ctxreplay: error: argument {bad!a} is not valid UTF-8 (a path of "
              "undecodable bytes); rename it or give another path", file=sys.stderr)
        return 2
    try:
        ns = parser.parse_args(args)
    except SystemExit as exc:  # --version, --help, or a usage error (already printed)
        return int(exc.code or 0) if not isinstance(exc.code, str) else 2
    try:
        return int(ns.func(ns))
    except (ValueError, KeyError, OSError) as exc:
        print(f"ctxreplay: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
