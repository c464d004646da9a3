"""A captured program as one flat Python function, for dispatch's per-call path.

``ExportedProgram.module()`` is built for generality, and a call of it pays
for that every time: forward pre-hooks that walk the inputs' pytree and
match key paths against the in-spec, a guard submodule whose forward is
wrapped in a Dynamo config patch (a context manager entered per call),
``get_attr`` reads of every parameter through ``Module.__getattr__``, a
pytree flatten and unflatten, and for each ``wrap_with_set_grad_enabled`` /
``wrap_with_autocast`` region a closure wrapped in ``torch._dynamo.disable``
made anew on every call (torch/_higher_order_ops/wrap.py).  Measured on a
``Linear(32)`` + ``tanh`` block traced under ``no_grad``: ~250 us a call,
where the block itself runs in ~25 us.  Each op of the generated code is
also reached through ``torch.ops.<ns>.<op>.<overload>`` and
``OpOverload.__call__``, about 2 us an op more than the op's own C++
callable (``OpOverload._op``) -- a decoder layer of ~70 ops ran 15% slower
than its eager forward for that alone.

``flatten`` writes, once per program, one Python function (``Flat.fn``)
that runs the same ops in the same order, from the graph of that module:

* the member's parameters and buffers are its leading arguments, so a call
  passes the member's own tensors (``Flat.state_names`` says which, in
  order) and one function serves every member;
* then the call's leaves in the in-spec's order; it returns the flat leaves
  of the out-spec, rebuilt by ``Flat.rebuild``;
* each op is called through its own C++ callable, bound in the function's
  namespace (never written into its source);
* a grad-mode or autocast region is inlined between the calls that enter
  and leave the state torch's region enters and leaves, in a ``try`` /
  ``finally``, so the state is restored also when an op raises;
* torch's input guard runs where sizes are symbolic (a folded capture's
  guard may refuse sizes its ranges take) and is left out for fixed sizes,
  whose every guard is an equality the call's matched signature holds, as
  are the ``_assert_tensor_metadata`` checks export adds around ``.to()``
  (the inputs', weights' and context's metadata are those it traced);
* each value is deleted after its last use, as torch's generated code
  does, so a call holds no more memory than the module's.

The in-place copies torch inserts for mutated buffers and inputs stay, so a
program that writes a buffer (BatchNorm in train mode) or an input (a
static KV cache) writes the member's own tensors, as the eager forward does.
A graph holding anything this writer does not know (another code
generator, a submodule call, inputs that are modules) is not flattened:
``flatten`` returns the reason, and dispatch runs ``program.module()``.

Each torch internal this leans on is a field of ``CAPS``, checked against
the installed torch (``_base/torchcaps.py``): an op is its ``_op``
(``op_overload_calls_op``), a region's enter and exit are
``autocast_enter`` / ``autocast_exit`` (``autocast_inlinable``), the guard
runs without its config patch (``export_guards_fn_in_closure``), the
module's graph carries its specs (``fx_pytree_codegen``).  Where one does
not hold, ops are called through their overload and the guard through its
``forward``; a program with an autocast region, or without the specs, is
not flattened.  The function is compiled by ``_base/codegen.py``: a
traceback through a dispatched call shows its lines.
"""

from __future__ import annotations

import keyword
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx, nn

from .._base import codegen
from .._base.torchcaps import (
    CAPS,
    autocast_enter,
    autocast_exit,
    autocast_resolved,
    guards_fn_body,
)

__all__ = ["Flat", "flatten"]

_HOPS = torch.ops.higher_order
_GRAD = getattr(_HOPS, "wrap_with_set_grad_enabled", None)
_AUTOCAST = getattr(_HOPS, "wrap_with_autocast", None)
_ASSERT_METADATA = getattr(getattr(torch.ops.aten, "_assert_tensor_metadata", None),
                           "default", None)
_OP_CALL = torch._ops.OpOverload.__call__


class _Unsupported(Exception):
    """The graph holds something this writer does not know."""


