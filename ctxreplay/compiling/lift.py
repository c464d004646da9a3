"""A capture's program with the member's tensors lifted to inputs, exported
again for AOTInductor.

The program's own graph (``ExportedProgram.graph_module``) already takes
every parameter, buffer and constant as a placeholder, before the call's
inputs.  ``lifted`` wraps it in a module whose inputs are the flat
function's (``dispatch.flat.Flat``): the member's tensors in
``Flat.state_names`` order, then the call's leaves.  Exported again, the
compiled program holds none of a member's weights (install passes each
member's own, read on every call, so one package serves every member and
weights updated in place are the ones a call runs with); only the
program's own tensor constants are compiled in.  A folded capture is
exported with its dynamic dimensions, each symbol over the range it was
verified over, so one compiled program serves every size of the fold.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.export.graph_signature import (
    ConstantArgument,
    InputKind,
    OutputKind,
    TensorArgument,
)

from ..dispatch.flat import Flat
from ..errors import Error
from ..specs.dims import Folding, parse_expr

__all__ = ["NotLiftable", "lifted", "lifted_export"]


class NotLiftable(Error, ValueError):
    """The program cannot be compiled with its member's tensors as inputs; the
    message says why, in words."""


class _Lifted(nn.Module):
    """``forward(*member tensors, *call leaves)`` -> the program's flat outputs."""

    def __init__(self, gm: nn.Module, order: list[tuple[str, Any]],
                 constants: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.gm = gm
        self.order = order
        for i, (name, value) in enumerate(constants.items()):
            # the program's own constants are compiled in, as the program holds them
            self.register_buffer(f"const{i}", value, persistent=False)
            self.order = [("const", f"const{i}") if o == ("const", name) else o
                          for o in self.order]

    def forward(self, *inputs: Any) -> tuple[Any, ...]:
        values = []
        for kind, at in self.order:
            if kind == "input":
                values.append(inputs[at])
            elif kind == "const":
                values.append(getattr(self, at))
            else:  # a value the graph never reads, or a constant argument
                values.append(at)
        return tuple(self.gm(*values))


def lifted(program: Any, flat: Flat) -> tuple[_Lifted, tuple[int, ...] | None]:
    """``program`` as a module taking ``(*flat.state_names tensors, *tensor leaves)``,
    and the positions of the call's leaves it takes where some are constants
    the graph holds itself (a ``None`` argument; ``None``: it takes every leaf).

    Raises ``NotLiftable`` for what this cannot lift: a graph that writes
    its buffers or inputs (BatchNorm in train mode, a static cache), one
    that threads effect tokens, a script object among its constants."""
    sig = program.graph_signature
    if any(o.kind != OutputKind.USER_OUTPUT for o in sig.output_specs):
        raise NotLiftable("its graph writes a buffer or an input in place")
    state = {name: i for i, name in enumerate(flat.state_names)}
    n_state = len(state)
    order: list[tuple[str, Any]] = []
    constants: dict[str, torch.Tensor] = {}
    leaf, position, taken = 0, 0, []
    for spec in sig.input_specs:
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
            if spec.target in state:
                order.append(("input", state[spec.target]))
            elif spec.target in program.constants:  # a non-persistent buffer
                constants[spec.target] = program.constants[spec.target]
                order.append(("const", spec.target))
            else:
                order.append(("value", None))  # in the signature, never read
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            constants[str(spec.target)] = program.constants[spec.target]
            order.append(("const", str(spec.target)))
        elif spec.kind == InputKind.USER_INPUT:
            if isinstance(spec.arg, TensorArgument):
                order.append(("input", n_state + leaf))
                taken.append(position)
                leaf += 1
            elif isinstance(spec.arg, ConstantArgument):
                order.append(("value", spec.arg.value))  # the traced call's, as the graph's
            else:
                raise NotLiftable(f"an input of the call is a {type(spec.arg).__name__}")
            position += 1
        else:
            raise NotLiftable(f"its graph takes a {spec.kind.name.lower()} input")
    keep = None if len(taken) == position else tuple(taken)
    return _Lifted(program.graph_module, order, constants), keep


def lifted_export(module: _Lifted, inputs: tuple[torch.Tensor, ...], n_state: int,
                  folding: Folding | None) -> Any:
    """``module`` exported on ``inputs``, a folded capture's dimensions dynamic
    over the ranges it was verified over.  Raises ``NotLiftable`` for a
    dimension whose expression ``torch.export`` cannot state."""
    dynamic: list[dict[int, Any] | None] = [None] * len(inputs)
    if folding is not None:
        dims = {r.name: torch.export.Dim(r.name, min=r.low, max=r.high) for r in folding.ranges}
        for d in folding.dims:
            at = n_state + d.leaf
            if at >= len(inputs) or d.dim >= inputs[at].dim():
                raise NotLiftable(f"its folding names {d.path}[{d.dim}], which its program's "
                                  "inputs do not have")
            spec = dynamic[at]
            if spec is None:
                spec = dynamic[at] = {}
            spec[d.dim] = _dim(parse_expr(d.expr), dims)
    with torch.no_grad():
        return torch.export.export(module, inputs, dynamic_shapes=(tuple(dynamic),)
                                   if folding is not None else None, strict=False)


_OPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv}


def _dim(node: ast.expr, dims: dict[str, Any]) -> Any:
    """A folding's expression (``s0``, ``s0 + 1``, ``2 * s0``) as an export ``Dim``."""
    try:
        if isinstance(node, ast.Name):
            return dims[node.id]
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](_dim(node.left, dims), _dim(node.right, dims))
    except (KeyError, TypeError, NotImplementedError) as exc:
        raise NotLiftable(f"export cannot state the dimension {ast.unparse(node)!r} "
                          f"({type(exc).__name__})") from None
    raise NotLiftable(f"export cannot state the dimension {ast.unparse(node)!r}")
