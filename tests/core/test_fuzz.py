"""Untrusted input: every loader takes arbitrary JSON and either succeeds or
raises ``ValueError`` naming a path that starts with ``$``.

Never another exception type (a ``RecursionError`` from deep nesting
included), never a long or multi-line message echoing the input, never code
execution, never unpickling, never an import.
"""

from __future__ import annotations

import builtins
import copy
import importlib
import importlib.util
import inspect
import json
import pickle
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from public import public_names

import ctxreplay
import ctxreplay._base.jsonread as cj
from ctxreplay.core.snapshots import SCHEMA

EXAMPLES = 300
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                    suppress_health_check=list(HealthCheck))
TRIED: dict[str, int] = {}
OUTCOMES = {"ok": 0, "rejected": 0}


_TMP = tempfile.TemporaryDirectory(prefix="ctxreplay-fuzz-")


def _from_file(fn: Callable[[Path], Any], *, raw: bool) -> Callable[[Any], Any]:
    """A loader that reads a file, fed a JSON value (``raw``: text or bytes)."""

    def load(data: Any) -> Any:
        if raw:
            blob = data if isinstance(data, bytes) else str(data).encode("utf-8",
                                                                         "surrogatepass")
        else:
            try:
                blob = json.dumps(data).encode("utf-8", "surrogatepass")
            except (ValueError, RecursionError):  # a huge int, or nesting json refuses
                blob = b"1" * 5000
        path = Path(_TMP.name) / "fuzz.json"
        path.write_bytes(blob)
        return fn(path)

    return load


def _loaders() -> tuple[dict[str, Callable[[Any], Any]], dict[str, Callable[[Any], Any]]]:
    """Every loader ctxreplay exposes: ``from_*`` / ``load*`` class- and static
    methods of the public classes, and public ``load*`` functions.  Those
    taking a file path are fed a file holding the document; they and the
    JSON text parser are also fed raw text."""
    values: dict[str, Callable[[Any], Any]] = {}
    texts: dict[str, Callable[[Any], Any]] = {"ctxreplay._base.jsonread.loads": cj.loads}
    for qualified, obj in public_names().items():
        name = qualified.removeprefix("ctxreplay.")
        if inspect.isclass(obj):
            for attr in dir(obj):
                if attr.startswith(("from_", "load")) and isinstance(
                        inspect.getattr_static(obj, attr, None), classmethod | staticmethod):
                    values[f"{name}.{attr}"] = getattr(obj, attr)
        elif inspect.isfunction(obj) and name.rpartition(".")[2].startswith("load"):
            params = list(inspect.signature(obj).parameters)
            if params and params[0] == "path":
                values[name] = _from_file(obj, raw=False)
                texts[f"{name}(text)"] = _from_file(obj, raw=True)
            else:
                values[name] = obj
    return values, texts


LOADERS, TEXT_LOADERS = _loaders()
assert "ContextSnapshot.from_json" in LOADERS
ALL_LOADERS = {**LOADERS, **TEXT_LOADERS}


class Forbidden(BaseException):
    """Raised (past every ``except Exception``) by a patched dangerous call."""


@contextmanager
def _no_execution() -> Iterator[None]:
    """Unpickling, eval/exec/compile and fresh imports fail loudly inside."""
    real_import = builtins.__import__

    def guarded_import(name: str, globals: Any = None, locals: Any = None,
                       fromlist: Any = (), level: int = 0) -> Any:
        full = name
        if level:
            full = importlib.util.resolve_name("." * level + name,
                                               (globals or {}).get("__package__") or "")
        if full not in sys.modules:
            raise Forbidden(f"import of {full}")
        return real_import(name, globals, locals, fromlist, level)

    def refuse(what: str) -> Callable[..., Any]:
        def fn(*args: Any, **kwargs: Any) -> Any:
            raise Forbidden(what)
        return fn

    patches: list[tuple[Any, str, Any]] = [
        (pickle, "loads", refuse("pickle.loads")), (pickle, "load", refuse("pickle.load")),
        (pickle, "Unpickler", refuse("pickle.Unpickler")),
        (builtins, "eval", refuse("eval")), (builtins, "exec", refuse("exec")),
        (builtins, "compile", refuse("compile")), (builtins, "__import__", guarded_import),
        (importlib, "import_module", refuse("importlib.import_module")),
        (torch, "load", refuse("torch.load")),
    ]
    saved = [(obj, attr, getattr(obj, attr)) for obj, attr, _ in patches]
    for obj, attr, new in patches:
        setattr(obj, attr, new)
    try:
        yield
    finally:
        for obj, attr, old in saved:
            setattr(obj, attr, old)


