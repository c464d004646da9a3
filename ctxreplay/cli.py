"""The ``ctxreplay`` command."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

__all__ = ["main"]


def _probes(_: argparse.Namespace) -> int:
    from . import available_probes

    for name, info in available_probes().items():
        flags = ["default" if info.default else "opt-in", info.origin]
        if info.distribution:
            flags.append(info.distribution)
        print(f"{name:20s} [{', '.join(flags)}] {info.description}")
        if info.error:
            print(f"{'':20s} ERROR: {info.error}")
    return 0


def _snapshot(ns: argparse.Namespace) -> int:
    from . import snapshot

    snap = snapshot(ns.probes or None)
    if ns.json:
        print(json.dumps(snap.to_json(), indent=2, sort_keys=True))
    else:
        for name, text in snap.describe().items():
            print(f"{name:20s} {text}")
    return 0


def _demo(ns: argparse.Namespace) -> int:
    from .demo import run_demo

    report, _base, ok = run_demo(depth=ns.depth)
    if ns.json:
        report.save(ns.json)
        print(f"report written to {ns.json}")
    return 0 if ok else 1


def _explain(ns: argparse.Namespace) -> int:
    from pathlib import Path

    from .explain import Explanation

    try:
        doc = json.loads(Path(ns.report).read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{ns.report}: not a JSON document ({exc.msg})") from None
    try:
        explanation = Explanation.from_report_json(doc)
    except ValueError as exc:
        raise ValueError(f"{ns.report}: {exc}") from None
    if not explanation.captures:
        print(f"ctxreplay: {ns.report} holds no explain results; compute them with "
              "report.explain(model) before report.save() (ctxreplay demo --json does)",
              file=sys.stderr)
        return 1
    print(explanation.table())
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="ctxreplay", description="Faithful deferred graph capture for PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("probes", help="list registered probes")
    p.set_defaults(func=_probes)
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
    ns = parser.parse_args(argv)
    try:
        return int(ns.func(ns))
    except (ValueError, KeyError, OSError) as exc:
        print(f"ctxreplay: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
