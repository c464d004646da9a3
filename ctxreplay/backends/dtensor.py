"""Exporting modules parallelised with ``torch.distributed.tensor`` (DTensor).

Tensor parallelism (``parallelize_module`` with ``ColwiseParallel`` /
``RowwiseParallel``) makes the module's parameters DTensors and wraps its
submodules in input and output hooks that call ``DTensor.from_local`` and
``to_local``.  Two facts of torch 2.13 shape what is done here:

* ``torch.export`` of such a module fails in ``DTensor.from_local``:
  "Expected all pytree.tree_leaves ... to be graphable types, but found
  non-fx-graphable type DTensorSpec. If this type is meant to be constant,
  mark it as via pytree.register_constant".  ``traceable`` registers it
  so for the trace, and removes it after (unless it was registered before).
* The program then still holds DTensors: ``flat_apply`` nodes building them
  and DTensor parameters, which no serialiser writes and which run the
  collectives eagerly, outside the graph.  ``run_decompositions()``
  desugars them: the graph takes each parameter's
  local shard (named ``<module>.parametrizations.<name>.original0``, the
  inner tensors in ``__tensor_flatten__`` order) and issues the collectives
  as ``_c10d_functional`` ops.  Measured on two gloo ranks: an MLP with
  column- and row-wise linears becomes ``addmm`` + ``all_reduce`` +
  ``wait_tensor``, bit-identical to the eager module, and saves and loads.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.utils._pytree as pytree

__all__ = ["desugared", "holds_dtensors", "traceable"]


def _dtensor_types() -> tuple[type, type] | None:
    """``(DTensor, DTensorSpec)``, or ``None`` where torch has no DTensor."""
    try:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._dtensor_spec import DTensorSpec
    except ImportError:
        return None
    return DTensor, DTensorSpec


def holds_dtensors(tensors: Any) -> bool:
    """Whether any of ``tensors`` (an iterable of tensors) is a DTensor."""
    types = _dtensor_types()
    return types is not None and any(isinstance(t, types[0]) for t in tensors)


@contextmanager
def traceable(module: torch.nn.Module) -> Iterator[None]:
    """Inside, ``torch.export`` can trace ``module`` where its forward builds
    DTensors: ``DTensorSpec`` is a pytree constant, for a module that holds
    DTensor parameters only, and only until the trace ends."""
    types = _dtensor_types()
    if types is None or not holds_dtensors(module.parameters()):
        yield
        return
    spec = types[1]
    if spec in pytree.SUPPORTED_NODES:  # the user registered it: leave it
        yield
        return
    pytree.register_constant(spec)
    try:
        yield
    finally:
        pytree._deregister_pytree_node(spec)


def desugared(ep: Any) -> Any:
    """A program whose state holds DTensors, re-traced into local tensors and
    functional collectives (``run_decompositions()``); any other program
    as it is."""
    state = (*ep.state_dict.values(), *ep.constants.values())
    if not holds_dtensors(t for t in state if isinstance(t, torch.Tensor)):
        return ep
    # the default (core ATen) table, not an empty one: DTensor has no
    # sharding rule for a composite op such as ``aten.linear`` ("AssertionError
    # in _propagate_op_sharding_dispatch_slow_path"); decomposed, ``addmm`` has one
    return ep.run_decompositions()
