"""Graph passes that make an artifact independent of ambient defaults."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["pin_factory_defaults"]

_aten = torch.ops.aten


def _schema_names(target: Any) -> set[str]:
    schema = getattr(target, "_schema", None)
    return {a.name for a in schema.arguments} if schema is not None else set()


def _is_factory(target: Any) -> bool:
    schema = getattr(target, "_schema", None)
    if schema is None or not schema.arguments:
        return False
    names = {a.name for a in schema.arguments}
    first = schema.arguments[0]
    return "dtype" in names and "device" in names and "Tensor" not in str(first.type)


def pin_factory_defaults(gm: torch.fx.GraphModule) -> int:
    """Pin what ambient defaults decided at trace time (DESIGN.md fact 5).

    * Factory ops recorded without ``dtype``/``device`` get them from the
      node's traced value.
    * An op whose floating result came only from integer or bool tensors
      (type promotion against the default dtype, e.g. ``arange(3) * 0.5``)
      gets an explicit cast when that dtype is not torch's own default.

    Graphs nested in ``gm`` (bodies of higher-order ops) are pinned too.
    Returns the number of nodes changed.  Mutates ``gm`` in place.
    """
    return sum(_pin_graph(m) for m in list(gm.modules())
               if isinstance(m, torch.fx.GraphModule))


def _pin_graph(gm: torch.fx.GraphModule) -> int:
    changed = 0
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        if _is_factory(node.target):
            kwargs = dict(node.kwargs)
            if kwargs.get("dtype") is None:
                kwargs["dtype"] = val.dtype
            if kwargs.get("device") is None:
                kwargs["device"] = val.device
            if kwargs != dict(node.kwargs):
                node.kwargs = kwargs
                changed += 1
            continue
        if not val.dtype.is_floating_point or val.dtype == torch.float32:
            continue
        tensor_inputs = [a for a in node.all_input_nodes
                         if isinstance(a.meta.get("val"), torch.Tensor)]
        if not tensor_inputs or any(a.meta["val"].dtype.is_floating_point
                                    or a.meta["val"].dtype.is_complex for a in tensor_inputs):
            continue
        if "dtype" in _schema_names(node.target):
            continue
        with graph.inserting_after(node):
            cast = graph.call_function(_aten._to_copy.default, (node,), {"dtype": val.dtype})
        cast.meta["val"] = val
        node.replace_all_uses_with(cast, delete_user_cb=lambda user, c=cast: user is not c)
        changed += 1
    if changed:
        graph.lint()
        gm.recompile()
    return changed