def _check(loader: str, data: Any) -> str:
    """Run one loader; return "ok" or "rejected", fail on anything else."""
    fn = ALL_LOADERS[loader]
    TRIED[loader] = TRIED.get(loader, 0) + 1
    try:
        with _no_execution():
            fn(data)
    except ValueError as exc:
        msg = str(exc)
        # a document's own reader names the field; a file's reader names the
        # file first (what the command line shows), then the field where one
        # is at fault
        named = msg.startswith("$") or msg.startswith(f"{Path(_TMP.name) / 'fuzz.json'}: ")
        assert named, f"{loader}: message names no '$' path nor the file: {msg[:200]!r}"
        assert "\n" not in msg and len(msg) < 1000, f"{loader}: unbounded message {msg[:200]!r}"
        OUTCOMES["rejected"] += 1
        return "rejected"
    except Forbidden as exc:  # pragma: no cover - the failure it guards against
        pytest.fail(f"{loader} tried {exc}")
    except Exception as exc:  # pragma: no cover - the failure it guards against
        pytest.fail(f"{loader} raised {type(exc).__name__}, not ValueError: {exc!s:.200}")
    OUTCOMES["ok"] += 1
    return "ok"


# -- strategies -----------------------------------------------------------------

# the usable ones: an installed package whose entry point is broken is listed
# with its error (``loaded`` false) and has no probe to fuzz
PROBES = sorted(n for n, info in ctxreplay.probes.available_probes().items() if info.loaded)
FIELDS = ["schema", "probes", "portable", "state", "type", "enabled", "cache_enabled",
          "grad_enabled", "inference_mode", "deterministic_algorithms", "warn_only",
          "cudnn_deterministic", "cudnn_benchmark", "fill_uninitialized_memory",
          "float32_matmul_precision", "flags", "cpu", "accelerator", "accelerator_state",
          "cudnn_tf32", "cuda_matmul_tf32"]
TRICKY_STRINGS = [
    "", "$", "float32", "bfloat16", "torch.float16", "int64", "bool", "quint8", "float8_e4m3fn",
    "complex128", "not_a_dtype", "cpu", "cuda", "cuda:0", "meta", "mps:3", "xla", "fpga:1",
    "cuda:99999999999999999999", "cpu:-1", "::", "highest", "medium", "high", "lowest",
    "__import__('os').system('echo pwned')", "os.system", "torch.load",
    "cos\nsystem\n(S'echo pwned'\ntR.", "\x80\x04\x95", "A" * 300, "\x00",
    SCHEMA, "ctxreplay.snapshot/2", "AAAA", "!!!notbase64", *PROBES, *FIELDS,
]
scalars = (st.none() | st.booleans()
           | st.integers() | st.integers(min_value=-(10**400), max_value=10**400)
           | st.sampled_from([2**63, -(2**63) - 1])
           | st.sampled_from([4301, 5000]).map(lambda digits: 10**digits)
           | st.floats(allow_nan=True, allow_infinity=True)
           | st.text(max_size=12) | st.sampled_from(TRICKY_STRINGS))
keys = st.sampled_from(FIELDS + PROBES) | st.text(max_size=8) | st.sampled_from(TRICKY_STRINGS)
json_values = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(keys, children, max_size=4),
    max_leaves=25,
)


def _base_docs() -> list[dict[str, Any]]:
    """Valid documents with non-neutral states, the rng probe's included."""
    out = [ctxreplay.snapshot(PROBES_PORTABLE).to_json()]
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        out.append(ctxreplay.snapshot(PROBES_PORTABLE).to_json())
    return [json.loads(json.dumps(d)) for d in out]


PROBES_PORTABLE = [n for n in PROBES if ctxreplay.probes.get_probe(n).portable]
BASE_DOCS = _base_docs()


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield prefix
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _paths(v, (*prefix, i))


