"""Griffe extension used by the docs build (``mkdocs.yml``).

The docstrings are written for plain ``help()`` as well as for this site, and
some use Sphinx cross-reference roles (``:func:`capture_with```).  Markdown
has no roles, so they are rewritten to code spans before rendering.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:func|class|meth|attr|mod|exc|data|obj):`~?([^`]+)`")


class SphinxRoles(griffe.Extension):
    """``:role:`name``` -> ``name`` (a Markdown code span)."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(r"`\1`", obj.docstring.value)
