"""Generated functions are compiled in one module, each under a filename of
its own whose source ``linecache`` holds while the function lives: a
traceback through one shows its lines."""

from __future__ import annotations

import ast
import gc
import inspect
import linecache
import traceback
from pathlib import Path

import pytest

import ctxreplay
from ctxreplay._base import codegen

SOURCE = ("def run(x):\n"
          "    y = x + 1\n"
          "    return table[y]\n")


def test_a_traceback_through_a_generated_function_shows_its_line() -> None:
    fn = codegen.function(SOURCE, "run", {"table": {}}, what="test")
    with pytest.raises(KeyError) as info:
        fn(1)
    frame = traceback.extract_tb(info.value.__traceback__)[-1]
    assert frame.filename.startswith("<ctxreplay test #") and frame.lineno == 3
    assert frame.line == "return table[y]"
    assert "    return table[y]\n" in "".join(traceback.format_tb(info.value.__traceback__))
    assert inspect.getsource(fn) == SOURCE


def test_each_function_has_its_own_file_and_namespace() -> None:
    first = codegen.function(SOURCE, "run", {"table": {2: "a"}}, what="test")
    other = SOURCE.replace("x + 1", "x + 2")
    second = codegen.function(other, "run", {"table": {3: "b"}}, what="test")
    assert first(1) == "a" and second(1) == "b"
    assert first.__code__.co_filename != second.__code__.co_filename
    assert linecache.getline(second.__code__.co_filename, 2).strip() == "y = x + 2"
    namespace = {"table": {}}
    codegen.function(SOURCE, "run", namespace, what="test")
    assert namespace == {"table": {}}  # run in a copy: the caller's dict is left alone


def test_the_source_is_forgotten_with_the_function() -> None:
    fn = codegen.function(SOURCE, "run", {"table": {}}, what="test")
    filename = fn.__code__.co_filename
    assert filename in linecache.cache
    linecache.checkcache()  # what a traceback of a changed file triggers: it stays
    assert filename in linecache.cache
    del fn
    gc.collect()  # (the function's globals hold it: a cycle)
    assert filename not in linecache.cache


def test_a_source_that_does_not_compile_raises_and_registers_nothing() -> None:
    before = set(linecache.cache)
    with pytest.raises(SyntaxError):
        codegen.function("def run(:\n", "run", {}, what="test")
    assert set(linecache.cache) == before


def test_no_other_module_of_the_package_compiles_or_executes_source() -> None:
    root = Path(ctxreplay.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        if path == Path(codegen.__file__):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                    and node.func.id in ("exec", "eval", "compile"):
                found.append(f"{path.relative_to(root)}:{node.lineno} {node.func.id}")
    assert found == []
