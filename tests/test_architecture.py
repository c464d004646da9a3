"""docs/architecture.md lists every module once, in the order of the
import-linter layers contract in pyproject.toml (which make test enforces)."""

from __future__ import annotations

import re
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ctxreplay"


def _contract_layers() -> list[list[str]]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    contracts = config["tool"]["importlinter"]["contracts"]
    (main,) = [c for c in contracts if c.get("containers") == ["ctxreplay"]]
    assert main["type"] == "layers" and main["exhaustive"]
    return [[m.strip() for m in re.split(r"[|:]", line)] for line in main["layers"]]


def _page_rows() -> list[str]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    return re.findall(r"^\| [^|]+ \| `([\w.]+)` \|", text, flags=re.MULTILINE)


def test_every_module_is_on_the_page_once() -> None:
    modules = {p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    modules |= {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    rows = _page_rows()
    assert len(rows) == len(set(rows)), "a module is listed twice"
    assert set(rows) == modules, (sorted(modules - set(rows)), sorted(set(rows) - modules))


def test_the_page_follows_the_layers_contract_top_to_bottom() -> None:
    layer_of = {m: i for i, layer in enumerate(_contract_layers()) for m in layer}
    rows = _page_rows()
    assert set(rows) == set(layer_of), "the contract and the page name other modules"
    order = [layer_of[m] for m in rows]
    assert order == sorted(order), "the page lists a module above a layer it sits below"


#: the size past which a module holds more than one job (issue 10)
MAX_LINES = 450


def test_no_module_is_over_the_size_limit() -> None:
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines())
             for p in PACKAGE.rglob("*.py")}
    assert sizes, "no module found"
    over = {p: n for p, n in sizes.items() if n > MAX_LINES}
    assert not over, f"modules over {MAX_LINES} lines: {over}"
