"""The package is layered by folders, and docs/architecture.md says so truly.

The page's diagram and tables are rendered from the code by
scripts/architecture_page.py (the layers contract in pyproject.toml, which
import-linter enforces, and each folder's docstring); these tests hold the
page, the folders and the contract to each other."""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ctxreplay"


def _page_script() -> Any:
    spec = importlib.util.spec_from_file_location(
        "architecture_page", ROOT / "scripts" / "architecture_page.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("architecture_page", module)
    spec.loader.exec_module(module)
    return module


PAGE = _page_script()


def test_the_page_holds_what_the_code_renders() -> None:
    text = PAGE.PAGE.read_text()
    assert {m[1] for m in PAGE.MARKED.findall(text)} == set(PAGE.SECTIONS), \
        "a generated section is missing from the page"
    assert text == PAGE.render(text), \
        "docs/architecture.md is stale: run python scripts/architecture_page.py --write"


def test_a_stale_page_is_caught() -> None:
    """The check above can fail: a folder's docstring edited, or a rung
    moved, changes what the page must hold."""
    text = PAGE.render(PAGE.PAGE.read_text())
    row = f"| `capture/` | {PAGE.first_paragraph(PACKAGE / 'capture' / '__init__.py')} |"
    assert row in text
    assert PAGE.render(text.replace(row, "| `capture/` | something else |")) == text


def test_the_root_holds_few_modules_and_the_folders_are_the_layers() -> None:
    modules = sorted(p.stem for p in PACKAGE.glob("*.py"))
    folders = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists())
    assert len(modules) <= 8, modules
    assert len(folders) >= 6, folders
    layered = {m for rung in PAGE.contract_layers() for m in rung}
    assert layered == (set(modules) - {"__init__"}) | set(folders)


def test_every_folder_and_module_says_what_it_owns() -> None:
    missing = [str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py")
               if not ast.get_docstring(ast.parse(p.read_text()))]
    assert not missing, f"no docstring: {missing}"
