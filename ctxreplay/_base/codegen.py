"""Generated Python functions, compiled in one place so a traceback shows them.

ctxreplay writes a few functions as source at run time, where a per-call
path must not pay for generality: the observer's state check, a member's
state reader, a call's argument rematch and a captured program flattened
to one function.  ``function`` compiles each under a filename of its own
(``<ctxreplay NAME #N>``) and registers its source in :mod:`linecache`, as
attrs does for the methods it generates: a traceback through the function,
``pdb`` and ``inspect.getsource`` then show the generated lines rather than
nothing.  The entry is dropped when the function is collected, so a process
that generates many functions (a rematch per argument layout, a checker per
snapshot) does not keep every source it ever made.

Generated sources hold names only: the objects they use (getters, tensors,
ops) are bound in the namespace, never written into the text, so what
linecache holds is no data of the user's.

This module imports only the standard library, so any layer may import it.
"""

from __future__ import annotations

import itertools
import linecache
import weakref
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["function"]

_serial = itertools.count(1)  # next() on a count is atomic under the GIL


def function(source: str, name: str, namespace: Mapping[str, Any], *,
             what: str) -> Callable[..., Any]:
    """The function ``name`` that ``source`` defines, run in a copy of
    ``namespace`` (its globals).

    ``what`` says in a word or two what the code is (``"flat program"``); it
    names the pseudo-file, with a serial number that makes it unique.
    ``SyntaxError`` (and ``RecursionError`` for a source nested too deep for
    the compiler) propagate; nothing is registered then."""
    filename = f"<ctxreplay {what} #{next(_serial)}>"
    code = compile(source, filename, "exec")
    globs = dict(namespace)
    exec(code, globs)
    fn: Callable[..., Any] = globs[name]
    # (size, mtime, lines, name): an mtime of None marks an entry that
    # ``linecache.checkcache`` keeps, as it keeps those a module loader made
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    weakref.finalize(fn, linecache.cache.pop, filename, None).atexit = False
    return fn
