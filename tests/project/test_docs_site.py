"""The built documentation site, read the way a browser shows it.

``tests/project/test_docs.py`` runs the examples in the Markdown sources; this file
builds the site (``mkdocs build --strict``, as ``make docs`` does) into a
temporary directory and checks the HTML a reader gets:

* code on the guide pages fits the content column (88 characters a line);
* the pictures are there (Mermaid diagrams);
* every public name, and every public attribute of the records a user reads
  most, has a description on the API page, and ``capture_with`` shows real
  types;
* every reason code the package defines is explained on Troubleshooting;
* the test runner's ``# requires:`` markers are not rendered;
* search splits identifiers at dots, so ``ambient_only`` finds
  ``capture.ambient_only``.
"""

from __future__ import annotations

import importlib
import itertools
import json
import re
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import attrs
import pytest
from public import resolve  # as mkdocstrings resolves a ::: path

import ctxreplay
from ctxreplay.artifacts import sidecar
from ctxreplay.cache import use as cache_use
from ctxreplay.capture import results as records
from ctxreplay.dispatch import install as dispatch
from ctxreplay.fidelity import verify
from ctxreplay.loading import compiled, needs
from ctxreplay.report import explain, manifest

pytest.importorskip("mkdocs")
pytest.importorskip("mkdocstrings")

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
MAX_CODE_LINE = 88


# -- a small DOM, enough to read the built pages ---------------------------------

_VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta",
         "source", "track", "wbr"}


@attrs.define(eq=False)
class Node:
    tag: str
    attrs: dict[str, str]
    children: list[Node | str] = attrs.field(factory=list)

    @property
    def classes(self) -> set[str]:
        return set(self.attrs.get("class", "").split())

    def text(self) -> str:
        return "".join(c if isinstance(c, str) else c.text() for c in self.children)

    def iter(self) -> Iterator[Node]:
        yield self
        for c in self.children:
            if isinstance(c, Node):
                yield from c.iter()

    def find_all(self, tag: str, cls: str | None = None) -> list[Node]:
        return [n for n in self.iter() if n.tag == tag and (cls is None or cls in n.classes)]

    def by_id(self, ident: str) -> Node | None:
        return next((n for n in self.iter() if n.attrs.get("id") == ident), None)


