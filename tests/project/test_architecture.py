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

ROOT = Path(__file__).resolve().parents[2]
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


# -- names ------------------------------------------------------------------------

def _class_homes(sources: dict[str, str]) -> dict[str, list[str]]:
    """Each public (no leading underscore) top-level class name defined in
    more than one of ``sources`` (path -> text), with where."""
    homes: dict[str, list[str]] = {}
    for path, text in sources.items():
        for node in ast.parse(text).body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                homes.setdefault(node.name, []).append(path)
    return {name: paths for name, paths in homes.items() if len(paths) > 1}


def test_no_public_class_name_is_defined_in_two_modules() -> None:
    sources = {p.relative_to(ROOT).as_posix(): p.read_text()
               for p in sorted(PACKAGE.rglob("*.py"))}
    assert _class_homes(sources) == {}


def test_a_class_defined_twice_is_caught() -> None:
    twice = {"a.py": "class Entry:\n    pass\n", "b.py": "class Entry:\n    pass\n",
             "c.py": "class _Entry:\n    pass\nclass _Entry2:\n    pass\n"}
    assert _class_homes(twice) == {"Entry": ["a.py", "b.py"]}


# -- generated code ---------------------------------------------------------------

#: the one module that compiles generated source (and registers it in linecache)
CODEGEN = "ctxreplay/_base/codegen.py"


def _compiles(source: str) -> list[int]:
    """Lines of ``source`` that call the builtin ``compile`` or ``exec``."""
    return [node.lineno for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id in ("compile", "exec", "eval")]


def test_generated_code_is_compiled_in_one_module() -> None:
    found = {p.relative_to(ROOT).as_posix(): _compiles(p.read_text())
             for p in sorted(PACKAGE.rglob("*.py"))}
    assert found[CODEGEN], "codegen compiles nothing: the check below would pass vacuously"
    assert {k: v for k, v in found.items() if v and k != CODEGEN} == {}


def test_a_stray_compile_is_caught() -> None:
    assert _compiles("code = compile(src, '<x>', 'exec')\nexec(code, ns)\n") == [1, 2]
    assert _compiles("import re\nre.compile('x')\ntorch.compile(f)\n") == []


# -- parameter count ------------------------------------------------------------

MAX_PARAMETERS = 8
#: internal functions that may take more, each with its reason in a comment
#: on the line above its ``def`` that starts ``# parameters:``
MAX_EXCEPTIONS = 3
_REASON = "# parameters:"


def _wide_functions(source: str, path: str) -> dict[str, bool]:
    """``{"path:qualname": has a reason}`` for each ``def`` in ``source``
    taking more than ``MAX_PARAMETERS`` (``self``/``cls`` not counted,
    ``*args``/``**kwargs`` counted)."""
    lines = source.splitlines()
    wide: dict[str, bool] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                a = child.args
                names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)
                         if x.arg not in ("self", "cls")]
                count = len(names) + (a.vararg is not None) + (a.kwarg is not None)
                if count > MAX_PARAMETERS:
                    first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                    above = lines[first - 2].strip() if first >= 2 else ""
                    wide[f"{path}:{prefix}{child.name}"] = above.startswith(_REASON)
                visit(child, prefix + child.name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")

    visit(ast.parse(source), "")
    return wide


def _public(key: str) -> bool:
    """A module-level function the root package exports (its keywords are
    the public API's: ``capture_with`` takes every option by name)."""
    import ctxreplay

    name = key.split(":")[1]
    return "." not in name and name in getattr(ctxreplay, "__all__", ())


def test_no_internal_function_takes_more_than_eight_parameters() -> None:
    wide: dict[str, bool] = {}
    for p in sorted(PACKAGE.rglob("*.py")):
        wide.update(_wide_functions(p.read_text(), p.relative_to(ROOT).as_posix()))
    internal = {k: reason for k, reason in wide.items() if not _public(k)}
    unexplained = sorted(k for k, reason in internal.items() if not reason)
    assert not unexplained, f"more than {MAX_PARAMETERS} parameters, no reason: {unexplained}"
    assert len(internal) <= MAX_EXCEPTIONS, f"too many wide functions: {sorted(internal)}"


def test_a_wide_function_is_caught() -> None:
    """The count above can fail: nine parameters are listed, with whether a
    reason comment stands above the ``def``; eight and ``self`` are not."""
    nine = "class C:\n    def f(self, a, b, c, d, e, f, g, h, *rest):\n        pass\n"
    eight = "def g(a, b, c, d, e, f, g, *, h):\n    pass\n"
    reason = "# parameters: the public keywords\ndef h(a, b, c, d, e, f, g, h, i):\n    pass\n"
    assert _wide_functions(nine, "gen.py") == {"gen.py:C.f": False}
    assert _wide_functions(eight, "gen.py") == {}
    assert _wide_functions(reason, "gen.py") == {"gen.py:h": True}


#: test folders that are no package folder: end-to-end trust properties,
#: real-model sweeps, the project itself (docs, layers, hygiene), shared helpers
TEST_EXTRAS = {"trust", "models", "project", "helpers"}


def test_the_tests_mirror_the_package_and_no_test_module_imports_another() -> None:
    tests = ROOT / "tests"
    assert not list(tests.glob("test_*.py")), "a test module outside the folders"
    folders = {p.name for p in tests.iterdir() if p.is_dir() and p.name != "__pycache__"}
    # a package folder, or a root module (``cli``)
    package = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    package |= {p.stem for p in PACKAGE.glob("*.py")}
    assert folders - TEST_EXTRAS <= package, sorted(folders - TEST_EXTRAS - package)
    assert not list((tests / "helpers").glob("test_*.py")), "tests among the helpers"
    modules = {p.stem for p in tests.rglob("test_*.py")}
    imports = []
    for path in tests.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            imports += [f"{path.relative_to(tests)}: {n}" for n in names
                        if n.split(".")[0] in modules]
    assert imports == [], "test modules import test modules (move what they share to helpers/)"