@st.composite
def mutated_docs(draw: st.DrawFn) -> Any:
    doc = copy.deepcopy(draw(st.sampled_from(BASE_DOCS)))
    for _ in range(draw(st.integers(1, 3))):
        paths = list(_paths(doc))
        path = draw(st.sampled_from(paths))
        op = draw(st.sampled_from(["replace", "delete", "add", "wrap", "retype"]))
        if not path:
            if op in ("replace", "retype"):
                doc = draw(json_values)
            continue
        parent = doc
        for p in path[:-1]:
            parent = parent[p]
        last = path[-1]
        if op == "replace":
            parent[last] = draw(json_values)
        elif op == "delete":
            del parent[last]
        elif op == "add" and isinstance(parent, dict):
            parent[draw(keys)] = draw(json_values)
        elif op == "add" and isinstance(parent, list):
            parent.append(draw(json_values))
        elif op == "wrap":
            parent[last] = [parent[last]] if draw(st.booleans()) else {"state": parent[last]}
        else:  # same value, another JSON type
            v = parent[last]
            parent[last] = _text_of(v) if not isinstance(v, str) else (
                v == "true" or draw(st.sampled_from([0, 1.5, None, [v], {v: v}])))
    return doc


def _text_of(v: Any) -> str:
    try:
        return str(v)
    except ValueError:  # an int past sys.get_int_max_str_digits()
        return "<huge int>"


@st.composite
def structured_docs(draw: st.DrawFn) -> Any:
    """Right skeleton, random states: exercises every probe's decoder."""
    entries = draw(st.dictionaries(
        st.sampled_from(PROBES) | keys,
        st.fixed_dictionaries({"portable": st.booleans() | scalars},
                              optional={"state": json_values, "type": scalars}),
        max_size=4))
    schema = draw(st.sampled_from([SCHEMA, SCHEMA, SCHEMA]) | scalars)
    return {"schema": schema, "probes": entries}


# -- properties -------------------------------------------------------------------

@pytest.mark.parametrize("loader", sorted(LOADERS))
@SETTINGS
@given(data=json_values)
def test_random_json_is_loaded_or_rejected_with_a_path(loader: str, data: Any) -> None:
    _check(loader, data)


@pytest.mark.parametrize("loader", sorted(LOADERS))
@SETTINGS
@given(data=structured_docs())
def test_random_states_are_loaded_or_rejected_with_a_path(loader: str, data: Any) -> None:
    _check(loader, data)


@pytest.mark.parametrize("loader", sorted(LOADERS))
@SETTINGS
@given(data=mutated_docs())
def test_mutated_documents_are_loaded_or_rejected_with_a_path(loader: str, data: Any) -> None:
    _check(loader, data)


def _flip(text: str, at: int, char: str) -> str:
    return text[:at] + char + text[at + 1:]


json_texts = (
    st.text(max_size=200) | st.binary(max_size=200)
    | json_values.map(lambda v: json.dumps(v) if not _huge(v) else "1" * 5000)
    | st.tuples(st.sampled_from([json.dumps(d) for d in BASE_DOCS]), st.integers(0, 2000),
                st.characters()).map(lambda a: _flip(a[0], a[1] % len(a[0]), a[2]))
    | st.tuples(st.integers(1, 200_000), st.sampled_from(["[", '{"a":', '{"probes":'])).map(
        lambda a: a[1] * a[0])
)


def _huge(v: Any) -> bool:
    try:
        json.dumps(v)
    except ValueError:
        return True
    return False


@pytest.mark.parametrize("loader", sorted(TEXT_LOADERS))
@SETTINGS
@given(text=json_texts)
def test_random_text_is_parsed_or_rejected_with_a_path(loader: str, text: Any) -> None:
    _check(loader, text)


@pytest.mark.parametrize("loader", sorted(TEXT_LOADERS))
@pytest.mark.parametrize("opener", ["[", '{"a":', '{"schema": "x", "probes":'])
def test_deeply_nested_text_is_rejected_not_a_recursion_error(loader: str, opener: str) -> None:
    n = max(sys.getrecursionlimit() * 100, 200_000)
    closer = "]" if opener == "[" else "}"
    assert _check(loader, opener * n + "1" + closer * n) == "rejected"


def test_valid_documents_still_load() -> None:
    for doc in BASE_DOCS:
        assert _check("ContextSnapshot.from_json", doc) == "ok"


def _nest(depth: int, leaf: Any, kind: str) -> Any:
    v = leaf
    for _ in range(depth):
        v = [v] if kind == "list" else {"state": v}
    return v


