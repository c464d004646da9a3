"""The generated parts of docs/architecture.md: the layer diagram and the tables.

One source of truth: the folder-level layers contract in pyproject.toml (which
import-linter enforces in `make test`) gives the order, and each folder's
``__init__`` docstring (each root module's docstring) says what it owns.  The
page holds the text between its ``<!-- generated: NAME -->`` and
``<!-- end: NAME -->`` markers exactly as this script renders it;
tests/project/test_architecture.py fails when they drift.

    python scripts/architecture_page.py          # print what the page should hold
    python scripts/architecture_page.py --write  # rewrite the page's generated parts
"""

from __future__ import annotations

import ast
import itertools
import re
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ctxreplay"
PAGE = ROOT / "docs" / "architecture.md"
MARKED = re.compile(r"(<!-- generated: (\w+) -->\n)(.*?)(<!-- end: \2 -->)", re.DOTALL)


def contract_layers() -> list[list[str]]:
    """The rungs of the folder-level layers contract, top first."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    contracts = config["tool"]["importlinter"]["contracts"]
    (main,) = [c for c in contracts if c.get("containers") == ["ctxreplay"]]
    return [[m.strip() for m in line.split("|")] for line in main["layers"]]


def _docstring(path: Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text()))
    if not doc:
        raise SystemExit(f"{path.relative_to(ROOT)} has no docstring saying what it owns")
    return doc


def first_paragraph(path: Path) -> str:
    """A docstring's first paragraph on one line."""
    return " ".join(_docstring(path).split("\n\n")[0].split())


def owner_file(name: str) -> Path:
    """A rung's member: a folder's ``__init__`` or a root module."""
    folder = PACKAGE / name / "__init__.py"
    return folder if folder.exists() else PACKAGE / f"{name}.py"


def modules_of(folder: str) -> list[Path]:
    return sorted(p for p in (PACKAGE / folder).glob("*.py") if p.stem != "__init__")


def diagram() -> str:
    rungs = contract_layers()
    lines = ["```mermaid", "flowchart TB"]
    ids = [f"L{i}" for i in range(len(rungs))]
    for i, rung in enumerate(rungs):
        label = " · ".join(f"{m}/" if (PACKAGE / m).is_dir() else m for m in rung)
        lines.append(f'    {ids[i]}["{label}"]')
    lines += [f"    {a} --> {b}" for a, b in itertools.pairwise(ids)]
    lines.append("```")
    return "\n".join(lines) + "\n"


def layers_table() -> str:
    rows = ["| layer (top first) | folder or module | owns |", "|---|---|---|"]
    for i, rung in enumerate(contract_layers(), 1):
        for name in rung:
            shown = f"`{name}/`" if (PACKAGE / name).is_dir() else f"`{name}`"
            rows.append(f"| {i} | {shown} | {first_paragraph(owner_file(name))} |")
    return "\n".join(rows) + "\n"


def modules_table() -> str:
    rows = ["| module | what it does |", "|---|---|"]
    for rung in contract_layers():
        for name in rung:
            if not (PACKAGE / name).is_dir():
                continue
            for path in modules_of(name):
                rows.append(f"| `{name}/{path.stem}` | {first_paragraph(path)} |")
    return "\n".join(rows) + "\n"


SECTIONS = {"diagram": diagram, "layers": layers_table, "modules": modules_table}


def render(page: str) -> str:
    """The page with every generated section rendered from the code."""
    def fill(m: re.Match[str]) -> str:
        return m.group(1) + SECTIONS[m.group(2)]() + m.group(4)
    return MARKED.sub(fill, page)


def main(argv: list[str]) -> int:
    page = PAGE.read_text()
    new = render(page)
    if "--write" in argv:
        PAGE.write_text(new)
    else:
        sys.stdout.write(new)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
