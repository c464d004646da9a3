"""MkDocs hook used by the docs build (``mkdocs.yml``).

A runnable example that needs an optional package starts with a marker line
for the test runner (``tests/project/test_docs.py``)::

    # requires: transformers

The marker is for the runner, not for the reader: it is dropped from the
rendered page.  The Markdown source keeps it, so the runner still sees it.
"""

from __future__ import annotations

import re
from typing import Any

# a ```python fence whose first line is the marker (as tests/project/test_docs.py reads it)
_MARKER = re.compile(
    r"^(?P<fence>[ \t]*(?:`{3,}|~{3,})[ \t]*python\b[^\n]*\n)[ \t]*#\s*requires:[^\n]*\n",
    re.MULTILINE)


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    return _MARKER.sub(r"\g<fence>", markdown)