@pytest.mark.parametrize("kind", ["list", "dict"])
@pytest.mark.parametrize("where", ["top", "probes", "entry", "state", "autocast", "matmul"])
def test_deep_nesting_is_rejected_not_a_recursion_error(kind: str, where: str) -> None:
    depth = max(sys.getrecursionlimit() * 20, 50_000)
    deep = _nest(depth, 1, kind)
    doc: Any = {
        "top": deep,
        "probes": {"schema": SCHEMA, "probes": deep},
        "entry": {"schema": SCHEMA, "probes": {"grad_mode": deep}},
        "state": {"schema": SCHEMA, "probes": {"grad_mode": {"portable": True, "state": deep}}},
        "autocast": {"schema": SCHEMA, "probes": {"autocast": {"portable": True, "state": {
            "enabled": [["cpu", deep]], "cache_enabled": True}}}},
        "matmul": {"schema": SCHEMA, "probes": {"matmul_precision": {"portable": True,
                                                                     "state": {
            "float32_matmul_precision": "highest", "flags": deep}}}},
    }[where]
    assert _check("ContextSnapshot.from_json", doc) == "rejected"
    for loader in LOADERS:  # another document type may ignore what it does not read
        _check(loader, doc)


def test_a_decoder_that_recurses_is_rejected_with_a_path() -> None:
    """A third-party decoder that blows the stack: ValueError, not RecursionError."""

    class Recursive(ctxreplay.probes.ContextProbe[int]):
        name = "recursive"

        def observe(self) -> int:
            return 0

        def replay(self, state: int) -> Any:
            raise NotImplementedError

        def decode(self, data: Any, path: str) -> int:
            return 1 + self.decode([data], path)

    doc = {"schema": SCHEMA, "probes": {"recursive": {"portable": True, "state": 1}}}
    with pytest.raises(ValueError, match=r"^\$\.probes\.recursive\.state: could not be decoded "
                                         r"\(RecursionError\)"):
        ctxreplay.ContextSnapshot.from_json(doc, probes=[Recursive()])


def test_a_decoder_error_without_a_path_gets_one() -> None:
    class Pathless(ctxreplay.probes.ContextProbe[int]):
        name = "pathless"

        def observe(self) -> int:
            return 0

        def replay(self, state: int) -> Any:
            raise NotImplementedError

        def decode(self, data: Any, path: str) -> int:
            return int(data)  # ValueError("invalid literal ...") names no path

    doc = {"schema": SCHEMA, "probes": {"pathless": {"portable": True, "state": "x\ny"}}}
    with pytest.raises(ValueError, match=r"^\$\.probes\.pathless\.state: could not be decoded"):
        ctxreplay.ContextSnapshot.from_json(doc, probes=[Pathless()])


@pytest.mark.parametrize("key", ["x" * 1_000_000, "autocast\n$.injected: fake", "a b", "é" * 200])
def test_untrusted_keys_never_make_a_long_or_multiline_message(key: str) -> None:
    for doc in ({"schema": SCHEMA, "probes": {key: {"portable": False}}},
                {"schema": SCHEMA, "probes": {"autocast": {"portable": True,
                                                           "state": {key: 1}}}},
                {"schema": SCHEMA, key: 1}):
        assert _check("ContextSnapshot.from_json", doc) == "rejected"


def test_huge_and_non_finite_numbers_are_rejected() -> None:
    for bad in (10**5000, -(10**400), float("nan"), float("inf"), -float("inf"), 1e308 * 10):
        for doc in ({"schema": SCHEMA, "probes": {"grad_mode": {"portable": True, "state": {
                        "grad_enabled": bad, "inference_mode": False}}}},
                    {"schema": bad, "probes": {}},
                    {"schema": SCHEMA, "probes": {"default_dtype": {"portable": bad}}}):
            assert _check("ContextSnapshot.from_json", doc) == "rejected"


def test_zz_examples_tried() -> None:
    """Runs last in this file: the figure for the report."""
    total = sum(TRIED.values())
    print(f"\nfuzz examples tried: {total} ({OUTCOMES['ok']} loaded, "
          f"{OUTCOMES['rejected']} rejected with a '$' path) over "
          f"{', '.join(f'{k}: {v}' for k, v in sorted(TRIED.items()))}")