class _Builder(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.root = Node("#root", {})
        self.stack = [self.root]

    def handle_starttag(self, tag: str, attributes: list[tuple[str, str | None]]) -> None:
        node = Node(tag, {k: v or "" for k, v in attributes})
        self.stack[-1].children.append(node)
        if tag not in _VOID:
            self.stack.append(node)

    def handle_endtag(self, tag: str) -> None:
        for i in range(len(self.stack) - 1, 0, -1):
            if self.stack[i].tag == tag:
                del self.stack[i:]
                return

    def handle_data(self, data: str) -> None:
        self.stack[-1].children.append(data)


def parse(path: Path) -> Node:
    builder = _Builder()
    builder.feed(path.read_text(encoding="utf-8"))
    builder.close()
    return builder.root


# -- the site ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mkdocs.commands.build import build
    from mkdocs.config import load_config

    out = tmp_path_factory.mktemp("site")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(ROOT)  # the griffe extension and hook paths are relative to it
        mp.setenv("NO_MKDOCS_2_WARNING", "1")
        config = load_config(str(ROOT / "mkdocs.yml"), site_dir=str(out), strict=True)
        build(config)  # strict: any warning aborts
    return out


def pages(site: Path) -> dict[str, Path]:
    """Page name (the Markdown file's stem) -> its built HTML."""
    out = {}
    for md in sorted(DOCS.glob("*.md")):
        html = site / "index.html" if md.stem == "index" else site / md.stem / "index.html"
        assert html.is_file(), f"{md.name} was not built"
        out[md.stem] = html
    return out


def guide_pages(site: Path) -> dict[str, Path]:
    return {k: v for k, v in pages(site).items() if k != "api"}


def _content(page: Node) -> Node:
    (article,) = page.find_all("article")
    return article


def code_blocks(page: Node) -> list[Node]:
    """The code a reader sees: every ``<pre>`` except Mermaid sources, which the
    browser draws as diagrams."""
    return [pre for pre in _content(page).find_all("pre") if "mermaid" not in pre.classes]


def long_code_lines(built: dict[str, Node]) -> tuple[int, list[str]]:
    """(code lines seen, those longer than ``MAX_CODE_LINE``) on these pages."""
    too_long = []
    seen = 0
    for name, page in built.items():
        for pre in code_blocks(page):
            for line in pre.text().splitlines():
                seen += 1
                if len(line) > MAX_CODE_LINE:
                    too_long.append(f"{name}: {len(line)} chars: {line[:60]}...")
    return seen, too_long


def test_guide_code_fits_the_column(site: Path) -> None:
    seen, too_long = long_code_lines({k: parse(v) for k, v in guide_pages(site).items()})
    assert seen > 500, "no code found: the page structure changed under this test"
    assert not too_long, (f"{len(too_long)} guide-page code lines are longer than "
                          f"{MAX_CODE_LINE} characters:\n  " + "\n  ".join(too_long))


def _fixture_page(body: str, tmp_path: Path) -> Node:
    path = tmp_path / "page.html"
    path.write_text(f"<html><body><article>{body}</article></body></html>",
                    encoding="utf-8")
    return parse(path)


def test_the_line_check_fails_on_a_long_line(tmp_path: Path) -> None:
    fits = "x" * MAX_CODE_LINE
    page = _fixture_page(
        f'<pre><code>{fits}\n{fits}y</code></pre>'
        f'<pre class="mermaid"><code>{"m" * 200}</code></pre>', tmp_path)
    seen, too_long = long_code_lines({"fixture": page})
    assert seen == 2  # the Mermaid source is a picture, not code
    assert too_long == [f"fixture: {MAX_CODE_LINE + 1} chars: {'x' * 60}..."]


#: pages that explain a flow with a picture
DIAGRAM_PAGES = {"index": 1, "concepts": 2, "artifacts": 1, "distributed": 1, "architecture": 1}


def test_the_flows_have_pictures(site: Path) -> None:
    built = pages(site)
    total = 0
    for name, path in built.items():
        found = len([pre for pre in parse(path).find_all("pre", "mermaid")
                     if pre.text().strip()])
        total += found
        assert found >= DIAGRAM_PAGES.get(name, 0), (
            f"{name}: {found} Mermaid diagrams, expected {DIAGRAM_PAGES[name]}")
    assert total >= 4


def foreign_scripts(page: Node) -> list[str]:
    """The ``<script src>`` of a page that another host would serve."""
    return [n.attrs["src"] for n in page.find_all("script")
            if re.match(r"^(?:[a-z][a-z0-9+.-]*:)?//", n.attrs.get("src", ""), re.I)]


def test_the_site_loads_no_script_from_another_host(site: Path, tmp_path: Path) -> None:
    # offline, or behind a firewall, a script from unpkg.com never loads and the
    # diagrams show as their source: the site ships the Mermaid it draws with
    for name, path in pages(site).items():
        page = parse(path)
        assert foreign_scripts(page) == [], name
        local = [n.attrs["src"] for n in page.find_all("script")
                 if n.attrs.get("src", "").endswith("javascripts/mermaid.tiny.js")]
        assert len(local) == 1, f"{name}: the shipped Mermaid script is not loaded"
    shipped = site / "javascripts" / "mermaid.tiny.js"
    assert shipped.stat().st_size > 100_000 and b"globalThis" in shipped.read_bytes()[-300:]
    assert "MIT" in (site / "javascripts" / "mermaid.LICENSE").read_text(encoding="utf-8")
    fixture = _fixture_page('<script src="https://unpkg.com/mermaid@11/dist/mermaid.min.js">'
                            '</script><script src="//cdn.example/x.js"></script>'
                            '<script src="assets/bundle.js"></script>', tmp_path)
    assert foreign_scripts(fixture) == ["https://unpkg.com/mermaid@11/dist/mermaid.min.js",
                                        "//cdn.example/x.js"]


# -- the API page --------------------------------------------------------------------

def test_signatures_are_formatted_to_the_column(site: Path) -> None:
    # without Black or Ruff, mkdocstrings renders each signature on one line
    # (capture_with's was 4,862 px wide in a 938 px column)
    api = parse(site / "api" / "index.html")
    signatures = [n for n in api.iter() if "doc-signature" in n.classes]
    assert len(signatures) > 50
    wide = [sig.text().splitlines()[0][:60] for sig in signatures
            if max(len(line) for line in sig.text().splitlines()) > MAX_CODE_LINE]
    assert not wide, f"signatures wider than {MAX_CODE_LINE} characters: {wide}"
    obj, _ = _api_objects(site)["ctxreplay.capture_with"]
    (signature,) = [n for n in obj.iter() if "doc-signature" in n.classes][:1]
    assert len(signature.text().strip().splitlines()) > 10  # a parameter a line

def _api_objects(site: Path) -> dict[str, tuple[Node, Node]]:
    """Object id (``ctxreplay.Capture.scope``) -> (the object's element, its
    contents)."""
    return api_objects(parse(site / "api" / "index.html"))


def api_objects(api: Node) -> dict[str, tuple[Node, Node]]:
    out: dict[str, tuple[Node, Node]] = {}
    for obj in api.iter():
        if "doc-object" not in obj.classes:
            continue
        heading = next((c for c in obj.children if isinstance(c, Node)
                        and "doc-heading" in c.classes), None)
        contents = next((c for c in obj.children if isinstance(c, Node)
                         and "doc-contents" in c.classes), None)
        if heading is not None and contents is not None and heading.attrs.get("id"):
            out[heading.attrs["id"]] = (obj, contents)
    return out


def _description(contents: Node) -> str:
    """The object's own text: its docstring, not its members'."""
    parts = [c.text() if isinstance(c, Node) and "doc-children" not in c.classes
             else c if isinstance(c, str) else "" for c in contents.children]
    return " ".join("".join(parts).split())


def _api_entries() -> dict[str, Any]:
    """``::: path`` entries of docs/api.md -> the object each one renders."""
    text = (DOCS / "api.md").read_text(encoding="utf-8")
    return {path: resolve(path)
            for path in re.findall(r"^:::\s+([\w.]+)\s*$", text, flags=re.MULTILINE)}


def test_every_public_name_is_described(site: Path) -> None:
    objects = _api_objects(site)
    entries = _api_entries()
    for name in ctxreplay.__all__:
        obj = getattr(ctxreplay, name)
        paths = [p for p, o in entries.items() if o is obj]
        assert paths, f"docs/api.md renders no entry for ctxreplay.{name}"
        assert paths[0] in objects, f"the API page has no heading {paths[0]!r}"
        assert _description(objects[paths[0]][1]), f"{paths[0]}: no description"


def undescribed(objects: dict[str, tuple[Node, Node]]) -> list[str]:
    return [ident for ident, (_, contents) in objects.items() if not _description(contents)]


def test_the_description_check_fails_on_an_empty_entry(tmp_path: Path) -> None:
    def entry(ident: str, text: str, children: str = "") -> str:
        return (f'<div class="doc doc-object"><h3 id="{ident}" class="doc doc-heading">'
                f'{ident}</h3><div class="doc doc-contents">{text}'
                f'<div class="doc doc-children">{children}</div></div></div>')
    page = _fixture_page(entry("m.Described", "<p>Says what it is.</p>",
                               entry("m.Described.empty", "")), tmp_path)
    objects = api_objects(page)
    assert set(objects) == {"m.Described", "m.Described.empty"}
    # a member's text is not its parent's, and an empty member is found
    assert undescribed(objects) == ["m.Described.empty"]


def test_every_object_on_the_api_page_is_described(site: Path) -> None:
    objects = _api_objects(site)
    assert len(objects) > 300, "the API page lost its members"
    empty = undescribed(objects)
    assert not empty, "API entries without a description (add a docstring; for an " \
                      "attribute, a string literal right after it):\n  " + "\n  ".join(empty)


def _public_members(cls: type) -> set[str]:
    names = {f.name for f in attrs.fields(cls) if not f.name.startswith("_")}
    for klass in cls.__mro__[:-1]:  # what it inherits is its public face too
        names |= {n for n, v in vars(klass).items() if not n.startswith("_")
                  and (isinstance(v, (property, classmethod, staticmethod)) or callable(v))}
    return names


@pytest.mark.parametrize("cls", [ctxreplay.Capture, ctxreplay.CaptureReport,
                                 ctxreplay.CaptureFailure, ctxreplay.Fidelity],
                         ids=lambda c: c.__name__)
def test_every_public_attribute_of_the_main_records_is_described(site: Path,
                                                                 cls: type) -> None:
    objects = _api_objects(site)
    members = _public_members(cls)
    assert {"artifact", "fidelity", "ambient_only"} <= members or cls is not ctxreplay.Capture
    for member in sorted(members):
        ident = f"ctxreplay.{cls.__name__}.{member}"
        assert ident in objects, f"the API page does not list {ident}"
        assert _description(objects[ident][1]), f"{ident}: no description"


def test_capture_with_shows_real_types(site: Path) -> None:
    obj, contents = _api_objects(site)["ctxreplay.capture_with"]
    signatures = [n for n in obj.iter() if "doc-signature" in n.classes]
    assert signatures, "capture_with: no rendered signature"
    text = " ".join(signatures[0].text().split())
    for shown in ("probes: Sequence[str | ContextProbe[Any]] | None",
                  "targets: str | Sequence[str] | Callable[[str, Module], bool] | None",
                  "backend: str | Backend", "-> CaptureSession"):
        assert shown in text, f"capture_with's signature does not show {shown!r}: {text}"
    assert not re.search(r":\s*object\b", text), text
    # and its parameters are a table, one row each, every row described
    rows = [tr for table in contents.find_all("table") for tr in table.find_all("tr")]
    documented = {" ".join(tr.find_all("td")[0].text().split()): tr for tr in rows
                  if tr.find_all("td")}
    import inspect
    for param in inspect.signature(ctxreplay.capture_with).parameters:
        assert param in documented, f"capture_with: parameter {param!r} has no row"
        assert len(" ".join(documented[param].text().split())) > len(param) + 10, param


def returns_tables(page: Node) -> list[Node]:
    """The tables that follow a ``Returns:`` section title."""
    out = []
    for parent in page.iter():
        kids = [c for c in parent.children if isinstance(c, Node)]
        for title, table in itertools.pairwise(kids):
            if title.text().strip() == "Returns:" and table.tag == "table" and any(
                    "doc-section-title" in n.classes for n in title.iter()):
                out.append(table)
    return out


def split_returns(page: Node) -> list[list[str]]:
    """Returns tables whose description runs over several rows: a paragraph
    griffe read as one return value per line."""
    out = []
    for table in returns_tables(page):
        rows = [" ".join(tr.find_all("td")[-1].text().split())
                for tr in table.find_all("tr") if tr.find_all("td")]
        if len(rows) > 1:
            out.append(rows)
    return out


def test_returns_are_one_description(site: Path, tmp_path: Path) -> None:
    api = parse(site / "api" / "index.html")
    assert len(returns_tables(api)) >= 3, "the API page lost its Returns: sections"
    assert not split_returns(api)
    title = '<p><span class="doc-section-title">Returns:</span></p>'
    split = _fixture_page(f"{title}<table><tr><th>Type</th><th>Description</th></tr>"
                          "<tr><td>A</td><td>The open A: use it, then</td></tr>"
                          "<tr><td>A</td><td>call it.</td></tr></table>", tmp_path)
    assert split_returns(split) == [["The open A: use it, then", "call it."]]


# -- troubleshooting ---------------------------------------------------------------

#: section of docs/troubleshooting.md -> the codes the package defines for it
CODES: dict[str, tuple[str, ...]] = {
    "capture-failures": records.FAILURE_REASONS,
    "problems-why-ok-is-false": tuple(records.PROBLEMS),
    "notices": tuple(records.NOTICES),
    "fidelity": verify.FIDELITY_STATUSES,
    "explain": (*explain.STATUSES, *explain.EFFECT_REASONS),
    "saving": (*sidecar.ARTIFACT_ERRORS, *manifest.NOT_SAVED_REASONS),
    "loading-and-checking": (*needs.DIFFERENCE_KINDS, *needs.ENVIRONMENT_FIELDS),
    "dispatch-misses": dispatch.MISS_REASONS,
    "capture-cache": cache_use.NOT_STORED_REASONS,
    "compiled-programs": compiled.COMPILED_REASONS,
}


def _sections(page: Node) -> dict[str, list[Node]]:
    """h2 id -> the elements up to the next h2."""
    article = _content(page)
    out: dict[str, list[Node]] = {}
    current: list[Node] | None = None
    for child in article.children:
        if not isinstance(child, Node):
            continue
        if child.tag == "h2":
            current = out.setdefault(child.attrs.get("id", ""), [])
        elif current is not None:
            current.append(child)
    return out


def unexplained_codes(page: Node, codes: dict[str, tuple[str, ...]]) -> list[str]:
    """Codes that the page's section does not explain in a table row of the
    code, its cause and what to do."""
    sections = _sections(page)
    missing = []
    for section, wanted in codes.items():
        if section not in sections:
            missing.append(f"no section #{section}")
            continue
        explained: dict[str, list[str]] = {}
        for element in sections[section]:
            for tr in element.find_all("tr"):
                cells = tr.find_all("td")
                if len(cells) >= 3:
                    first = cells[0].find_all("code")
                    if first:
                        explained[first[0].text()] = [" ".join(c.text().split())
                                                      for c in cells[1:]]
        for code in wanted:
            if code not in explained:
                missing.append(f"#{section}: {code!r} is not explained")
            elif not all(len(cell) > 3 for cell in explained[code]):
                missing.append(f"#{section}: {code!r} needs a cause and what to do")
    return missing


def test_every_reason_code_is_explained(site: Path) -> None:
    missing = unexplained_codes(parse(site / "troubleshooting" / "index.html"), CODES)
    assert not missing, "troubleshooting:\n  " + "\n  ".join(missing)


def test_the_code_check_fails_on_a_missing_or_bare_code(tmp_path: Path) -> None:
    page = _fixture_page(
        '<h2 id="codes">Codes</h2><table><tr><th>code</th><th>cause</th><th>do</th></tr>'
        "<tr><td><code>known</code></td><td>A cause.</td><td>What to do.</td></tr>"
        "<tr><td><code>bare</code></td><td>A cause.</td><td></td></tr></table>",
        tmp_path)
    assert unexplained_codes(page, {"codes": ("known",)}) == []
    assert unexplained_codes(page, {"codes": ("known", "bare", "new_code"),
                                    "elsewhere": ("x",)}) == [
        "#codes: 'bare' needs a cause and what to do",
        "#codes: 'new_code' is not explained",
        "no section #elsewhere"]


#: a module-level constant with one of these names lists codes the package
#: reports (``FAILURE_REASONS``, ``MISS_REASONS``, ``FIDELITY_STATUSES``, ...)
CODE_CONSTANT = re.compile(r"(?:^|_)(?:REASONS|STATUSES|ERRORS|KINDS|FIELDS)$|^PROBLEMS$|^NOTICES$")


def code_constants() -> dict[str, tuple[str, ...]]:
    """``module.NAME`` -> its codes, for every code constant in the package."""
    import pkgutil

    out: dict[str, tuple[str, ...]] = {}
    for info in pkgutil.walk_packages(ctxreplay.__path__, "ctxreplay."):
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if (not name.startswith("_") and CODE_CONSTANT.search(name)
                    and isinstance(value, (tuple, dict))):
                codes = tuple(value)
                if codes and all(isinstance(c, str) for c in codes):
                    out[f"{info.name}.{name}"] = codes
    return out


def test_every_code_constant_is_on_the_troubleshooting_page() -> None:
    # CODES says which section explains which constant; a constant a new
    # module adds must be placed there too, or this fails
    found = code_constants()
    assert {"ctxreplay.capture.results.FAILURE_REASONS",
            "ctxreplay.dispatch.install.MISS_REASONS",
            "ctxreplay.fidelity.verify.FIDELITY_STATUSES", "ctxreplay.capture.results.PROBLEMS",
            "ctxreplay.report.manifest.NOT_SAVED_REASONS"} <= set(found)
    covered = {code for codes in CODES.values() for code in codes}
    left_out = {name: sorted(set(codes) - covered) for name, codes in found.items()
                if set(codes) - covered}
    assert not left_out, f"codes no troubleshooting section is checked for: {left_out}"


def test_reason_code_constants_are_not_empty() -> None:
    # the constants this page is checked against must name real codes
    assert "trace_error" in records.FAILURE_REASONS and "state_leak" in records.FAILURE_REASONS
    assert "signature" in dispatch.MISS_REASONS
    assert all(re.fullmatch(r"[a-z][a-z0-9_ ]*", c) for codes in CODES.values() for c in codes)


# -- what the reader never sees, and search ---------------------------------------

def test_runner_markers_are_not_rendered(site: Path) -> None:
    marked = [p for p in DOCS.glob("*.md") if "# requires:" in p.read_text(encoding="utf-8")]
    assert marked, "no page uses '# requires:' any more: drop this test and the hook"
    for name, path in pages(site).items():
        for pre in code_blocks(parse(path)):
            assert "# requires:" not in pre.text(), f"{name}: a '# requires:' marker is shown"


def test_search_splits_identifiers_at_dots(site: Path) -> None:
    index = json.loads((site / "search" / "search_index.json").read_text(encoding="utf-8"))
    separator = re.compile(index["config"]["separator"])
    concepts = " ".join(d["text"] for d in index["docs"]
                        if d["location"].startswith("concepts/"))
    assert "capture.ambient_only" in concepts.lower()  # how the page spells it
    tokens = {t for t in separator.split(concepts.lower()) if t}
    assert "ambient_only" in tokens, "search cannot find ambient_only on Concepts"


#: guide pages that must link into the API reference
LINKED_PAGES = ("quickstart", "concepts", "artifacts", "troubleshooting", "writing-probes")


def api_links(page: Node) -> set[str]:
    """The API entries a page links to (``ctxreplay.Capture.fidelity``)."""
    return {a.attrs["href"].split("#", 1)[1] for a in _content(page).find_all("a")
            if "api/#ctxreplay." in a.attrs.get("href", "")}


def test_guides_link_into_the_api(site: Path) -> None:
    built = pages(site)
    objects = _api_objects(site)
    for name in LINKED_PAGES:
        links = api_links(parse(built[name]))
        assert links, f"{name}: no link into the API reference"
        assert links <= set(objects), f"{name}: links to missing entries {links - set(objects)}"


def test_the_site_cites_only_what_it_holds(site: Path) -> None:
    # DESIGN.md is the maintainers' notes, not part of the repository
    cited = [name for name, path in pages(site).items()
             if "DESIGN.md" in _content(parse(path)).text()]
    assert not cited, f"pages citing DESIGN.md, which a reader cannot open: {cited}"


def test_quickstart_shows_how_to_install(site: Path) -> None:
    # nothing is published on PyPI: `pip install ctxreplay` fails on a fresh machine
    quickstart = parse(pages(site)["quickstart"])
    shown = "\n".join(pre.text() for pre in code_blocks(quickstart))
    assert "$ pip install .\n" in shown and "$ pip install torch\n" in shown
    assert "pip install ctxreplay" not in shown
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "\npip install torch " in readme and "\npip install . " in readme
    assert "pip install ctxreplay" not in readme
