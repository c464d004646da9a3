"""The roots of what ctxreplay raises and warns: ``ctxreplay.Error`` and
``ctxreplay.Warning``.

Every public exception is an ``Error`` (so ``except ctxreplay.Error`` catches
whatever ctxreplay raises on purpose), every public warning a ``Warning``.
Each keeps the builtin base a caller may already catch -- ``KeyError`` for an
unknown probe name, ``ValueError`` for weights that do not fit, ``TypeError``
for a state JSON cannot carry -- as a second base.
"""

from __future__ import annotations

import builtins

__all__ = ["Error", "Warning"]


class Error(Exception):
    """The root of every exception ctxreplay raises on purpose."""


class Warning(builtins.UserWarning):
    """The root of every warning ctxreplay issues."""
