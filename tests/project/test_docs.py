"""The documentation is tested like code.

* Every ```` ```python ```` block in ``docs/*.md`` runs: the blocks of one page
  share a namespace and run in order, in a temporary working directory, under
  the suite's leak oracle (``conftest.py``).  A block whose first line is
  ``# requires: pkg, ...`` is skipped when one of those packages is missing.
  Display-only Python is fenced ```` ```py title="..." ````.
* What a page shows a block printing is what it prints now.  A ```` ```text ````
  block without a title, right after a ```` ```python ```` or
  ```` ```console ```` block, is that block's output; so are the lines under a
  ``$ command`` inside a console block.  ``$ ctxreplay ...`` commands run in a
  fresh process in the page's working directory, as a reader runs them.  Both
  sides are normalised for addresses, timings, sizes, decimals, versions and
  column alignment; a ``...`` line stands for any lines.
* A block right after the line ``<!-- shown folded -->`` shows what size
  folding gives.  On a torch that cannot guard sizes (ctxreplay captures each
  size on its own there) such a block, and its output, must differ from what
  is shown -- every other block still prints what is shown.
* A block titled with a path under ``examples/`` is that file, verbatim.
* Every public name has a docstring and an entry in ``docs/api.md`` that
  resolves to that very object (the way mkdocstrings resolves it: a submodule
  wins over a package attribute of the same name).
* Every page is in the ``mkdocs.yml`` navigation.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import importlib.util
import inspect
import io
import os
import re
import shlex
import subprocess
import sys
import types
from pathlib import Path
from typing import NamedTuple

import pytest
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
    folded: bool = False  # shows what size folding gives (``<!-- shown folded -->``)


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
                         "\n".join(body) + "\n", i > 0 and lines[i - 1].strip() == FOLDED))
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


#: the line that marks the next block as showing what size folding gives
FOLDED = "<!-- shown folded -->"


# -- what the pages show the examples printing --------------------------------------

#: an address, a time, a size, a decimal, a version: what differs between runs
_VARYING = [
    (re.compile(r"0x[0-9a-fA-F]+"), "0x?"),
    (re.compile(r"(?<![\w.])\d+(?:\.\d+)?\s?(?:ms|µs|us|s|min)\b"), "<time>"),
    (re.compile(r"(?<![\w.])\d+(?:\.\d+)?\s?(?:B|kB|MB|GB)\b"), "<size>"),
    (re.compile(r"(?<![\w.])\d+\.\d+\.\d+[\w.+]*"), "<version>"),
    (re.compile(r"(?<![\w.])\d+\.\d+(?![\w.])"), "<decimal>"),
]


def normalise(text: str) -> list[str]:
    """The lines of an output as compared: varying values replaced, spaces
    collapsed (alignment follows the values' widths), a rule shortened."""
    lines = []
    for line in text.rstrip().splitlines():
        for pattern, placeholder in _VARYING:
            line = pattern.sub(placeholder, line)
        line = " ".join(line.split())
        lines.append("---" if line and set(line) == {"-"} else line)
    while lines and not lines[0]:
        lines.pop(0)
    return lines


def shows(shown: str, printed: str) -> bool:
    """Whether ``printed`` is what ``shown`` shows (a ``...`` line stands for
    any lines, none included)."""
    want, got = normalise(shown), normalise(printed)

    def match(i: int, j: int) -> bool:
        if i == len(want):
            return j == len(got)
        if want[i] == "...":
            return any(match(i + 1, k) for k in range(j, len(got) + 1))
        return j < len(got) and want[i] == got[j] and match(i + 1, j + 1)

    return match(0, 0)


def _outputs(blocks: list[Block], lines: list[str]) -> dict[int, str]:
    """Index of a python or console block -> the output the page shows for it:
    the text block right after it, or, after a console block, the Markdown
    table in the prose before the next block (the rows of the table the
    command prints)."""
    out = {}
    for i, b in enumerate(blocks[1:], 1):
        if b.language in ("text", "json") and b.title is None and \
                blocks[i - 1].language in ("python", "console"):
            out[i - 1] = b.code
    for i, b in enumerate(blocks):
        if b.language == "console" and i not in out and \
                b.code.strip().splitlines()[-1].startswith("$ ctxreplay "):
            end = blocks[i + 1].line - 1 if i + 1 < len(blocks) else len(lines)
            prose = lines[b.line + len(b.code.splitlines()) + 1:end]
            # up to the next heading: a table further on is the page's own
            heading = next((k for k, line in enumerate(prose) if line.startswith("#")),
                           len(prose))
            table = _table_shown(prose[:heading])
            if table is not None:
                out[i] = table
    return out


def _table_shown(prose: list[str]) -> str | None:
    """A Markdown table's header and rows as the printed table's lines, with
    whatever the command prints around it left open (``...``)."""
    rows = [line for line in prose if line.startswith("|")]
    if not rows:
        return None
    cells = [[c.strip().strip("`") for c in row.strip().strip("|").split("|")]
             for row in rows if not set(row) <= set("|-: ")]
    return "\n".join(["...", " ".join(cells[0]), "---", *(" ".join(c) for c in cells[1:]),
                      "..."])


def _commands(block: Block, after: str | None) -> list[tuple[str, str | None]]:
    """A console block's ``(command, shown output)``: the lines under a
    ``$ command``, or the text block after it for the last command."""
    out: list[tuple[str, list[str]]] = []
    for line in block.code.splitlines():
        if line.startswith("$ "):
            out.append((line[2:], []))
        elif out:
            out[-1][1].append(line)
        else:
            raise AssertionError(f"{block.page}:{block.line}: console output before "
                                 "any '$ command'")
    shown: list[tuple[str, str | None]] = [(c, "\n".join(o) if o else None) for c, o in out]
    if after is not None:
        assert shown and shown[-1][1] is None, (
            f"{block.page}:{block.line}: output both in the console block and after it")
        shown[-1] = (shown[-1][0], after)
    return shown


def run_command(command: str, cwd: Path) -> str:
    """``ctxreplay ...`` in a fresh process, stdout and stderr as a terminal
    88 columns wide shows them."""
    argv = shlex.split(command, comments=True)
    assert argv[0] == "ctxreplay", argv
    env = {**os.environ, "COLUMNS": "88"}
    proc = subprocess.run([sys.executable, "-m", "ctxreplay.cli", *argv[1:]], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=600, check=False)
    return proc.stdout + proc.stderr


def _console(block: Block, after: str | None, cwd: Path) -> list[tuple[str, str, str]]:
    """``(what, shown, printed)`` for each command of a console block that
    shows output; a command the test cannot run shows none."""
    checked = []
    for command, shown in _commands(block, after):
        if not command.startswith("ctxreplay"):
            assert shown is None, (f"{block.page}:{block.line}: shows the output of "
                                   f"{command!r}, which the docs test cannot run")
            continue
        printed = run_command(command, cwd)
        if shown is not None:
            checked.append((f"{block.page}:{block.line} $ {command}", shown, printed))
    return checked


def _diff(what: str, shown: str, printed: str) -> str:
    lines = difflib.unified_diff(normalise(shown), normalise(printed), "shown", "printed",
                                 lineterm="")
    return f"{what}: the page shows another output than the code prints now\n" + \
        "\n".join(lines) + "\n--- printed, verbatim:\n" + printed


def run_page(page: Path, cwd: Path, module: types.ModuleType) -> tuple[list[str], list[str]]:
    """Run a page's python and console blocks in order; ``(differences,
    skipped)`` between what it shows them printing and what they print.  On
    a torch that does not fold, a block marked folded must differ instead
    (an assertion it makes may fail): the lines of those that do not are
    differences."""
    blocks = blocks_of(page)
    outputs = _outputs(blocks, page.read_text(encoding="utf-8").splitlines())
    differences: list[str] = []
    skipped: list[str] = []
    for i, b in enumerate(blocks):
        unfolded = b.folded and not CAPS.export_guards_sizes
        if b.language == "console":
            found = [_diff(*c) for c in _console(b, outputs.get(i), cwd)
                     if not shows(c[1], c[2])]
        elif b.language != "python":
            continue
        elif missing := _missing(_requirements(b)):
            skipped.append(f"line {b.line} (needs {', '.join(missing)})")
            continue
        else:
            found = _python(b, outputs.get(i), module, unfolded)
        if unfolded:
            found = [] if found else [f"{b.page}:{b.line}: marked as showing size folding, "
                                      "but it prints what is shown on a torch that does not fold"]
        differences += found
    return differences, skipped


def _python(b: Block, shown: str | None, module: types.ModuleType, unfolded: bool) -> list[str]:
    """Run one python block in the page's namespace; its difference from
    what the page shows it printing.  A failed assertion is a difference
    where ``unfolded`` (the block asserts what folding gives); any other
    failure fails the test."""
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            exec(compile(b.code, f"{b.page}:{b.line}", "exec"), module.__dict__)
    except AssertionError as exc:
        if not unfolded:
            raise AssertionError(f"{b.page}: the python block at line {b.line} failed: "
                                 f"AssertionError: {exc}") from exc
        return [f"{b.page}:{b.line}: an assertion failed"]
    except BaseException as exc:
        raise AssertionError(
            f"{b.page}: the python block at line {b.line} failed: "
            f"{type(exc).__name__}: {exc}") from exc
    if shown is not None and not shows(shown, printed.getvalue()):
        return [_diff(f"{b.page}:{b.line}", shown, printed.getvalue())]
    return []


#: pages whose examples run: python blocks, or ctxreplay commands
RUNNABLE = [p for p in PAGES if any(
    b.language == "python" or (b.language == "console" and "$ ctxreplay" in b.code)
    for b in blocks_of(p))]


@pytest.mark.parametrize("page", RUNNABLE, ids=lambda p: p.name)
def test_examples_run_and_print_what_is_shown(page: Path, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "88")  # the width a command's tables wrap to
    # A real module, so dataclasses, pickling and torch.export can find the
    # classes a block defines.
    name = "ctxreplay_docs_" + re.sub(r"\W", "_", page.stem)
    module = types.ModuleType(name)
    module.__file__ = str(page)
    monkeypatch.setitem(sys.modules, name, module)
    differences, skipped = run_page(page, tmp_path, module)
    assert not differences, "\n\n".join(differences)
    if skipped:
        pytest.skip(f"{page.name}: ran every block but {'; '.join(skipped)}")


def _words(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").split())


def test_the_readme_and_the_performance_page_are_written_for_users() -> None:
    # a README is a newcomer's first page, not a test log; the performance page
    # holds the targets and where the time goes, and history goes to the changelog
    assert _words(ROOT / "README.md") <= 800
    assert _words(DOCS / "performance.md") <= 2500
    performance = (DOCS / "performance.md").read_text(encoding="utf-8")
    assert not re.search(r"^#+\s*History", performance, flags=re.MULTILINE)
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", performance), "dated: the changelog's"
    changelog = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    version = importlib.import_module("ctxreplay._base.version").__version__
    assert "## [Unreleased]" in changelog and f"## [{version}] - " in changelog
    assert (ROOT / "CONTRIBUTING.md").is_file()


def test_the_readme_example_runs_and_prints_what_it_shows(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    readme = ROOT / "README.md"
    assert [b.language for b in blocks_of(readme)].count("python") == 1
    monkeypatch.chdir(tmp_path)
    module = types.ModuleType("ctxreplay_docs_readme")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    differences, skipped = run_page(readme, tmp_path, module)
    assert (differences, skipped) == ([], [])
    assert len([line for line in blocks_of(readme)[1].code.splitlines()
                if line.strip()]) <= 10, "the README's example is ten lines"


def test_the_output_check_fails_on_a_drifted_output(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("""
```python
print(f"unsupported_graph  {object()!r}  took {0.25} s")
```

```text
trace_error  <object object at 0x7f0c2d1e4a30>  took 1.5 s
```

```python
print(f"unsupported_graph  {object()!r}  took {0.25} s")
print("a", "b")
```

```text
unsupported_graph    <object object at 0x7f0c2d1e4a30>  took 168 ms
...
```

```console
$ ctxreplay --version
```

```text
ctxreplay 0.0.1
```

```console
$ ctxreplay snapshot grad_mode autocast
```

Shown as a table:

| probe | state |
|---|---|
| `autocast` | `cpu:bfloat16` |
| `grad_mode` | `grad` |
""", encoding="utf-8")
    module = types.ModuleType("ctxreplay_docs_fixture")
    differences, skipped = run_page(page, tmp_path, module)
    assert skipped == []
    # the drifted word is found; an address, a time, alignment, a version and
    # '...' are not drift
    assert len(differences) == 2, differences
    assert "\n-trace_error <object object at 0x?> took <time>\n" in differences[0]
    # a Markdown table shown for a command's output is its rows: autocast is off
    assert "\n-autocast cpu:bfloat16\n" in differences[1]
    assert shows(_table_shown(["| a | b |", "|---|---|", "| `x` | 1 |"]) or "",
                 "head\na b\n---\nx 1\n")
    assert shows("ctxreplay 0.0.1\n", "ctxreplay 9.2.0rc1\n")
    assert not shows("a\n...\nc\n", "a\nb\n")
    assert shows("a\n...\nc\n", "a\nc\n") and shows("a\n...\nc\n", "a\nb\nb\nc\n")
    assert not shows("x 12 calls\n", "x 13 calls\n")


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