class Flat:
    """A program flattened by ``flatten``: ``fn(*state, *leaves)`` returns its flat outputs."""

    __slots__ = ("fn", "in_spec", "out_spec", "positional", "rebuild", "source", "state_meta",
                 "state_names")

    def __init__(self, fn: Callable[..., Any], source: str, state_names: tuple[str, ...],
                 state_meta: tuple[tuple[tuple[int, ...], torch.dtype, torch.device], ...],
                 in_spec: pytree.TreeSpec, out_spec: pytree.TreeSpec) -> None:
        self.fn = fn
        #: the generated source (names only: every op and constant is bound in
        #: the function's namespace)
        self.source = source
        #: the parameters and buffers the program takes first, by their names
        #: in the traced module, and the shape, dtype and device of each
        self.state_names = state_names
        self.state_meta = state_meta
        self.in_spec, self.out_spec = in_spec, out_spec
        #: how many positional arguments a call of plain leaves has (the
        #: in-spec is ``((leaf, ...), {})``), else ``-1``
        self.positional = _positional(in_spec)
        self.rebuild: Callable[[Sequence[Any]], Any] = _rebuilder(out_spec)

    def leaves(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        """The call's leaves in the in-spec's order (keyword arguments in its order)."""
        kids = _children(self.in_spec)
        keys = kids[1].context if len(kids) == 2 and kids[1].type is dict else ()
        return pytree.tree_leaves((args, {k: kwargs[k] for k in keys} if kwargs else {}))


def _children(spec: pytree.TreeSpec) -> list[pytree.TreeSpec]:
    # ``children()`` from torch 2.10; ``children_specs`` before (deprecated after)
    kids = getattr(spec, "children", None)
    return list(kids() if callable(kids) else spec.children_specs)


def _positional(in_spec: pytree.TreeSpec) -> int:
    if in_spec.type is not tuple or in_spec.num_children != 2:
        return -1
    args, kwargs = _children(in_spec)
    if kwargs.type is not dict or kwargs.num_children or args.type is not tuple:
        return -1
    if not all(c.is_leaf() for c in _children(args)):
        return -1
    return args.num_children


def _rebuilder(out_spec: pytree.TreeSpec) -> Callable[[Sequence[Any]], Any]:
    if out_spec.is_leaf():
        return _first
    if out_spec.type is tuple and all(c.is_leaf() for c in _children(out_spec)):
        return tuple
    return lambda flat: pytree.tree_unflatten(list(flat), out_spec)


def _first(flat: Sequence[Any]) -> Any:
    return flat[0]


def flatten(program: Any, *, keep_guards: bool) -> Flat | str:
    """``program`` (an ``ExportedProgram``) as a ``Flat``, or why it cannot be one.

    ``keep_guards``: run the input guard torch generated (symbolic sizes)."""
    if not isinstance(program, torch.export.ExportedProgram):
        return "not an ExportedProgram"
    if _holds_modules(program):
        return "a graph input is a module"
    gm: Any = program.module()  # (a GraphModule; typed nn.Module in torch 2.7's stubs)
    info = getattr(gm.graph._codegen, "pytree_info", None) if CAPS.fx_pytree_codegen else None
    if info is None or info.in_spec is None or info.out_spec is None:
        return "the program's module has no pytree specs"
    if (info.in_spec, info.out_spec) != (program.call_spec.in_spec, program.call_spec.out_spec):
        return "the program's module has other pytree specs than the program"
    sig = program.graph_signature
    writer = _Writer(gm, keep_guards)
    try:
        state = _state_of(gm, {*sig.parameters, *sig.buffers})
        fn, source = writer.function(gm.graph, state)
    except _Unsupported as exc:
        return str(exc)
    meta = tuple((tuple(t.shape), t.dtype, t.device) for t in state.values())
    return Flat(fn, source, tuple(state), meta, info.in_spec, info.out_spec)


def _holds_modules(program: Any) -> bool:
    """Whether a graph input is a module (torch's module then enters a state
    for it around every call, which the flat function does not).  Read from
    the in-spec, where export records such an input as a node of its module
    class: a program loaded from a file or the cache holds no example inputs."""
    try:
        spec = program.call_spec.in_spec
        inputs = program.example_inputs
    except Exception:  # properties of another torch's program: held modules
        return True
    if spec is not None and _spec_has_module(spec):
        return True
    return inputs is not None and any(isinstance(leaf, nn.Module)
                                      for leaf in pytree.tree_leaves(inputs))


def _spec_has_module(spec: pytree.TreeSpec) -> bool:
    if isinstance(spec.type, type) and issubclass(spec.type, nn.Module):
        return True
    return any(_spec_has_module(c) for c in _children(spec))


def _state_of(gm: fx.GraphModule, wanted: set[str]) -> dict[str, torch.Tensor]:
    """The program's own tensor of each parameter and buffer its graph reads, in order."""
    state: dict[str, torch.Tensor] = {}
    for node in gm.graph.find_nodes(op="get_attr"):
        target = str(node.target)
        if target in wanted and target not in state:
            owner_name, _, leaf = target.rpartition(".")
            owner = gm.get_submodule(owner_name) if owner_name else gm
            t: torch.Tensor | None = owner._parameters.get(leaf)
            if t is None:
                t = owner._buffers.get(leaf)
            if t is None:
                raise _Unsupported(f"the program reads {target}, which it does not hold")
            state[target] = t
    return state


class _Writer:
    """Writes one graph (regions inlined) as the source of one function."""

    def __init__(self, gm: fx.GraphModule, keep_guards: bool) -> None:
        self.gm, self.keep_guards = gm, keep_guards
        self.namespace: dict[str, Any] = {"_is_grad": torch.is_grad_enabled,
                                          "_set_grad": torch._C._set_grad_enabled,
                                          "_ac_enter": autocast_enter,
                                          "_ac_exit": autocast_exit}
        self.bound: dict[int, str] = {}  # id(object) -> its name in the namespace
        self.consts: set[str] = set()  # those names: values never deleted
        #: (indent, text, the values it reads)
        self.lines: list[tuple[int, str, tuple[str, ...]]] = []
        self.count = 0

    def function(self, graph: fx.Graph, state: dict[str, torch.Tensor]
                 ) -> tuple[Callable[..., Any], str]:
        env: dict[fx.Node, str] = {}
        names = list(state)
        for node in graph.find_nodes(op="get_attr"):
            if str(node.target) in state:
                env[node] = f"s{names.index(str(node.target))}"
        params = [f"s{i}" for i in range(len(state))]
        for node in graph.find_nodes(op="placeholder"):
            env[node] = self.fresh("a")
            params.append(env[node])
        reads: list[str] = []
        out = self.body(graph, env, 1, reads)
        self.lines.append((1, f"return {out}", tuple(reads)))
        source = f"def run({', '.join(params)}):\n" + self.render()
        fn = codegen.function(source, "run", self.namespace, what="flat program")
        return fn, source

    def fresh(self, prefix: str = "v") -> str:
        self.count += 1
        return f"{prefix}{self.count}"

    def body(self, graph: fx.Graph, env: dict[fx.Node, str], indent: int,
             out_reads: list[str]) -> str:
        """Write ``graph``'s nodes (its inputs already in ``env``); returns the
        expression of its output (the values it reads added to ``out_reads``)."""
        for node in graph.nodes:
            if node in env:
                continue
            if node.op == "placeholder":
                raise _Unsupported("a region's input is not bound")
            if node.op == "output":
                return self.expr(node.args[0], env, out_reads)
            if node.op == "get_attr":
                env[node] = self.const(_attr(self.gm, str(node.target)))
            elif node.op == "call_module":
                self.guard(node, env, indent)
            elif node.op == "call_function":
                self.call(node, env, indent)
            else:
                raise _Unsupported(f"a graph node of kind {node.op!r}")
        raise _Unsupported("a graph without an output")

    def guard(self, node: fx.Node, env: dict[fx.Node, str], indent: int) -> None:
        if node.target != "_guards_fn":
            raise _Unsupported("the graph calls a submodule")
        if not self.keep_guards:
            return
        forward = self.gm.get_submodule("_guards_fn").forward
        forward = guards_fn_body(forward) or forward  # without the per-call config patch
        reads: list[str] = []
        args = self.expr(tuple(node.args), env, reads)
        self.lines.append((indent, f"{self.const(forward)}(*{args})", tuple(reads)))

    def call(self, node: fx.Node, env: dict[fx.Node, str], indent: int) -> None:
        target = node.target
        if target is _ASSERT_METADATA and not node.users:
            return
        if target is _GRAD or target is _AUTOCAST:
            env[node] = self.region(node, env, indent)
            return
        if CAPS.op_overload_calls_op and isinstance(target, torch._ops.OpOverload) \
                and type(target).__call__ is _OP_CALL and callable(getattr(target, "_op", None)):
            fn = self.const(target._op)
        elif callable(target):
            fn = self.const(target)
        else:
            raise _Unsupported(f"a call of {target!r}")
        if any(not k.isidentifier() or keyword.iskeyword(k) for k in node.kwargs):
            raise _Unsupported("a keyword argument that is not a name")
        reads: list[str] = []
        parts = [self.expr(a, env, reads) for a in node.args]
        parts += [f"{k}={self.expr(v, env, reads)}" for k, v in node.kwargs.items()]
        text = f"{fn}({', '.join(parts)})"
        if node.users:
            env[node] = self.fresh()
            text = f"{env[node]} = {text}"
        self.lines.append((indent, text, tuple(reads)))

    def region(self, node: fx.Node, env: dict[fx.Node, str], indent: int) -> str:
        """A grad-mode or autocast region, inlined in ``try`` / ``finally``; returns
        the name of the tuple of its outputs."""
        lead = 1 if node.target is _GRAD else 4
        body_node = node.args[lead]
        if node.kwargs or not isinstance(body_node, fx.Node) or body_node.op != "get_attr":
            raise _Unsupported("a region of an unexpected form")
        body = _attr(self.gm, str(body_node.target))
        if not isinstance(body, fx.GraphModule):
            raise _Unsupported("a region whose body is not a graph")
        inputs = list(body.graph.find_nodes(op="placeholder"))
        args = node.args[lead + 1:]
        if len(inputs) != len(args):
            raise _Unsupported("a region called with other inputs than its body takes")
        result = self.fresh()
        if not node.users and all(n.op in ("placeholder", "output") for n in body.graph.nodes):
            return result  # an empty region (export leaves one where a context starts)
        saved = self.fresh("saved")
        reads: list[str] = []
        if node.target is _GRAD:
            enabled = self.expr(node.args[0], env, reads)
            self.lines.append((indent, f"{saved} = _is_grad()", ()))
            self.lines.append((indent, f"_set_grad({enabled})", tuple(reads)))
            leave = f"_set_grad({saved})"
        else:
            self.lines.append((indent, f"{saved} = _ac_enter({self.autocast(node.args[:4])})",
                               ()))
            leave = f"_ac_exit({self.const(node.args[0])}, {saved})"
        self.lines.append((indent, "try:", ()))
        inner: dict[fx.Node, str] = {}
        for ph, a in zip(inputs, args):
            inner[ph] = self.expr(a, env, reads)
        outer, self.gm = self.gm, body
        try:
            out_reads: list[str] = []
            out = self.body(body.graph, inner, indent + 1, out_reads)
        finally:
            self.gm = outer
        self.lines.append((indent + 1, f"{result} = {out}", tuple(out_reads)))
        self.lines.append((indent, "finally:", ()))
        self.lines.append((indent + 1, leave, ()))
        return result

    def autocast(self, args: Sequence[Any]) -> str:
        """The arguments of ``_ac_enter``: the region's as ``torch.autocast`` resolves them."""
        if any(isinstance(a, fx.Node) for a in args):
            raise _Unsupported("an autocast region with traced arguments")
        if not CAPS.autocast_inlinable:
            raise _Unsupported("an autocast region, which this torch's autocast enters "
                               "otherwise than ctxreplay's inlined copy")
        return ", ".join(self.const(a) for a in autocast_resolved(*args))

    def expr(self, value: Any, env: dict[fx.Node, str], reads: list[str]) -> str:
        """``value`` (an argument of a node) as an expression; the values it reads
        are added to ``reads``."""
        if isinstance(value, fx.Node):
            if value not in env:
                raise _Unsupported(f"a value used before it is made ({value.name})")
            name = env[value]
            if name not in self.consts:  # a constant of the namespace is never deleted
                reads.append(name)
            return name
        if isinstance(value, (list, tuple)):
            items = [self.expr(v, env, reads) for v in value]
            if isinstance(value, list):
                return "[" + ", ".join(items) + "]"
            return "(" + "".join(i + ", " for i in items) + ")"
        if isinstance(value, dict):
            if not all(type(k) is str for k in value):
                raise _Unsupported("a dict argument with keys that are not strings")
            return "{" + ", ".join(f"{k!r}: {self.expr(v, env, reads)}"
                                   for k, v in value.items()) + "}"
        if value is None or type(value) in (bool, int, str) or (
                type(value) is float and math.isfinite(value)):
            return repr(value)
        return self.const(value)

    def const(self, value: Any) -> str:
        """The name ``value`` is bound to in the function's namespace."""
        name = self.bound.get(id(value))
        if name is None:
            name = self.bound[id(value)] = f"c{len(self.bound)}"
            self.namespace[name] = value
            self.consts.add(name)
        return name

    def render(self) -> str:
        """The lines, each value deleted after the line that reads it last (the
        region results and saved states of unused regions are never made)."""
        last: dict[str, int] = {}
        for i, (_, _, reads) in enumerate(self.lines):
            for name in reads:
                last[name] = i
        out = []
        for i, (indent, text, _) in enumerate(self.lines):
            out.append("    " * indent + text)
            dead = sorted(n for n, j in last.items() if j == i)
            if dead and not text.startswith("return "):
                out.append("    " * indent + "del " + ", ".join(dead))
        return "\n".join(out) + "\n"


def _attr(gm: nn.Module, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj

