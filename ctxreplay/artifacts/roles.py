"""What each output of a captured program is: the call's own output, or a
write of state -- so a tool that reads only the saved program and its
sidecar can tell the two apart.

A program ctxreplay traced returns, after the call's own outputs, the tensors
the forward assigned to its argument objects (a ``DynamicCache`` layer's new
``keys`` and ``values``): torch's output specs call those ``USER_OUTPUT``
too, as they are outputs of the traced function.  And a functional
``torch.export`` program (``run_decompositions``) returns the buffers and
inputs it writes in place first, as ``BUFFER_MUTATION`` /
``USER_INPUT_MUTATION`` outputs, which ``ExportedProgram.module()`` applies
in place instead of returning.  ``program_roles`` joins the two: torch's
specs for the mutations, the capture's own knowledge for the rest.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import torch

from .._base.jsonread import read_bool, read_list, read_mapping, read_str

__all__ = ["ROLES", "OutputRole", "program_roles", "roles_from_json", "roles_to_json",
           "tree_children", "tree_paths"]

#: each ``OutputRole.kind``, in words
ROLES = {
    "output": "the call's own output, at its path in what the call returns",
    "assigned": "a tensor the forward assigns to an argument object (an attribute or item "
                "at the path)",
    "buffer": "a buffer of the block, written in place",
    "parameter": "a parameter of the block, written in place",
    "input": "an input tensor of the call, written in place",
    "token": "an effect token torch threads through side-effecting ops",
}

#: the kinds ``ExportedProgram.module()`` returns; it applies the others in place
_RETURNED = ("output", "assigned")

#: torch's ``OutputKind`` names of the mutations, and the kind each is here
_MUTATIONS = {"BUFFER_MUTATION": "buffer", "PARAMETER_MUTATION": "parameter",
              "USER_INPUT_MUTATION": "input", "TOKEN": "token"}

#: the wrapper a flattened capture traces holds the block as ``inner``
_FLATTENED_PREFIX = "inner."


@attrs.frozen
class OutputRole:
    """What one output of a captured program is (metadata only: a kind and
    a path, never a value).

    ``path`` says where: for ``"output"`` the place in the call's return
    value (``out``, ``out[0]``, ``out[1]['z']``); for ``"assigned"`` and
    ``"input"`` the argument it writes (``kwargs['past_key_values'].layers[0].keys``,
    ``args[1]``); for ``"buffer"`` and ``"parameter"`` the block's own name
    for the tensor (``running_mean``); for ``"token"`` torch's name."""

    kind: str = attrs.field(validator=attrs.validators.in_(ROLES))
    """One of ``ROLES``."""
    path: str
    """Where the output belongs or what it writes (see the class)."""

    @property
    def returned(self) -> bool:
        """Whether ``ExportedProgram.module()`` returns it (``output``,
        ``assigned``); it applies the others in place."""
        return self.kind in _RETURNED

    def to_json(self) -> dict[str, Any]:
        """``{"kind", "path", "returned"}``."""
        return {"kind": self.kind, "path": self.path, "returned": self.returned}


def roles_to_json(roles: Sequence[OutputRole] | None) -> list[dict[str, Any]] | None:
    """The roles as JSON, in output order; ``None``: not known."""
    return None if roles is None else [r.to_json() for r in roles]


def roles_from_json(value: object, path: str) -> tuple[OutputRole, ...] | None:
    """The roles a document holds at ``path`` (``None`` or absent: not known);
    a malformed entry raises ``ValueError`` naming its path."""
    if value is None:
        return None
    return tuple(_role(v, f"{path}[{i}]") for i, v in enumerate(read_list(value, path)))


def _role(value: object, path: str) -> OutputRole:
    doc = read_mapping(value, path, keys={"kind", "path", "returned"},
                       required={"kind", "path"})
    role = OutputRole(read_str(doc["kind"], f"{path}.kind", choices=set(ROLES)),
                      read_str(doc["path"], f"{path}.path", max_len=4096))
    if "returned" in doc and read_bool(doc["returned"], f"{path}.returned") != role.returned:
        raise ValueError(f"{path}.returned: a {role.kind!r} output is "
                         f"{'' if role.returned else 'not '}returned")
    return role


# -- paths in a pytree spec ---------------------------------------------------------

def tree_paths(spec: Any, prefix: str) -> list[str]:
    """The path of each leaf of a ``torch.utils._pytree.TreeSpec``, in
    flattening order, written as ctxreplay writes paths: ``[i]`` into a
    sequence, ``['key']`` into a dict, ``.<i>`` into another pytree node."""
    return list(_leaf_paths(spec, prefix))


def tree_children(spec: Any) -> list[Any]:
    """A ``TreeSpec``'s child specs: ``children()`` from torch 2.10,
    ``children_specs`` before (deprecated after)."""
    kids = getattr(spec, "children", None)
    return list(kids() if callable(kids) else spec.children_specs)


def _leaf_paths(spec: Any, prefix: str) -> Iterator[str]:
    if spec.is_leaf():
        yield prefix
        return
    for i, child in enumerate(tree_children(spec)):
        yield from _leaf_paths(child, prefix + _step(spec, i))


def _step(spec: Any, i: int) -> str:
    if spec.type in (dict, collections.OrderedDict):  # context: the keys
        return f"[{spec.context[i]!r}]"
    if spec.type in (tuple, list) or issubclass(spec.type, tuple):
        return f"[{i}]"
    return f".<{i}>"


# -- a program's roles --------------------------------------------------------------

def program_roles(program: Any, returned: Sequence[OutputRole] | None, binding: str,
                  leaves: Sequence[str]) -> tuple[OutputRole, ...] | None:
    """The role of each output of ``program``, in the order of its graph's
    outputs: ``returned`` (what the traced function returns, in order) for
    torch's ``USER_OUTPUT`` specs, torch's own specs for the mutations.
    ``binding`` and ``leaves`` (the call's tensor leaf paths) say which
    input a mutated one is.  ``None`` where it cannot be told: the returned
    roles are not known or do not match the program's user outputs, or
    torch names an output kind not known here."""
    if returned is None:
        return None
    if not isinstance(program, torch.export.ExportedProgram):
        return tuple(returned)  # a graph module returns what the traced function does
    inputs = _input_paths(program, binding, leaves)
    own = iter(returned)
    out: list[OutputRole] = []
    for spec in program.graph_signature.output_specs:
        kind = spec.kind.name
        role = next(own, None) if kind == "USER_OUTPUT" else _mutation(kind, spec.target,
                                                                         binding, inputs)
        if role is None:
            return None
        out.append(role)
    return tuple(out) if next(own, None) is None else None


def _mutation(kind: str, target: str | None, binding: str,
              inputs: dict[str, str] | None) -> OutputRole | None:
    role = _MUTATIONS.get(kind)
    if role is None or target is None:
        return None
    if role == "input":
        path = None if inputs is None else inputs.get(target)
        return None if path is None else OutputRole(role, path)
    if role in ("buffer", "parameter") and binding == "flattened":
        target = target.removeprefix(_FLATTENED_PREFIX)
    return OutputRole(role, target)


def _input_paths(program: torch.export.ExportedProgram, binding: str,
                 leaves: Sequence[str]) -> dict[str, str] | None:
    """Placeholder name -> the call's path of each user input.  The user
    inputs of the graph signature are the flattened inputs in order: a
    flattened capture takes the call's tensor leaves positionally, a native
    one ``(args, kwargs)`` as its ``in_spec`` flattens them."""
    specs = [s for s in program.graph_signature.input_specs if s.kind.name == "USER_INPUT"]
    in_spec = program.call_spec.in_spec
    if binding == "flattened":
        paths = list(leaves)
    elif in_spec is None or len(tree_children(in_spec)) != 2:
        return None
    else:
        args, kwargs = tree_children(in_spec)
        paths = tree_paths(args, "args") + tree_paths(kwargs, "kwargs")
    if len(paths) != len(specs):
        return None
    return {s.arg.name: p for s, p in zip(specs, paths) if hasattr(s.arg, "name")}
