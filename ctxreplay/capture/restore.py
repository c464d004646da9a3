"""Putting a member's recorded attributes back on the view a capture runs.

A variant is keyed by the member's identity when it ran (``training`` and
the plain attributes of it and its submodules, callables such as an
attention processor included).  When an attribute was toggled after the
variant ran (``use_gate`` off for one call and back on; a processor swapped
by ``set_processor``), finalize() finds the module in another state than
the call saw: the view the variant is traced and checked on gets the values
the call ran with (``VariantRequest.state``, only those that differ now).
A value that could not be recorded fails the capture
(``state_not_restorable``) rather than tracing the state finalize() finds.
"""

from __future__ import annotations

import copy
import enum
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..errors import Error
from .options import NO_ATTRIBUTE, Unrestorable

__all__ = ["NotRestorable", "restore_state"]

_IMMUTABLE = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device,
              torch.layout, torch.memory_format, enum.Enum, type)


class NotRestorable(Error):
    """A recorded attribute cannot be put back: ``str()`` names it."""


def restore_state(view: nn.Module, state: Iterable[tuple[str, str, Any]]) -> None:
    """Set each ``(submodule path, attribute, value)`` on ``view`` (an
    isolated view: the user's module is never written); ``NO_ATTRIBUTE`` deletes."""
    for path, name, value in state:
        where = f"{path}.{name}" if path else name
        if value is not NO_ATTRIBUTE and isinstance(value, Unrestorable):
            raise NotRestorable(f"{where} ({value.type_name})")
        try:
            sub = view.get_submodule(path) if path else view
        except AttributeError:
            raise NotRestorable(f"{where} (no submodule {path!r})") from None
        if value is NO_ATTRIBUTE:
            if name in sub.__dict__:
                delattr(sub, name)
            continue
        if not (callable(value) or isinstance(value, _IMMUTABLE)):
            value = copy.deepcopy(value)  # each view its own: a trace may change it
        setattr(sub, name, value)
