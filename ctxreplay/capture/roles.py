"""The role of each output of a traced program: what the traced function
returns (the call's outputs, then the tensors the forward assigned to its
argument objects) joined with torch's specs of the writes in place
(``artifacts.roles.program_roles``).

The traced function returns, for a flattened output, the tensor leaves of
the call's output then the assigned tensors; otherwise the call's output
(``(out, *assigned)`` where the forward assigns some): ``assigned.joined_result``.
"""

from __future__ import annotations

from typing import Any

from ..artifacts.roles import OutputRole, program_roles, tree_children, tree_paths
from ..specs.signature import CallSpec, Spec, tensor_leaves
from .assigned import Assigned, joined

__all__ = ["output_roles", "returned_roles"]


def output_roles(artifact: Any, inputs: CallSpec, outputs: Spec | None,
                 assigned: Assigned | None, binding: str,
                 flatten_out: bool) -> tuple[OutputRole, ...] | None:
    """The role of each of ``artifact``'s graph outputs, in order (``None``:
    not known, as for a program whose specs this code cannot read: the
    roles are metadata, and a capture is no less faithful without them)."""
    try:
        returned = returned_roles(artifact, outputs, assigned, flatten_out)
        return program_roles(artifact, returned, binding, [p for p, _ in inputs.leaves()])
    except Exception:  # roles are metadata: a program not read has none
        return None


def returned_roles(artifact: Any, outputs: Spec | None, assigned: Assigned | None,
                   flatten_out: bool) -> tuple[OutputRole, ...] | None:
    """What the traced function returns, in order: the call's output
    leaves, then the assigned tensors (``None``: not known)."""
    writes = () if assigned is None else \
        tuple(OutputRole("assigned", joined(p)) for p in assigned.tensors)
    own = _own_paths(artifact, outputs, bool(writes), flatten_out)
    if own is None:
        return None
    return (*(OutputRole("output", p) for p in own), *writes)


def _own_paths(artifact: Any, outputs: Spec | None, assigns: bool,
               flatten_out: bool) -> list[str] | None:
    """The paths in the call's return value of the leaves it returns."""
    if flatten_out:  # the tensor leaves, in spec order (``tensor_values``)
        return None if outputs is None else [p for p, _ in tensor_leaves(outputs, "out")]
    spec = _out_spec(artifact)
    if spec is None:
        return None
    if assigns:  # ``(out, *assigned)``
        spec = tree_children(spec)[0]
    return tree_paths(spec, "out")


def _out_spec(artifact: Any) -> Any:
    """The pytree spec the program's flat outputs are rebuilt by: an
    ``ExportedProgram``'s ``call_spec``, a graph module's ``_out_spec``
    (set by torch.fx's pytree codegen); ``None``: not known."""
    call_spec = getattr(artifact, "call_spec", None)
    if call_spec is not None:
        return call_spec.out_spec
    return getattr(artifact, "_out_spec", None)
