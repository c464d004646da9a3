"""Graph passes and graph facts: pinning ambient defaults into a graph,
lowering context wrappers to explicit casts, and the op summary that
fingerprints and explanations compare."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

__all__ = ["WRAPPER_HOPS", "drop_empty_wrappers", "graph_code", "graph_form", "graph_nodes",
           "graph_op_args", "graph_ops", "has_collectives",
           "has_wrapper_hops", "lower_wrappers", "pin_factory_defaults", "relax_views"]

_T = TypeVar("_T")

#: higher-order ops export records for contexts entered inside the traced
#: callable; torch.export.save rejected them on older torch (its verifier did)
WRAPPER_HOPS = frozenset({"wrap_with_autocast", "wrap_with_set_grad_enabled"})


def graph_nodes(gm: torch.fx.GraphModule) -> Iterator[torch.fx.Node]:
    """Every node of a graph and of the graphs nested in it (higher-order ops)."""
    for mod in gm.modules():
        if isinstance(mod, torch.fx.GraphModule):
            yield from mod.graph.nodes


def _per_op(fn: Callable[[Any], _T]) -> Callable[[Any], _T]:
    """``fn`` of a graph node's target, remembered for torch's operators.

    Each graph pass asks the same few facts of every node's target (its
    name, its schema's arguments); an ``OpOverload``'s schema is fixed and
    its ``str`` is rebuilt at every call, which made these passes most of
    what a capture spent outside the trace.  Only ``OpOverload`` targets are
    remembered: torch keeps one per operator for the process's life, while a
    Python callable a graph calls may hold a module and its tensors."""
    facts: dict[torch._ops.OpOverload, _T] = {}

    def per_op(target: Any) -> _T:
        if not isinstance(target, torch._ops.OpOverload):
            return fn(target)
        try:
            return facts[target]
        except KeyError:
            value = facts[target] = fn(target)
            return value

    return per_op


@_per_op
def _op_name(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    return str(getattr(target, "__name__", None) or target)


def graph_ops(gm: torch.fx.GraphModule) -> tuple[tuple[str, str | None], ...]:
    """``(op, dtype of its result)`` for every call in ``gm`` and its subgraphs."""
    out = []
    for n in graph_nodes(gm):
        if n.op != "call_function":
            continue
        val = n.meta.get("val")
        dtype = str(val.dtype).removeprefix("torch.") if isinstance(val, torch.Tensor) else None
        out.append((_op_name(n.target), dtype))
    return tuple(out)


_COLLECTIVE_NAMESPACES = ("_c10d_functional.", "c10d_functional.",
                          "_c10d_functional_autograd.", "c10d.")


def has_collectives(gm: torch.fx.GraphModule) -> bool:
    """Whether ``gm`` (or a nested graph) calls a collective: running it
    communicates, so every rank of its group must run it together."""
    return any(n.op == "call_function" and _is_collective(n.target) for n in graph_nodes(gm))


@_per_op
def _is_collective(target: Any) -> bool:
    return isinstance(target, torch._ops.OpOverload) and \
        str(target).startswith(_COLLECTIVE_NAMESPACES)


def _args_key(a: Any) -> Any:
    if isinstance(a, torch.fx.Node):
        return "%"
    if isinstance(a, (list, tuple)):
        return [_args_key(x) for x in a]
    if isinstance(a, dict):
        return {str(k): _args_key(v) for k, v in a.items()}
    return repr(a)


def graph_op_args(gm: torch.fx.GraphModule) -> tuple[str, ...]:
    """A short digest of each call's non-tensor arguments (constants, dims,
    flags), in ``graph_ops`` order: two graphs with the same ops can still
    differ here (``x * 2.0`` and ``x * 3.0``)."""
    import hashlib

    out = []
    for n in graph_nodes(gm):
        if n.op != "call_function":
            continue
        text = repr((_args_key(n.args), _args_key(dict(n.kwargs))))
        out.append(hashlib.sha256(text.encode()).hexdigest()[:8])
    return tuple(out)


def graph_code(gm: torch.fx.GraphModule) -> str:
    """The code of ``gm`` and of every graph nested in it (the bodies of
    higher-order ops such as ``wrap_with_autocast``), in module order: two
    graphs with equal code compute the same thing from the same inputs."""
    return "\n".join(f"# {name}\n{m.code}" for name, m in gm.named_modules()
                     if isinstance(m, torch.fx.GraphModule))


def has_wrapper_hops(gm: torch.fx.GraphModule) -> bool:
    """Whether ``gm`` (or a graph nested in it) holds a context-wrapper HOP."""
    return any(n.op == "call_function" and getattr(n.target, "__name__", "") in WRAPPER_HOPS
               for n in graph_nodes(gm))


def lower_wrappers(ep: Any) -> Any:
    """An ExportedProgram with context-wrapper higher-order ops lowered to
    explicit casts (or the same program when it has none)."""
    if has_wrapper_hops(ep.graph_module):
        # an empty table decomposes no op: it only re-traces, which turns
        # the context wrappers into explicit casts
        lowered = ep.run_decompositions({})
        relax_views(lowered.graph_module)
        return lowered
    return ep


def relax_views(gm: torch.fx.GraphModule) -> int:
    """Turn every ``aten.view`` of ``gm`` (and its nested graphs) into
    ``aten.reshape``; returns how many.

    A re-trace decomposes ``reshape`` into ``view`` where the traced
    (fake) strides allow a view.  Fake kernels of some composite ops report
    strides their real kernel does not return: on CPU the fake
    ``scaled_dot_product_attention`` gives its output the layout of the
    flash kernel, while the math kernel returns it contiguous, so a
    ``transpose`` + ``reshape`` after attention (T5, most transformers)
    became a ``view`` that fails on the real tensor ("view size is not
    compatible with input tensor's size and stride").  ``reshape`` is a view
    wherever one is possible and a copy elsewhere; the graph is functional
    after lowering, so no write goes through the alias either way.  Mutates
    ``gm`` in place."""
    changed = 0
    for mod in gm.modules():
        if not isinstance(mod, torch.fx.GraphModule):
            continue
        count = 0
        for node in mod.graph.nodes:
            if node.op == "call_function" and node.target is _aten.view.default:
                node.target = _aten.reshape.default
                count += 1
        if count:
            mod.recompile()
        changed += count
    return changed

_aten = torch.ops.aten


def drop_empty_wrappers(gm: torch.fx.GraphModule) -> int:
    """Remove the context-wrapper calls of ``gm`` whose body computes nothing
    (export records ``with torch.no_grad():`` around no op as a wrapper over
    an empty graph); returns how many.  They change nothing when run, and a
    ``.pt2`` cannot hold them: ``torch.export.save`` writes such a call
    without its (empty) result, and ``torch.export.load`` then refuses the
    program ("missing val field").  Mutates ``gm`` in place."""
    dropped = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.users or \
                getattr(node.target, "__name__", "") not in WRAPPER_HOPS:
            continue
        bodies = [a for a in node.args if isinstance(a, torch.fx.Node) and a.op == "get_attr"]
        if len(bodies) != 1:
            continue
        body = getattr(gm, str(bodies[0].target), None)
        if not isinstance(body, torch.fx.GraphModule) or any(
                n.op not in ("placeholder", "output") for n in body.graph.nodes):
            continue
        gm.graph.erase_node(node)
        if not bodies[0].users:
            gm.graph.erase_node(bodies[0])
        dropped += 1
    if dropped:
        gm.delete_all_unused_submodules()
        gm.recompile()
    return dropped


def graph_form(gm: torch.fx.GraphModule) -> tuple[Any, ...]:
    """``gm``'s computation with every name left out: per node its kind, op
    and arguments (nodes as positions, keyword arguments sorted, nested
    graphs by their own form).  Two graphs of one form compute the same
    thing from the same inputs, whatever their node and submodule names
    (``torch.export.load`` gives back a program's graph renamed)."""
    index: dict[torch.fx.Node, int] = {}
    out: list[Any] = []
    for i, node in enumerate(gm.graph.nodes):
        index[node] = i
        if node.op == "get_attr":
            held = getattr(gm, str(node.target), None)
            out.append(("get_attr", graph_form(held) if isinstance(held, torch.fx.GraphModule)
                        else str(node.target)))
        elif node.op == "placeholder":
            out.append(("placeholder",))
        else:
            out.append((node.op, _op_name(node.target), _form(node.args, index),
                        _form(dict(node.kwargs), index)))
    return tuple(out)


def _form(a: Any, index: dict[torch.fx.Node, int]) -> Any:
    if isinstance(a, torch.fx.Node):
        return ("%", index.get(a, -1))
    if isinstance(a, (list, tuple)):
        return tuple(_form(x, index) for x in a)
    if isinstance(a, dict):
        return tuple(sorted((str(k), _form(v, index)) for k, v in a.items()))
    return repr(a)



@_per_op
def _schema_names(target: Any) -> frozenset[str]:
    schema = getattr(target, "_schema", None)
    return frozenset(a.name for a in schema.arguments) if schema is not None else frozenset()


@_per_op
def _is_factory(target: Any) -> bool:
    schema = getattr(target, "_schema", None)
    if schema is None or not schema.arguments:
        return False
    names = {a.name for a in schema.arguments}
    first = schema.arguments[0]
    return "dtype" in names and "device" in names and "Tensor" not in str(first.type)


def pin_factory_defaults(gm: torch.fx.GraphModule) -> int:
    """Pin what ambient defaults decided at trace time: export records factory
    ops without a dtype or device, so they would follow the defaults of
    wherever the program runs.

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
        lint: Callable[[], None] = graph.lint  # untyped in torch < 2.13's stubs
        lint()
        gm.recompile()
    return changed
