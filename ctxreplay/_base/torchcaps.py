"""What the installed torch can do: the one place that knows torch versions.

Every behaviour of torch that ctxreplay depends on and that changed between
the releases it supports is a field of :data:`CAPS`, computed once at import.
A field is found by *feature detection* where torch lets it be seen cheaply
(``hasattr``, a getter's return type, a tiny probe of a C++ object that
sets and restores one thread-local flag); it comes from the version only
where seeing it would need a trace (``torch.export`` or Dynamo: hundreds of
milliseconds and a large import, too much for ``import ctxreplay``).
``tests/_base/test_torchcaps.py`` checks every field, version-derived ones
included, against the real behaviour of the installed torch, so this module
cannot claim what torch does not do.

Engine code asks ``CAPS.<field>``; it never compares ``torch.__version__``.

This module imports only torch and the standard library (no other ctxreplay
module), so any layer may import it.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
import types
import warnings
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["AUTOCAST_DEVICE_TYPES", "CAPS", "SDP_GETTERS", "TENSOR_GUARDED_GETTERS",
           "GlobalStateGuard", "TensorGuards",
           "TorchCaps", "autocast_enter", "autocast_exit", "autocast_resolved",
           "dynamo_compiling", "dynamo_exporting", "guards_fn_body", "is_autocast_available",
           "aoti_package_loader", "parse_version", "tensor_guard"]

#: the device types whose autocast state ctxreplay may observe, where
#: ``torch.amp.is_autocast_available`` says this torch has it
AUTOCAST_DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps", "hpu", "xla", "ipu", "mtia", "maia",
                         "privateuseone")

#: the scaled-dot-product-attention backend getters ctxreplay may read, in
#: ``torch._C`` (``torch.backends.cuda.sdp_kernel`` / ``sdpa_kernel`` state)
SDP_GETTERS = (
    "_get_flash_sdp_enabled",
    "_get_mem_efficient_sdp_enabled",
    "_get_math_sdp_enabled",
    "_get_cudnn_sdp_enabled",
    "_get_overrideable_sdp_enabled",
    "_get_sdp_priority_order",
)


def dynamo_exporting() -> bool:
    """True while Dynamo traces for an export (``torch._dynamo.export``,
    strict ``torch.export``); false under ``torch.compile`` and outside Dynamo.

    ``torch.compiler.is_exporting()`` cannot tell: Dynamo folds it to True
    under ``torch.compile`` too on 2.7, 2.9.1 and 2.11.0 (measured; false on
    2.13-2.14).  This asks the translator that is tracing, once per trace:
    Dynamo calls a function marked as below at trace time and keeps its
    result as a constant, so no guard or graph node comes of it."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
    except Exception:  # not tracing (2.14 raises there; older return None)
        return False
    return bool(getattr(tx, "export", False))


# What torch._dynamo.assume_constant_result does (the same two lines on
# 2.7-2.14; tests/_base/test_torchcaps.py checks), without importing torch._dynamo
# at import time.
dynamo_exporting._dynamo_marked_constant = True  # type: ignore[attr-defined]

#: ``torch.amp.is_autocast_available(device_type)``, from where it is defined:
#: ``torch.amp`` re-exports it explicitly only from 2.13 (mypy --strict refuses
#: the re-export against older releases' stubs)
is_autocast_available: Callable[[str], bool] = torch.amp.autocast_mode.is_autocast_available


def parse_version(text: str) -> tuple[int, int, int]:
    """``"2.7.0+cu126"`` -> ``(2, 7, 0)``; a pre-release (``2.10.0.dev2025...``,
    ``2.10.0a0``) counts as its release.  Unparseable: ``(0, 0, 0)``."""
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", text)
    if m is None:
        return (0, 0, 0)
    return (int(m.group(1)), int(m.group(2)), int(m.group(3) or 0))


@dataclasses.dataclass(frozen=True)
class TorchCaps:
    """The capabilities of one torch build (see each field's comment)."""

    #: ``torch.__version__`` as (major, minor, patch); for reports and for the
    #: version-derived fields below, never compared anywhere else
    version: tuple[int, int, int]

    #: the :data:`AUTOCAST_DEVICE_TYPES` ``torch.amp.is_autocast_available``
    #: names, in that order (a device type whose query raises is left out).
    #: Even a CPU build names most of them (measured on torch 2.13: cpu,
    #: cuda, xpu, mps, hpu, xla, ipu, mtia, maia, privateuseone).
    autocast_devices: tuple[str, ...]

    # -- GlobalStateGuard (torch._C._dynamo.guards) ----------------------------
    #: ``torch._C._dynamo.guards.GlobalStateGuard`` imports (all supported
    #: releases have it; a stripped build may not)
    global_state_guard: bool
    #: ``GlobalStateGuard().check()`` turns false when autocast's enabled flag
    #: of any device in ``autocast_devices`` (``torch.set_autocast_enabled(d,
    #: ...)``) or its cache flag (``torch.set_autocast_cache_enabled``)
    #: changes.  Detected by flipping each flag and restoring it.  The guard's
    #: C++ state gained the autocast fields in torch 2.7; before that a
    #: snapshot cache built on the guard must watch both flags
    #: itself.
    guard_sees_autocast_flags: bool
    #: ``GlobalStateGuard().check()`` turns false when the autocast dtype of a
    #: device whose autocast is *enabled* changes (``torch.set_autocast_dtype``;
    #: reason ``autocast`` on 2.7-2.9, ``autocast(cpu)_dtype`` on 2.13).  The
    #: dtype of a disabled device is not seen -- it has no effect on what runs.
    #: Detected for every device in ``autocast_devices`` by enabling its
    #: autocast, flipping its dtype and restoring both.  True on every release
    #: measured (2.7-2.14, each device type): a snapshot cache on the guard
    #: need not watch those dtypes itself.
    guard_sees_autocast_dtype: bool
    #: ``torch._C._dynamo.guards.TensorGuards(*tensors, dynamic_dims_sizes=
    #: [[sizes]], dynamic_dims_strides=[[strides]])`` constructs and its
    #: ``.check(*tensors)`` is true for the same tensors and false when the
    #: dtype, a size, a stride, the device or ``requires_grad`` differs.
    #: Detected with a 2x3 tensor against one changed tensor per property.
    #: Note: the check also compares the tensor's dispatch keys as modified by
    #: the thread-local include/exclude sets at construction vs at check time
    #: (``LocalState``), so a guard built outside autocast / ``no_grad`` /
    #: ``inference_mode`` fails inside it (see ``tensor_guards_see_local_state``).
    tensor_guards: bool
    #: a TensorGuards built with CPU autocast off fails ``check`` on the same
    #: tensor with CPU autocast on (the TLS dispatch-key sets are part of the
    #: check).  Detected with a probe; true on every release measured.
    tensor_guards_see_local_state: bool
    #: a TensorGuards built with no ``TorchDispatchMode`` active fails
    #: ``check`` on the same tensor while one is (an active mode puts the
    #: Python dispatch keys in the thread-local include set), and one built
    #: under a mode fails outside it.  Detected with a probe; true on 2.7
    #: and 2.13 (measured).
    tensor_guards_see_dispatch_modes: bool
    #: a TensorGuards built outside ``torch.jit.trace`` fails ``check`` on
    #: the same tensor inside a trace (the tracer puts its dispatch key in the
    #: thread-local include set while it runs).  Detected with a trace of a
    #: one-line function (~0.3 ms); true on 2.7.0, 2.9.1, 2.11.0, 2.13.0 and
    #: 2.14.1 (measured).
    tensor_guards_see_jit_tracing: bool

    # -- torch.export --------------------------------------------------------
    #: non-strict ``torch.export.export`` records an autocast entered *inside*
    #: ``forward`` (``higher_order.wrap_with_autocast``): the program computes
    #: in the autocast dtype with no ambient state.  Before
    #: torch 2.6 (pytorch PR 137495, "Fix autocast for non-strict export",
    #: which made ``autocast.__enter__``/``__exit__`` dispatch to
    #: ``PreDispatchTorchFunctionMode``) it is silently dropped.  From the
    #: version: seeing it needs an export.
    export_records_inner_autocast: bool
    #: ``torch.autocast.__exit__`` (``torch/amp/autocast_mode.py``) returns
    #: ``mode.__torch_function__(torch.amp._exit_autocast, (), ())`` -- a
    #: truthy value -- while a ``PreDispatchTorchFunctionMode`` is active
    #: (non-strict export), so an exception raised inside the ``with`` block
    #: (a probe's replay error, say) is swallowed.  Same code as the field
    #: above (2.6); fixed by pytorch PR 159565, in 2.9.0 (``__exit__`` calls
    #: the mode and returns False).  Measured true on 2.7.0, false on 2.9.1.
    #: A wrapper that must see the error re-raises it itself when this is true.
    autocast_exit_swallows_errors: bool
    #: non-strict ``torch.export`` traces a forward that adds to a list or
    #: dict attribute of its module.  Before 2.11 its check for attributes
    #: assigned during the trace (``_detect_attribute_assignment``) compares
    #: the containers' structure before and after and raises ``ValueError:
    #: Node arity mismatch``.  From the version (2.9.1 raises, 2.11.0 traces;
    #: measured).
    export_traces_growing_containers: bool
    #: non-strict ``torch.export`` traces a module whose parameters are
    #: DTensors (tensor parallel's ``ColwiseParallel`` / ``RowwiseParallel``).
    #: On 2.7.0 ``F.linear`` on a DTensor weight fails inside export's
    #: ``__torch_function__`` (``_export/non_strict_utils.py``: "Unable to cast
    #: NotImplemented to Tensor"); 2.13.0 and 2.14.1 trace it (measured).  From
    #: the version: 2.9 is taken to trace (not measured -- a wrong guess there
    #: fails the export with torch's own error, never serves a wrong graph).
    export_traces_dtensor: bool
    #: the module ``ExportedProgram.module()`` makes runs the size guards of
    #: the trace on every call (a ``_guards_fn`` submodule; ``module()`` takes
    #: ``check_guards``): a program traced with dynamic sizes then refuses a
    #: size its graph was not traced for, e.g. one a ``if x.shape[1] == 7``
    #: sends down another path, with ``AssertionError: Guard failed``.
    #: Before (2.7.0) only each dimension's range is checked, and such a size
    #: runs the traced path silently.  From 2.9 (2.9.1 measured); detected by
    #: ``module()``'s signature.
    export_guards_sizes: bool
    #: that guard submodule's ``forward`` is torch's generated guard function
    #: (named ``_``, ``exec``'d by ``torch/export/_unlift.py``
    #: ``_convert_guards_code_to_fn``) inside a Dynamo config patch
    #: (``torch._dynamo.dont_skip_tracing``: a closure that enters the patch
    #: and calls it), which :func:`guards_fn_body` finds in the closure's
    #: cells.  The patch only matters to a Dynamo trace of the module; calling
    #: the function itself checks the same guards without entering a context
    #: manager per call.  From ``export_guards_sizes`` (seeing the closure
    #: needs ``torch._dynamo``); measured on 2.13.  Where false, the guard runs
    #: through ``forward`` (torch's own path).
    export_guards_fn_in_closure: bool
    #: ``ExportedProgram.module()``'s graph carries its in- and out-spec in
    #: its code generator (``graph._codegen.pytree_info``, a
    #: ``torch.fx.graph._PyTreeCodeGen``), which flattens the call's inputs
    #: into the graph's placeholders and rebuilds its outputs -- and does
    #: nothing else.  Detected by building such a code generator on a graph.
    #: Where false, a program is not flattened into one function.
    fx_pytree_codegen: bool

    # -- ops -------------------------------------------------------------------
    #: ``torch._ops.OpOverload.__call__`` only calls ``self._op`` (the op's C++
    #: callable) with the same arguments and returns its result, so calling
    #: ``_op`` directly is the same call less ~2 us of Python.  Detected from
    #: the method's code object (it reads one name, ``_op``, and closes over
    #: nothing) and one call of ``aten.neg``.  Where false, ops are called
    #: through their ``OpOverload``.
    op_overload_calls_op: bool

    # -- Dynamo (torch._dynamo.export, backend="dynamo") ----------------------
    #: Dynamo inlines a ``@contextlib.contextmanager`` generator entered with
    #: ``with`` in the traced code (``ContextlibContextManagerVariable``): from
    #: torch 2.7 (measured: works on 2.7.0, also for a generator function
    #: made in a closure and for explicit ``__enter__``/``__exit__`` calls;
    #: refused before 2.7).  From the version.
    dynamo_traces_contextmanager: bool
    #: Dynamo exports a module whose ``forward`` is an *instance attribute*
    #: (``module.forward = wrapper``, how ctxreplay swaps in its capture
    #: wrapper) and traces through it: from torch 2.10.  Measured:
    #: ``torch._dynamo.export`` raises ``UserError`` "Cannot export model which
    #: references tensors that are neither buffers/parameters/constants nor are
    #: direct inputs" on 2.7.0 and 2.9.1, works on 2.11.0.  From the version.
    dynamo_traces_instance_forward: bool
    #: Dynamo traces ``contextlib.ExitStack`` with generator contexts entered
    #: by ``enter_context`` (what ctxreplay's replay composes): from torch 2.11
    #: -- up to 2.9.1 ``torch/_dynamo/variables/user_defined.py`` lists
    #: ``contextlib.ExitStack`` among the "unsupported contextlib.* API"s, and
    #: 2.11.0 no longer does (2.10 not measured).  Even on 2.11-2.14 torch's
    #: own context objects (``torch.autocast``, ``torch.no_grad``) passed to
    #: ``enter_context`` directly are refused: wrap them in a generator.  From
    #: the version.
    dynamo_traces_exitstack: bool

    # -- torch.compiler --------------------------------------------------------
    #: ``torch.compiler.is_dynamo_compiling`` exists (true only while Dynamo
    #: traces; ``torch.compiler.is_compiling`` is also true under export's
    #: non-strict tracing).  hasattr.
    is_dynamo_compiling: bool
    #: ``torch.compiler.is_exporting`` exists.  hasattr.
    is_exporting: bool

    # -- precision and attention backends ---------------------------------------
    #: the per-backend precision API: ``torch._C._get_fp32_precision_getter`` /
    #: ``_set_fp32_precision_setter`` (``torch.backends.cuda.matmul.fp32_precision``,
    #: cudnn conv/rnn, mkldnn; torch >= 2.9).  Setting it makes
    #: ``torch.get_float32_matmul_precision()`` raise.  hasattr.
    fp32_precision_api: bool
    #: ``torch._C._get_cublas_allow_{fp16,bf16}_reduced_precision_reduction()``
    #: returns ``(allow_reduced_precision, allow_splitk)`` and the setters take
    #: both, instead of one bool.  Measured: one bool on 2.7.0 and 2.9.1, the
    #: pair on 2.11.0-2.14.1 (2.10 not measured).  Detected from the getter's
    #: return type.
    cublas_reduced_precision_pair: bool
    #: which of :data:`SDP_GETTERS` ``torch._C`` has (all six on 2.7-2.14)
    sdp_getters: frozenset[str]
    #: the order ``torch._C._get_sdp_priority_order()`` gives in a fresh
    #: process, as backend names.  ATen's ``Context.h`` holds a five-slot array:
    #: its initializer lists four backends on older releases, so the fifth
    #: slot is value 0 -- ``math`` again (measured on 2.7.0) -- and all five,
    #: ``overrideable`` last, on newer ones (measured on 2.9.1-2.14.1).  2.8 is
    #: not measured and taken as 2.7: a wrong guess there makes the default
    #: look non-neutral (listed as ambient-only), never the reverse.  From
    #: the version: the current order may already have been changed.
    sdp_default_priority: tuple[str, ...]

    # -- AOTInductor ---------------------------------------------------------
    #: ``torch._C._aoti.AOTIModelPackageLoader`` takes ``(path, model_name,
    #: run_single_threaded, num_runners, device_index)``; before (2.7.0) only
    #: the first three, and the package loads onto the device it was compiled
    #: for.  Detected from the pybind constructor's signature (its docstring).
    aoti_loader_takes_device: bool

    # -- autocast ------------------------------------------------------------
    #: ``torch._C._is_any_autocast_enabled`` exists (the probe's fast path)
    is_any_autocast_enabled: bool
    #: outside a trace, ``torch.autocast(...).__enter__`` / ``__exit__`` change
    #: exactly what :func:`autocast_enter` / :func:`autocast_exit` change (the
    #: device's enabled flag and dtype, the cache flag, the nesting count), and
    #: a ``torch.autocast`` resolves its arguments into the attributes
    #: :func:`autocast_resolved` reads (``device``, ``fast_dtype``,
    #: ``_enabled``, ``_cache_enabled``).  Detected by entering and leaving
    #: CPU autocast both ways (enabled bfloat16, disabled float16, cache off)
    #: and comparing every flag after each step.  Where false, a captured
    #: program's autocast regions run through torch's own ``wrap_with_autocast``.
    autocast_inlinable: bool

    def as_dict(self) -> dict[str, Any]:
        """JSON-safe: for reports, ``ctxreplay`` diagnostics and test output."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, frozenset):
                v = sorted(v)
            elif isinstance(v, tuple):
                v = ".".join(map(str, v))
            out[f.name] = v
        return out


# -- detection -----------------------------------------------------------------

def _guards_attr(name: str) -> Any:
    """``torch._C._dynamo.guards.<name>``, or None.  Imported by name: torch
    2.7's type stubs have no ``torch._C._dynamo.guards`` (mypy --strict
    against them reports import-not-found), later ones do."""
    try:
        guards = importlib.import_module("torch._C._dynamo.guards")
    except ImportError:  # pragma: no cover - stripped torch
        return None
    return getattr(guards, name, None)


def _global_state_guard() -> Any:
    return _guards_attr("GlobalStateGuard")


def _guard_sees(guard_cls: Any, flip: Any, restore: Any) -> bool:
    """Whether a guard taken before ``flip()`` fails after it (restored after)."""
    guard = guard_cls()
    flip()
    try:
        return not bool(guard.check())
    finally:
        restore()


def _autocast_devices() -> tuple[str, ...]:
    out = []
    for d in AUTOCAST_DEVICE_TYPES:
        try:
            if is_autocast_available(d):
                out.append(d)
        except Exception:  # an exotic backend whose query fails is not observed
            continue
    return tuple(out)


def _guard_sees_enabled(guard_cls: Any, device: str) -> bool:
    enabled = torch.is_autocast_enabled(device)
    return _guard_sees(guard_cls,
                       lambda: torch.set_autocast_enabled(device, not enabled),
                       lambda: torch.set_autocast_enabled(device, enabled))


def _guard_sees_autocast_flags(guard_cls: Any, devices: tuple[str, ...]) -> bool:
    if guard_cls is None:
        return False
    cache = torch.is_autocast_cache_enabled()
    sees_cache = _guard_sees(guard_cls,
                             lambda: torch.set_autocast_cache_enabled(not cache),
                             lambda: torch.set_autocast_cache_enabled(cache))
    try:
        return sees_cache and all(_guard_sees_enabled(guard_cls, d) for d in devices)
    except Exception:  # a device type whose raw setter refuses: not proven
        return False


def _guard_sees_dtype(guard_cls: Any, device: str) -> bool:
    enabled = torch.is_autocast_enabled(device)
    dtype = torch.get_autocast_dtype(device)
    other = torch.float16 if dtype != torch.float16 else torch.bfloat16
    torch.set_autocast_enabled(device, True)
    try:
        return _guard_sees(guard_cls,
                           lambda: torch.set_autocast_dtype(device, other),
                           lambda: torch.set_autocast_dtype(device, dtype))
    finally:
        torch.set_autocast_enabled(device, enabled)


def _guard_sees_autocast_dtype(guard_cls: Any, devices: tuple[str, ...]) -> bool:
    if guard_cls is None:
        return False
    try:
        return all(_guard_sees_dtype(guard_cls, d) for d in devices)
    except Exception:  # a device type whose raw setter refuses: not proven
        return False


def _tensor_guards_cls() -> Any:
    return _guards_attr("TensorGuards")


def _make_tensor_guard(cls: Any, *tensors: torch.Tensor) -> Any:
    return cls(*tensors,
               dynamic_dims_sizes=[list(t.size()) for t in tensors],
               dynamic_dims_strides=[list(t.stride()) for t in tensors])


def _tensor_guards() -> bool:
    cls = _tensor_guards_cls()
    if cls is None:
        return False
    try:
        guard = _make_tensor_guard(cls, torch.zeros(2, 3))
        same = bool(guard.check(torch.ones(2, 3)))
        others = (
            torch.zeros(2, 3, dtype=torch.float64),  # dtype
            torch.zeros(2, 4),                       # size
            torch.zeros(3, 2).t(),                   # stride
            torch.zeros(2, 3, device="meta"),        # device
            torch.zeros(2, 3).requires_grad_(True),  # requires_grad
        )
        return same and not any(bool(guard.check(o)) for o in others)
    except Exception:  # a signature this torch does not take
        return False


def _guard_probe(probe: Callable[[Any, torch.Tensor], bool]) -> bool:
    """``probe(guard, x)`` for a 2x3 tensor ``x`` and a TensorGuards of it
    built here; false without TensorGuards or where the probe raises."""
    cls = _tensor_guards_cls()
    if cls is None:
        return False
    try:
        x = torch.zeros(2, 3)
        return probe(_make_tensor_guard(cls, x), x)
    except Exception:  # torch's guard internals may raise anything
        return False


def _sees_autocast(guard: Any, x: torch.Tensor) -> bool:
    before = torch.is_autocast_enabled("cpu")
    torch.set_autocast_enabled("cpu", not before)
    try:
        differs = not bool(guard.check(x))
    finally:
        torch.set_autocast_enabled("cpu", before)
    return differs and bool(guard.check(x))


def _tensor_guards_see_local_state() -> bool:
    return _guard_probe(_sees_autocast)


def _sees_dispatch_modes(outside: Any, x: torch.Tensor) -> bool:
    from torch.utils import _python_dispatch

    def dispatch(self: Any, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))

    # (untyped in torch's stubs: made through ``type``)
    base: Any = _python_dispatch.TorchDispatchMode
    passing: Any = type("_Passing", (base,), {"__torch_dispatch__": dispatch})
    with passing():
        inside = _make_tensor_guard(_tensor_guards_cls(), x)
        seen = not outside.check(x) and bool(inside.check(x))
    return seen and bool(outside.check(x)) and not inside.check(x)


def _tensor_guards_see_dispatch_modes() -> bool:
    return _guard_probe(_sees_dispatch_modes)


def _sees_jit_tracing(guard: Any, x: torch.Tensor) -> bool:
    inside: list[bool] = []

    def traced(t: torch.Tensor) -> torch.Tensor:
        inside.append(bool(guard.check(x)))
        return t + 1

    trace: Any = torch.jit.trace  # (untyped in torch's stubs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trace(traced, (x,), check_trace=False)
    return inside == [False] and bool(guard.check(x))


def _tensor_guards_see_jit_tracing() -> bool:
    return _guard_probe(_sees_jit_tracing)


def _module_takes(parameter: str) -> bool:
    """Whether ``ExportedProgram.module`` takes ``parameter``."""
    try:
        module = torch.export.ExportedProgram.module
        return parameter in inspect.signature(module).parameters
    except (AttributeError, TypeError, ValueError):
        return False


def _returns_pair(name: str) -> bool:
    get = getattr(torch._C, name, None)
    if get is None:
        return False
    try:
        return isinstance(get(), tuple)
    except Exception:  # pragma: no cover - a getter that needs a device
        return False


# -- torch internals a flattened program calls directly -----------------------------

def autocast_resolved(*args: Any) -> tuple[str, torch.dtype, bool, bool]:
    """``torch.autocast(*args)`` as its ``__enter__`` uses it: the device type,
    the dtype, whether it is enabled (false also where torch disabled an
    unsupported dtype, with a warning) and the cache flag."""
    made: Any = torch.autocast(*args)
    return (made.device, made.fast_dtype, made._enabled, made._cache_enabled)


def autocast_enter(device: str, dtype: torch.dtype, enabled: bool,
                   cache_enabled: bool) -> tuple[bool, bool, torch.dtype]:
    """What ``torch.autocast.__enter__`` does outside a trace (where
    ``CAPS.autocast_inlinable``); returns what it found, for :func:`autocast_exit`."""
    found = (torch.is_autocast_cache_enabled(), torch.is_autocast_enabled(device),
             torch.get_autocast_dtype(device))
    torch.set_autocast_enabled(device, enabled)
    torch.set_autocast_dtype(device, dtype)
    torch.autocast_increment_nesting()
    torch.set_autocast_cache_enabled(cache_enabled)
    return found


def autocast_exit(device: str, found: tuple[bool, bool, torch.dtype]) -> None:
    """What ``torch.autocast.__exit__`` does outside a trace (where
    ``CAPS.autocast_inlinable``), given what :func:`autocast_enter` found."""
    if torch.autocast_decrement_nesting() == 0:
        torch.clear_autocast_cache()
    torch.set_autocast_enabled(device, found[1])
    torch.set_autocast_dtype(device, found[2])
    torch.set_autocast_cache_enabled(found[0])


def _autocast_flags(device: str) -> tuple[Any, ...]:
    nesting = torch.autocast_increment_nesting() - 1
    torch.autocast_decrement_nesting()  # back to where it was: nothing cleared
    return (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device),
            torch.is_autocast_cache_enabled(), nesting)


def _autocast_inlines(*args: Any) -> bool:
    """Whether ``torch.autocast(*args)`` and the inlined pair leave the same
    flags after entering and after leaving."""
    device, dtype, enabled, cache = autocast_resolved(*args)
    before = _autocast_flags(device)
    with torch.autocast(*args):
        by_torch = _autocast_flags(device)
    after_torch = _autocast_flags(device)
    found = autocast_enter(device, dtype, enabled, cache)
    try:
        inlined = _autocast_flags(device)
    finally:
        autocast_exit(device, found)
    return by_torch == inlined and before == after_torch == _autocast_flags(device)


def _autocast_inlinable() -> bool:
    try:
        return (_autocast_inlines("cpu", torch.bfloat16)
                and _autocast_inlines("cpu", torch.float16, False)
                and _autocast_inlines("cpu", torch.bfloat16, True, False))
    except Exception:  # an autocast this torch builds otherwise: not proven
        return False


def guards_fn_body(forward: Any) -> Any:
    """The generated guard function inside the ``forward`` of
    ``ExportedProgram.module()``'s guard submodule (see
    ``CAPS.export_guards_fn_in_closure``); ``None`` where this torch is not
    known to build it so, or it is not found."""
    return _find_guards_fn_body(forward) if CAPS.export_guards_fn_in_closure else None


def _find_guards_fn_body(forward: Any) -> Any:
    """``functools.wraps``' ``__wrapped__``, or the function named ``_`` a
    closure of ``forward`` holds; ``None`` where neither is there."""
    raw = getattr(forward, "__wrapped__", None)
    if callable(raw):
        return raw
    for cell in getattr(forward, "__closure__", None) or ():
        try:
            held = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(held, types.FunctionType) and held.__code__.co_name == "_":
            return held
    return None


def _fx_pytree_codegen() -> bool:
    try:
        from torch.fx.graph import _PyTreeCodeGen, _PyTreeInfo
        from torch.utils import _pytree as pytree

        spec = pytree.tree_structure(((0,), {}))
        graph: Any = torch.fx.Graph()
        graph._codegen = _PyTreeCodeGen(_PyTreeInfo(["x"], spec, spec))
        info = graph._codegen.pytree_info
        return info.in_spec is spec and info.out_spec is spec
    except Exception:  # a torch.fx without them
        return False


def _op_overload_calls_op() -> bool:
    try:
        call = torch._ops.OpOverload.__call__
        code = call.__code__
        op: Any = torch.ops.aten.neg.default
        x = torch.tensor([1.0, -2.0])
        return (code.co_names == ("_op",) and not code.co_freevars
                and torch.equal(op._op(x), op(x)))
    except Exception:  # not a plain function, or no such attribute
        return False


def _aoti_loader_takes_device() -> bool:
    try:
        doc = torch._C._aoti.AOTIModelPackageLoader.__init__.__doc__ or ""
    except Exception:  # a build without AOTInductor
        return False
    return "arg4" in doc


def _detect() -> TorchCaps:
    v = parse_version(str(torch.__version__))
    guard_cls = _global_state_guard()
    devices = _autocast_devices()
    records_inner = v >= (2, 6)
    return TorchCaps(
        version=v,
        autocast_devices=devices,
        global_state_guard=guard_cls is not None,
        guard_sees_autocast_flags=_guard_sees_autocast_flags(guard_cls, devices),
        guard_sees_autocast_dtype=_guard_sees_autocast_dtype(guard_cls, devices),
        tensor_guards=_tensor_guards(),
        tensor_guards_see_local_state=_tensor_guards_see_local_state(),
        tensor_guards_see_dispatch_modes=_tensor_guards_see_dispatch_modes(),
        tensor_guards_see_jit_tracing=_tensor_guards_see_jit_tracing(),
        export_records_inner_autocast=records_inner,
        autocast_exit_swallows_errors=records_inner and v < (2, 9),
        export_guards_sizes=_module_takes("check_guards"),
        export_guards_fn_in_closure=_module_takes("check_guards"),
        fx_pytree_codegen=_fx_pytree_codegen(),
        op_overload_calls_op=_op_overload_calls_op(),
        export_traces_growing_containers=v >= (2, 11),
        export_traces_dtensor=v >= (2, 9),
        dynamo_traces_contextmanager=v >= (2, 7),
        dynamo_traces_instance_forward=v >= (2, 10),
        dynamo_traces_exitstack=v >= (2, 11),
        is_dynamo_compiling=hasattr(torch.compiler, "is_dynamo_compiling"),
        is_exporting=hasattr(torch.compiler, "is_exporting"),
        fp32_precision_api=(hasattr(torch._C, "_get_fp32_precision_getter")
                            and hasattr(torch._C, "_set_fp32_precision_setter")),
        cublas_reduced_precision_pair=_returns_pair(
            "_get_cublas_allow_fp16_reduced_precision_reduction"),
        sdp_getters=frozenset(n for n in SDP_GETTERS if hasattr(torch._C, n)),
        sdp_default_priority=("flash", "mem_efficient", "math", "cudnn",
                              "math" if v < (2, 9) else "overrideable"),
        aoti_loader_takes_device=_aoti_loader_takes_device(),
        is_any_autocast_enabled=hasattr(torch._C, "_is_any_autocast_enabled"),
        autocast_inlinable=_autocast_inlinable(),
    )


#: the installed torch's capabilities, computed once at import
CAPS: TorchCaps = _detect()

#: true only while Dynamo traces (``torch.compiler.is_dynamo_compiling``); where
#: this torch lacks it, ``is_compiling`` (also true under non-strict export)
dynamo_compiling: Callable[[], bool] = getattr(
    torch.compiler, "is_dynamo_compiling", torch.compiler.is_compiling)

#: ``torch._C._dynamo.guards.GlobalStateGuard`` / ``TensorGuards`` (None where
#: missing), typed ``Any``: importing them from here keeps ``mypy --strict``
#: clean against every torch's stubs (2.7's lack the module)
GlobalStateGuard: Any = _global_state_guard()
TensorGuards: Any = _tensor_guards_cls()


def aoti_package_loader(path: str, device: str) -> Any:
    """An ``AOTIModelPackageLoader`` of the AOTInductor package at ``path``
    (model ``"model"``, one runner), onto ``device``'s index where this torch
    takes one; raises what torch raises for a package it cannot open."""
    cls: Any = torch._C._aoti.AOTIModelPackageLoader
    if not CAPS.aoti_loader_takes_device:
        return cls(path, "model", False)
    d = torch.device(device)
    return cls(path, "model", False, 1, -1 if d.type == "cpu" else (d.index or 0))


def tensor_guard(args: tuple[Any, ...]) -> Any:
    """A C-level check that positional tensor arguments still have the
    metadata of ``args`` (``TensorGuards``: dispatch keys, dtype, device,
    shapes, strides, ``requires_grad``), or ``None`` where it does not apply
    (an argument that is not a plain tensor, a torch without it)."""
    if TensorGuards is None or any(type(a) is not torch.Tensor for a in args):
        return None
    try:
        return TensorGuards(*args, dynamic_dims_sizes=[list(a.shape) for a in args],
                            dynamic_dims_strides=[list(a.stride()) for a in args])
    except Exception:  # this torch's TensorGuards takes other arguments
        return None

#: getters of the state a passing ``TensorGuards`` check has seen already: the
#: thread-local dispatch-key sets of the call are part of it
#: (``tensor_guards_see_local_state``), and inference mode is one of them, as
#: is whether a ``TorchDispatchMode`` is active (``tensor_guards_see_dispatch_modes``:
#: the length of the dispatch-mode stack, 0 or not, is what a probe watches).  A
#: caller whose inputs just passed such a check skips these.
TENSOR_GUARDED_GETTERS: tuple[Callable[[], Any], ...] = (
    ((torch.is_inference_mode_enabled,) if CAPS.tensor_guards
     and CAPS.tensor_guards_see_local_state else ())
    + ((torch._C._len_torch_dispatch_stack,) if CAPS.tensor_guards
       and CAPS.tensor_guards_see_dispatch_modes else ()))
