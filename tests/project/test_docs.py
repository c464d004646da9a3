"""The documentation is tested like code.

* Every ```` ```python ```` block in ``docs/*.md`` runs: the blocks of one page
  share a namespace and run in order, in a temporary working directory, under
  the suite's leak oracle (``conftest.py``).  A block whose first line is
  ``# requires: pkg, ...`` is skipped when one of those packages is missing.
  Display-only Python is fenced ```` ```py title="..." ````.
* A block titled with a path under ``examples/`` is that file, verbatim.
* Every public name has a docstring and an entry in ``docs/api.md`` that
  resolves to that very object (the way mkdocstrings resolves it: a submodule
  wins over a package attribute of the same name).
* Every page is in the ``mkdocs.yml`` navigation.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
import sys
import types
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from public import public_names, resolve

import ctxreplay
from ctxreplay._base.torchcaps import CAPS

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))

#: fence languages allowed in the docs; only ``python`` is executed
LANGUAGES = {"python", "py", "text", "console", "toml", "json", "yaml", "ini", "mermaid"}

_OPEN = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`]*)$")
_TITLE = re.compile(r'title="(?P<title>[^"]*)"')
_REQUIRES = re.compile(r"^#\s*requires:\s*(?P<names>[\w.\-, ]+)$")


class Block(NamedTuple):
    page: str
    line: int  # 1-based line of the opening fence
    language: str
    title: str | None
    code: str


def blocks_of(path: Path) -> list[Block]:
    """The fenced code blocks of a Markdown page, in order."""
    out: list[Block] = []
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        m = _OPEN.match(lines[i])
        if m is None:
            i += 1
            continue
        indent, fence, info = m["indent"], m["fence"], m["info"].strip()
        close = re.compile(rf"^{re.escape(indent)}{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$")
        body: list[str] = []
        j = i + 1
        while j < len(lines) and not close.match(lines[j]):
            line = lines[j]
            body.append(line[len(indent):] if line.startswith(indent) else line.lstrip())
            j += 1
        if j == len(lines):
            raise AssertionError(f"{path.name}:{i + 1}: code fence is never closed")
        language = info.split()[0] if info else ""
        title = _TITLE.search(info)
        out.append(Block(path.name, i + 1, language, title["title"] if title else None,
                         "\n".join(body) + "\n"))
        i = j + 1
    return out


def _requirements(block: Block) -> list[str]:
    first = block.code.lstrip().splitlines()[0] if block.code.strip() else ""
    m = _REQUIRES.match(first.strip())
    return [n.strip() for n in m["names"].split(",") if n.strip()] if m else []


def _missing(names: list[str]) -> list[str]:
    return [n for n in names if importlib.util.find_spec(n) is None]


def test_docs_exist() -> None:
    names = {p.name for p in PAGES}
    assert {"index.md", "quickstart.md", "concepts.md", "probes.md", "writing-probes.md",
            "recipes.md", "cli.md", "performance.md", "api.md"} <= names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_fences_are_deliberate(page: Path) -> None:
    for b in blocks_of(page):
        where = f"{b.page}:{b.line}"
        assert b.language in LANGUAGES, (
            f"{where}: fence language {b.language!r} is not one of {sorted(LANGUAGES)}; "
            "use ```python for code that runs, ```py title=\"...\" for display-only code")
        if b.language == "py":
            assert b.title, f'{where}: a display-only ```py block needs title="..."'


RUNNABLE = [p for p in PAGES if any(b.language == "python" for b in blocks_of(p))]
#: pages whose examples assert what size folding gives
FOLDING_PAGES = {"concepts.md"}


@pytest.mark.parametrize("page", RUNNABLE, ids=lambda p: p.name)
def test_python_blocks_run(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if page.name in FOLDING_PAGES and not CAPS.export_guards_sizes:
        pytest.skip(f"{page.name} shows size variants folded, which torch "
                    f"{torch.__version__} cannot guard (ctxreplay does not fold there)")
    blocks = [b for b in blocks_of(page) if b.language == "python"]
    monkeypatch.chdir(tmp_path)
    # A real module, so dataclasses, pickling and torch.export can find the
    # classes a block defines.
    name = "ctxreplay_docs_" + re.sub(r"\W", "_", page.stem)
    module = types.ModuleType(name)
    module.__file__ = str(page)
    monkeypatch.setitem(sys.modules, name, module)
    skipped: list[str] = []
    for b in blocks:
        missing = _missing(_requirements(b))
        if missing:
            skipped.append(f"line {b.line} (needs {', '.join(missing)})")
            continue
        code = compile(b.code, f"{b.page}:{b.line}", "exec")
        try:
            exec(code, module.__dict__)
        except BaseException as exc:
            raise AssertionError(
                f"{b.page}: the python block at line {b.line} failed: "
                f"{type(exc).__name__}: {exc}") from exc
    if skipped:
        pytest.skip(f"{page.name}: ran {len(blocks) - len(skipped)} of {len(blocks)} blocks; "
                    f"skipped {'; '.join(skipped)}")


def test_example_files_are_shown_verbatim() -> None:
    shown = [b for p in PAGES for b in blocks_of(p)
             if b.title and b.title.startswith("examples/")]
    assert shown, "the probe guide shows the example package's files"
    for b in shown:
        path = ROOT / b.title  # type: ignore[operator]
        assert path.is_file(), f"{b.page}:{b.line}: {b.title} does not exist"
        assert b.code.strip("\n") == path.read_text(encoding="utf-8").strip("\n"), (
            f"{b.page}:{b.line}: the block differs from {b.title}; paste the file again")


def test_example_package_is_fully_shown() -> None:
    shown = {b.title for p in PAGES for b in blocks_of(p) if b.title}
    package = ROOT / "examples" / "ctxreplay_example_probe"
    files = [package / "pyproject.toml",
             *sorted((package / "src" / "ctxreplay_example_probe").glob("*.py")),
             *sorted((package / "tests").glob("test_*.py"))]
    for f in files:
        assert str(f.relative_to(ROOT)) in shown, f"docs do not show {f.relative_to(ROOT)}"


@pytest.mark.parametrize("name", sorted(public_names()))
def test_public_name_has_docstring(name: str) -> None:
    doc = inspect.getdoc(public_names()[name])
    assert doc and doc.strip(), f"{name} has no docstring"


def test_api_reference_lists_every_public_name() -> None:
    text = (DOCS / "api.md").read_text(encoding="utf-8")
    entries = re.findall(r"^:::\s+([\w.]+)\s*$", text, flags=re.MULTILINE)
    resolved = [resolve(e) for e in entries]
    for name in ctxreplay.__all__:
        obj = getattr(ctxreplay, name)
        assert any(r is obj for r in resolved), (
            f"docs/api.md has no '::: ...' entry that renders ctxreplay.{name}")


def test_every_page_is_in_the_navigation() -> None:
    config = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    nav = set(re.findall(r"^\s+- [^:\n]+:\s*([\w./-]+\.md)\s*$", config, flags=re.MULTILINE))
    assert nav == {p.name for p in PAGES}


#: a dotted name under the package, as docstrings and pages cite objects
_REFERENCE = re.compile(r"(?<![\w./-])ctxreplay(?:\.[A-Za-z_]\w*)+")


def _docstrings() -> dict[str, str]:
    """``where`` -> docstring, for every module of the package and every class,
    function, method and property defined in it."""
    import pkgutil

    out: dict[str, str] = {}
    for info in pkgutil.walk_packages(ctxreplay.__path__, "ctxreplay."):
        module = importlib.import_module(info.name)
        out[info.name] = module.__doc__ or ""
        for name, obj in vars(module).items():
            if getattr(obj, "__module__", None) != info.name:
                continue
            if inspect.isclass(obj) or inspect.isfunction(obj):
                out[f"{info.name}.{name}"] = obj.__doc__ or ""
            if inspect.isclass(obj):
                for attr, value in vars(obj).items():
                    if inspect.isfunction(value) or isinstance(value, (property, classmethod,
                                                                       staticmethod)):
                        out[f"{info.name}.{name}.{attr}"] = getattr(value, "__doc__", "") or ""
    return out


def _entry_point_groups() -> set[str]:
    """The entry-point groups the plugin registries read: names, not objects."""
    from ctxreplay.artifacts import formats
    from ctxreplay.backends import registry as backends
    from ctxreplay.core import registry as probes

    return {probes.ENTRY_POINT_GROUP, backends.ENTRY_POINT_GROUP, formats.ENTRY_POINT_GROUP}


def unresolved(texts: dict[str, str]) -> list[str]:
    """``where: reference`` for each ``ctxreplay.X`` reference that names no object
    (an entry-point group's name left alone)."""
    bad = []
    groups = _entry_point_groups()
    for where, text in texts.items():
        for ref in sorted(set(_REFERENCE.findall(text)) - groups):
            try:
                resolve(ref)
            except (ImportError, AttributeError):
                bad.append(f"{where}: {ref}")
    return bad


def test_every_ctxreplay_reference_in_docstrings_and_pages_names_an_object() -> None:
    """A name that moved (``ctxreplay.UnknownProbeWarning`` went under
    ``ctxreplay.probes``) leaves docstrings and pages promising what is not
    there; every ``ctxreplay.X`` they cite must resolve."""
    texts = _docstrings()
    texts.update({str(p.relative_to(ROOT)): p.read_text(encoding="utf-8")
                  for p in [*PAGES, ROOT / "README.md"]})
    assert unresolved(texts) == []


def test_the_reference_check_fails_on_a_moved_name() -> None:
    assert unresolved({"here": "warns with :class:`ctxreplay.UnknownProbeWarning`, see "
                               "``ctxreplay.probes.UnknownProbeWarning`` and ctxreplay.load."}) \
        == ["here: ctxreplay.UnknownProbeWarning"]
