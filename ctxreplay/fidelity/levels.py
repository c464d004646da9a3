"""The verification levels, in order: each checks what the one below it does,
and more -- ``off < signature < execute < sampled < values``.

A level is one ``Level`` here and one check step in
``ctxreplay.capture.checker`` (its ``_STEPS``): every place that asks "does
this level run the artifact?" or "does it need retained calls?" asks the
``Level``, never a list of names.
"""

from __future__ import annotations

import attrs

from ..errors import Error

__all__ = ["DEFAULT", "Level", "UnknownLevelError", "at_least", "checked_by", "level",
           "level_names"]


@attrs.frozen
class Level:
    """One verification level."""

    name: str
    """The ``capture_with(verify=...)`` value."""
    executes: bool
    """Whether it runs the artifact (so it needs the member modules)."""
    retains: bool
    """Whether it needs copies of live calls kept during the session."""
    description: str = ""
    """What it checks beyond the level below it, in words."""
    samples: bool = False
    """Whether the calls it retains are a sample chosen before each call
    runs (the others stay on the observation's fast path), rather than
    candidates taken from every call."""


class UnknownLevelError(Error, ValueError):
    """No verification level of that name; the message lists the known ones."""


_LEVELS: tuple[Level, ...] = (
    Level("off", False, False, "nothing"),
    Level("signature", False, False, "the graph's output metadata against each member's "
          "live outputs"),
    Level("execute", True, False, "the artifact run with each member's weights on fresh "
          "inputs, against the member itself"),
    Level("sampled", True, True, "the artifact run on copies of a sample of live calls "
          "(each member's first calls of each variant and a bounded reservoir of later ones "
          "per variant, chosen before the call runs), against their live outputs by value",
          samples=True),
    Level("values", True, True, "the same comparison, with copies taken from every live "
          "call (the first, the last and a reservoir between): each observed call pays a "
          "copy"),
)

#: the level ``capture_with`` verifies at unless told otherwise: values, not
#: signatures, because probes always miss some state a framework keeps outside
#: torch, and only a comparison with live values catches that
DEFAULT = "sampled"


def level_names() -> tuple[str, ...]:
    """Every level's name, lowest first."""
    return tuple(lv.name for lv in _LEVELS)


def level(name: str) -> Level:
    """The level called ``name``; an unknown name lists the known ones."""
    for lv in _LEVELS:
        if lv.name == name:
            return lv
    raise UnknownLevelError(f"unknown verification level {name!r}; choose one of "
                            f"{list(level_names())}")


def _index(name: str) -> int:
    return _LEVELS.index(level(name))


def at_least(name: str, floor: str) -> bool:
    """Whether level ``name`` checks everything level ``floor`` checks."""
    return _index(name) >= _index(floor)


def checked_by(name: str) -> tuple[str, ...]:
    """The checks level ``name`` runs: every level above ``off`` up to it."""
    return level_names()[1:_index(name) + 1]
