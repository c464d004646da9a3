"""The package states the facts it relies on where it uses them.

A comment or docstring that points at a design note outside the repository
("DESIGN.md fact 12") or at an issue number ("issue 16") leaves a maintainer
with nothing to follow; these tests keep such citations out of the package
and its build metadata."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: a design-note file, a numbered fact, or an issue number (``issue 16``,
#: ``issues 3``, ``issue #16``, ``(issue``)
CITATION = re.compile(r"DESIGN\.md|\bDESIGN\b|(?i:\bfacts? \d|\bissues? #?\d|\(issue)")


def _sources() -> list[Path]:
    files = [p for p in sorted((ROOT / "ctxreplay").rglob("*"))
             if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"]
    return [*files, ROOT / "pyproject.toml"]


def _citations(text: str) -> list[str]:
    return [f"{n}: {line.strip()}" for n, line in enumerate(text.splitlines(), 1)
            if CITATION.search(line)]


def test_no_file_of_the_package_cites_a_design_note_or_an_issue() -> None:
    found = {str(p.relative_to(ROOT)): hits for p in _sources()
             if (hits := _citations(p.read_text(encoding="utf-8")))}
    assert len(_sources()) > 50  # the walk found the package
    assert found == {}, "state the fact where it is used instead of citing it"


@pytest.mark.parametrize("line", [
    "    module changes (DESIGN.md fact 20); buffers the graph",
    "    #: before 2.7 per issue 16).  From the version.",
    '"""SDPA backend selection (issue 15): which backends',
    "# see fact 4 for why",
    "# the facts 3-5 of the design",
    "# fixed in Issue #12",
    "# as DESIGN says",
])
def test_the_check_catches_a_citation(line: str) -> None:
    assert _citations(line) == [f"1: {line.strip()}"]


@pytest.mark.parametrize("line", [
    "factory ops recorded without a dtype (``torch.ones(3)``)",
    "the artifact carries it; a design choice, measured on torch 2.13",
    "counter: Any = attrs.field(factory=itertools.count)",
    "fixed by pytorch PR 159565, in 2.9.0",
])
def test_the_check_leaves_plain_text_alone(line: str) -> None:
    assert _citations(line) == []
