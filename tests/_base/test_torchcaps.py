"""``ctxreplay._base.torchcaps`` cannot lie: every capability is checked against
what the installed torch really does.

Each test exercises the behaviour the field describes -- through a path other
than the one ``_torchcaps`` detects it by where there is one (``torch.autocast``
rather than the raw setters, a real export, a real Dynamo export) -- and
asserts that the observed behaviour equals the field, whichever way it goes.
So on every torch release the suite runs on, a field that is wrong fails here.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torchstate as ts
from torch import nn

from ctxreplay._base import torchcaps as _torchcaps
from ctxreplay._base.torchcaps import CAPS, SDP_GETTERS, parse_version

pytestmark = [pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

BF16 = torch.bfloat16


def test_the_module_imports_only_torch_and_the_standard_library() -> None:
    import ast
    import sys
    from pathlib import Path

    tree = ast.parse(Path(_torchcaps.__file__).read_text(encoding="utf-8"))
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "a relative import: _torchcaps imports no ctxreplay module"
            roots.add((node.module or "").split(".")[0])
    assert roots - {"torch"} <= set(sys.stdlib_module_names) | {"__future__"}, roots


def test_version_is_the_installed_release() -> None:
    assert CAPS.version == parse_version(torch.__version__)
    assert CAPS.version >= (2, 0, 0)
    assert parse_version("2.7.0+cu126") == (2, 7, 0)
    assert parse_version("2.10.0.dev20250101+cpu") == (2, 10, 0)
    assert parse_version("2.11.0a0+git1234") == (2, 11, 0)
    assert parse_version("2.9") == (2, 9, 0)
    assert parse_version("nonsense") == (0, 0, 0)


def test_caps_are_frozen_and_json_safe() -> None:
    import dataclasses
    import json

    with pytest.raises(dataclasses.FrozenInstanceError):
        CAPS.tensor_guards = False  # type: ignore[misc]
    doc = CAPS.as_dict()
    assert json.loads(json.dumps(doc)) == doc
    assert set(doc) == {f.name for f in dataclasses.fields(CAPS)}


def test_detecting_again_gives_the_same_record_and_leaves_no_state() -> None:
    before = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"),
              torch.is_autocast_cache_enabled(), torch.is_grad_enabled())
    assert _torchcaps._detect() == CAPS
    after = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"),
             torch.is_autocast_cache_enabled(), torch.is_grad_enabled())
    assert after == before


# -- GlobalStateGuard --------------------------------------------------------------

def _guard() -> Any:
    from torch._C._dynamo.guards import GlobalStateGuard

    return GlobalStateGuard()


def test_global_state_guard() -> None:
    try:
        from torch._C._dynamo.guards import GlobalStateGuard
    except ImportError:
        assert not CAPS.global_state_guard
        assert _torchcaps.GlobalStateGuard is None
    else:
        assert CAPS.global_state_guard
        assert _torchcaps.GlobalStateGuard is GlobalStateGuard


def test_tensor_guards_class() -> None:
    try:
        from torch._C._dynamo.guards import TensorGuards
    except ImportError:
        assert _torchcaps.TensorGuards is None
    else:
        assert _torchcaps.TensorGuards is TensorGuards


def test_autocast_devices_are_the_ones_torch_names() -> None:
    from torch.amp.autocast_mode import is_autocast_available

    want = []
    for d in _torchcaps.AUTOCAST_DEVICE_TYPES:
        try:
            if is_autocast_available(d):
                want.append(d)
        except Exception:
            pass
    assert CAPS.autocast_devices == tuple(want)
    assert "cpu" in CAPS.autocast_devices


def _guard_sees_enabled(device: str) -> bool:
    guard = _guard()
    with ts.raw_autocast(device, enabled=not torch.is_autocast_enabled(device)):
        sees = not guard.check()
    assert guard.check()
    return sees


def _guard_sees_dtype(device: str) -> bool:
    with ts.raw_autocast(device, BF16):
        guard = _guard()
        with ts.raw_autocast(device, torch.float16):  # enabled both times
            sees = not guard.check()
        assert guard.check()
    return sees


@pytest.mark.skipif(not CAPS.global_state_guard, reason="no GlobalStateGuard in this torch")
def test_guard_sees_autocast_flags() -> None:
    guard = _guard()
    with torch.autocast("cpu", dtype=BF16):  # the public path, for one device
        sees_cpu = not guard.check()
    assert guard.check()
    before = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(not before)
    try:
        sees_cache = not guard.check()
    finally:
        torch.set_autocast_cache_enabled(before)
    sees_each = {d: _guard_sees_enabled(d) for d in CAPS.autocast_devices}
    assert sees_each["cpu"] == sees_cpu
    assert (sees_cache and all(sees_each.values())) == CAPS.guard_sees_autocast_flags, sees_each


@pytest.mark.skipif(not CAPS.global_state_guard, reason="no GlobalStateGuard in this torch")
def test_guard_sees_autocast_dtype() -> None:
    with torch.autocast("cpu", dtype=BF16):  # the public path, for one device
        guard = _guard()
        with torch.autocast("cpu", dtype=torch.float16):
            sees_cpu = not guard.check()
        assert guard.check()
    sees_each = {d: _guard_sees_dtype(d) for d in CAPS.autocast_devices}
    assert sees_each["cpu"] == sees_cpu
    assert all(sees_each.values()) == CAPS.guard_sees_autocast_dtype, sees_each
    # the dtype of a device whose autocast is off is never part of it
    guard = _guard()
    before = torch.get_autocast_dtype("cpu")
    torch.set_autocast_dtype("cpu", torch.float16 if before != torch.float16 else BF16)
    try:
        assert guard.check()
    finally:
        torch.set_autocast_dtype("cpu", before)


def test_sdp_default_priority_is_a_fresh_process_order() -> None:
    """The order a process starts with -- read in a fresh one, since this
    process's may have been changed by another test."""
    import subprocess
    import sys

    code = ("import torch\n"
            "names = {int(torch._C._SDPBackend.MATH): 'math',"
            " int(torch._C._SDPBackend.FLASH_ATTENTION): 'flash',"
            " int(torch._C._SDPBackend.EFFICIENT_ATTENTION): 'mem_efficient',"
            " int(torch._C._SDPBackend.CUDNN_ATTENTION): 'cudnn',"
            " int(torch._C._SDPBackend.OVERRIDEABLE): 'overrideable'}\n"
            "print(','.join(names[int(i)] for i in torch._C._get_sdp_priority_order()))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True)
    assert tuple(proc.stdout.strip().split(",")) == CAPS.sdp_default_priority


# -- TensorGuards --------------------------------------------------------------------

def _tensor_guard(*tensors: torch.Tensor) -> Any:
    from torch._C._dynamo.guards import TensorGuards

    return TensorGuards(*tensors, dynamic_dims_sizes=[list(t.size()) for t in tensors],
                        dynamic_dims_strides=[list(t.stride()) for t in tensors])


def _tensor_guards_work() -> bool:
    """Two tensors at once, each property changed on each position in turn."""
    try:
        a, b = torch.rand(4, 5), torch.rand(3, dtype=torch.float64)
        guard = _tensor_guard(a, b)
    except Exception:
        return False
    if not guard.check(torch.zeros(4, 5), torch.zeros(3, dtype=torch.float64)):
        return False
    changed = [
        (a.half(), b),                                          # dtype
        (a, b.float()),
        (torch.rand(4, 6), b),                                  # size
        (a, torch.rand(4, dtype=torch.float64)),
        (torch.rand(5, 4).t(), b),                              # stride
        (a, torch.rand(6, dtype=torch.float64)[::2]),
        (torch.rand(4, 5, device="meta"), b),                   # device
        (a, torch.rand(3, dtype=torch.float64, device="meta")),
        (a.clone().requires_grad_(True), b),                    # requires_grad
        (a, b.clone().requires_grad_(True)),
    ]
    return not any(guard.check(x, y) for x, y in changed)


def test_tensor_guards() -> None:
    assert _tensor_guards_work() == CAPS.tensor_guards


@pytest.mark.skipif(not CAPS.tensor_guards, reason="TensorGuards unusable in this torch")
def test_tensor_guards_see_local_state() -> None:
    x = torch.rand(2, 3)
    guard = _tensor_guard(x)
    with torch.autocast("cpu", dtype=BF16):
        in_autocast = guard.check(x)
    with torch.inference_mode():
        in_inference = guard.check(x)
    assert guard.check(x)
    assert (not in_autocast) == CAPS.tensor_guards_see_local_state
    # inference mode excludes the autograd keys too: the same blind spot or none
    assert (not in_inference) == CAPS.tensor_guards_see_local_state


@pytest.mark.skipif(not CAPS.tensor_guards, reason="TensorGuards unusable in this torch")
def test_tensor_guards_see_dispatch_modes() -> None:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passing(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            return func(*args, **(kwargs or {}))

    x = torch.rand(2, 3)
    guard = _tensor_guard(x)
    with Passing():
        seen = not guard.check(x)
    assert guard.check(x) and seen == CAPS.tensor_guards_see_dispatch_modes


@pytest.mark.skipif(not CAPS.tensor_guards, reason="TensorGuards unusable in this torch")
def test_tensor_guards_see_jit_tracing() -> None:
    """Checked with a module traced the way a user traces one, each check
    inside the trace made on a tensor that is not being traced (without the
    trace check, which runs the module again untraced)."""
    x = torch.rand(2, 3)
    guard = _tensor_guard(x)
    inside: list[bool] = []

    class Net(nn.Module):
        def forward(self, t: torch.Tensor) -> torch.Tensor:
            inside.append(bool(guard.check(x)))
            return t * 2

    torch.jit.trace(Net(), (torch.rand(2, 3),), check_trace=False)
    assert len(inside) == 1 and guard.check(x)
    assert (not inside[0]) == CAPS.tensor_guards_see_jit_tracing


def test_tensor_guard_checks_the_metadata_of_plain_tensors() -> None:
    x, y = torch.rand(2, 3), torch.zeros(4, dtype=torch.int64)
    guard = _torchcaps.tensor_guard((x, y))
    assert (guard is not None) == CAPS.tensor_guards  # None only on a torch without them
    if guard is None:
        return
    assert guard.check(torch.rand(2, 3), torch.ones(4, dtype=torch.int64))
    assert not guard.check(torch.rand(3, 3), y)                   # another shape
    assert not guard.check(x.double(), y)                         # another dtype
    assert not guard.check(x.t().contiguous().t(), y)             # another stride
    assert not guard.check(x.requires_grad_(True), y)             # requires_grad
    assert _torchcaps.tensor_guard((x, 3)) is None                # not all tensors
    assert _torchcaps.tensor_guard((nn.Parameter(torch.rand(2)),)) is None  # a subclass


def test_tensor_guarded_getters_are_states_a_tensor_guard_sees() -> None:
    """The getters a session skips after a passing TensorGuards check: each
    state flipped must fail a guard built before the flip, and one built
    after it once flipped back."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passing(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            return func(*args, **(kwargs or {}))

    flips: dict[Any, Any] = {torch.is_inference_mode_enabled: torch.inference_mode,
                             torch._C._len_torch_dispatch_stack: Passing}
    assert (torch.is_inference_mode_enabled in _torchcaps.TENSOR_GUARDED_GETTERS) == (
        CAPS.tensor_guards and CAPS.tensor_guards_see_local_state)
    assert (torch._C._len_torch_dispatch_stack in _torchcaps.TENSOR_GUARDED_GETTERS) == (
        CAPS.tensor_guards and CAPS.tensor_guards_see_dispatch_modes)
    for getter in _torchcaps.TENSOR_GUARDED_GETTERS:
        flip = flips[getter]  # a getter added there needs its flip here
        x = torch.rand(2, 3)
        before = _tensor_guard(x)
        with flip():
            assert getter()  # on: True, or a stack of one mode
            assert not before.check(x)
            inside = _tensor_guard(x)
            assert inside.check(x)
        assert not inside.check(x)
        assert before.check(x)


# -- torch.export --------------------------------------------------------------------

class InnerAutocast(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=BF16):
            return self.lin(x)


def test_export_records_inner_autocast() -> None:
    ep = torch.export.export(InnerAutocast(), (torch.rand(2, 4),), strict=False)
    assert not torch.is_autocast_enabled("cpu")
    out = ep.module()(torch.rand(2, 4))
    assert (out.dtype == BF16) == CAPS.export_records_inner_autocast


class _Marker(Exception):
    pass


class RaisesInsideAutocast(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=BF16):
            if x.dim() > 0:  # always: an error raised inside the block
                raise _Marker("raised inside torch.autocast during export")
        return x + 1  # reached only when __exit__ swallowed the error


def test_autocast_exit_swallows_errors() -> None:
    try:
        torch.export.export(RaisesInsideAutocast(), (torch.rand(2),), strict=False)
    except _Marker:
        swallowed = False
    else:
        swallowed = True
    assert not torch.is_autocast_enabled("cpu")
    assert swallowed == CAPS.autocast_exit_swallows_errors
    # eagerly the error always propagates
    with pytest.raises(_Marker):
        RaisesInsideAutocast()(torch.rand(2))


# -- Dynamo ----------------------------------------------------------------------------

@pytest.fixture
def dynamo_reset() -> Iterator[None]:
    import torch._dynamo

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _dynamo_export(module: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """The output of the exported graph on ``x``, or None when export refused."""
    import torch._dynamo

    try:
        result = torch._dynamo.export(module, aten_graph=True,
                                      assume_static_by_default=True)(x)
    except Exception:
        return None
    out: torch.Tensor = result.graph_module(x)
    return out


@contextlib.contextmanager
def _bf16() -> Iterator[None]:
    with torch.autocast("cpu", dtype=BF16):
        yield


class GeneratorContext(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with _bf16():
            return self.lin(x)


class ExitStackContext(nn.Module):
    """What ctxreplay's replay is: generator contexts composed in an ExitStack."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with contextlib.ExitStack() as stack:
            stack.enter_context(_bf16())
            return self.lin(x)


def _instance_forward() -> nn.Module:
    """A forward set on the instance, as ctxreplay swaps in its capture wrapper."""
    module = nn.Linear(4, 4)
    orig = module.forward

    @functools.wraps(orig)
    def forward(*args: Any, **kwargs: Any) -> Any:
        return orig(*args, **kwargs)

    module.forward = forward  # type: ignore[method-assign]
    return module


def test_dynamo_traces_contextmanager(dynamo_reset: None) -> None:
    out = _dynamo_export(GeneratorContext(), torch.rand(2, 4))
    traced = out is not None and out.dtype == BF16
    assert traced == CAPS.dynamo_traces_contextmanager


def test_dynamo_traces_exitstack(dynamo_reset: None) -> None:
    out = _dynamo_export(ExitStackContext(), torch.rand(2, 4))
    traced = out is not None and out.dtype == BF16
    assert traced == CAPS.dynamo_traces_exitstack


def test_dynamo_traces_instance_forward(dynamo_reset: None) -> None:
    module = _instance_forward()
    x = torch.rand(2, 4)
    out = _dynamo_export(module, x)
    traced = out is not None and torch.allclose(out, module(x))
    assert traced == CAPS.dynamo_traces_instance_forward


# -- torch.compiler ------------------------------------------------------------------

def test_is_dynamo_compiling(dynamo_reset: None) -> None:
    assert hasattr(torch.compiler, "is_dynamo_compiling") == CAPS.is_dynamo_compiling
    if not CAPS.is_dynamo_compiling:
        return
    assert not torch.compiler.is_dynamo_compiling()

    def f(x: torch.Tensor) -> torch.Tensor:
        return x + 1 if torch.compiler.is_dynamo_compiling() else x

    x = torch.zeros(2)
    assert torch.equal(torch.compile(f, backend="eager", fullgraph=True)(x), x + 1)


def test_is_exporting() -> None:
    assert hasattr(torch.compiler, "is_exporting") == CAPS.is_exporting
    if CAPS.is_exporting:
        assert not torch.compiler.is_exporting()


# -- precision and attention backends ----------------------------------------------------

def test_fp32_precision_api() -> None:
    has = hasattr(torch.backends.cuda.matmul, "fp32_precision")
    assert has == CAPS.fp32_precision_api
    if not CAPS.fp32_precision_api:
        return
    getter = torch._C._get_fp32_precision_getter
    assert isinstance(getter("cuda", "matmul"), str)
    assert torch.backends.cuda.matmul.fp32_precision == getter("cuda", "matmul")


def test_cublas_reduced_precision_pair() -> None:
    get = torch._C._get_cublas_allow_fp16_reduced_precision_reduction
    set_ = torch._C._set_cublas_allow_fp16_reduced_precision_reduction
    before = get()
    try:
        if CAPS.cublas_reduced_precision_pair:
            set_(False, False)  # the setter takes the pair
            assert tuple(map(bool, get())) == (False, False)
        else:
            set_(False)
            assert get() is False
    finally:
        if isinstance(before, tuple):
            set_(*before)
        else:
            set_(before)
    assert get() == before


def test_aoti_loader_takes_device(tmp_path: Path) -> None:
    """The form :func:`aoti_package_loader` picks is the one the constructor
    takes (a missing package: torch's own error), the other its arity error."""
    from ctxreplay._base.torchcaps import aoti_package_loader

    cls = torch._C._aoti.AOTIModelPackageLoader
    missing = str(tmp_path / "missing.pt2")
    with pytest.raises(Exception) as picked:
        aoti_package_loader(missing, "cpu")
    assert not isinstance(picked.value, TypeError), picked.value
    other = (missing, "model", False) if CAPS.aoti_loader_takes_device \
        else (missing, "model", False, 1, -1)
    with pytest.raises(TypeError, match="incompatible constructor arguments"):
        cls(*other)


def test_sdp_getters() -> None:
    assert CAPS.sdp_getters == {n for n in SDP_GETTERS if hasattr(torch._C, n)}
    for name in CAPS.sdp_getters:
        value = getattr(torch._C, name)()
        if name == "_get_sdp_priority_order":
            assert len(value) >= 1
        else:
            assert isinstance(value, bool), (name, value)


def test_is_any_autocast_enabled() -> None:
    assert hasattr(torch._C, "_is_any_autocast_enabled") == CAPS.is_any_autocast_enabled
    if CAPS.is_any_autocast_enabled:
        assert not torch._C._is_any_autocast_enabled()
        with torch.autocast("cpu", dtype=BF16):
            assert torch._C._is_any_autocast_enabled()


# -- dynamo_exporting ----------------------------------------------------------------

def test_dynamo_exporting_is_marked_as_assume_constant_result_marks() -> None:
    import torch._dynamo

    def f() -> bool:
        return False

    marked = torch._dynamo.assume_constant_result(f)
    extra = set(vars(marked)) - set(vars(lambda: None))
    assert extra == {"_dynamo_marked_constant"}
    assert getattr(_torchcaps.dynamo_exporting, "_dynamo_marked_constant", False) is True


def test_dynamo_exporting_is_true_only_while_dynamo_traces_for_an_export() -> None:
    import torch._dynamo

    seen: list[str] = []

    class M(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if torch.compiler.is_dynamo_compiling() and not _torchcaps.dynamo_exporting():
                seen.append("compile")
            return x + 1

    m, x = M(), torch.rand(2)
    assert not _torchcaps.dynamo_exporting()
    torch._dynamo.reset()
    try:
        torch.compile(m, backend="eager")(x)
        assert seen == ["compile"]
        torch._dynamo.export(m)(x)
        torch.export.export(m, (x,), strict=True)
        torch.export.export(m, (x,), strict=False)
        assert seen == ["compile"]
    finally:
        torch._dynamo.reset()


def test_export_guards_sizes() -> None:
    """A size inside the traced range that the trace sent down another path
    is refused by the unlifted program only where torch checks its guards."""

    class Special(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.shape[1] == 7:
                return x * 3
            return x + 1

    dims = ({1: torch.export.Dim.AUTO},)  # type: ignore[attr-defined]
    ep = torch.export.export(Special(), (torch.rand(2, 5),), dynamic_shapes=dims, strict=False)
    gm = ep.module()
    assert torch.equal(gm(torch.ones(2, 9)), torch.full((2, 9), 2.0))  # in range, same path
    try:
        out = gm(torch.ones(2, 7))
    except AssertionError:
        refused = True
    else:
        refused = False
        assert torch.equal(out, torch.full((2, 7), 2.0))  # the traced path, silently
    assert refused == CAPS.export_guards_sizes


def test_export_traces_growing_containers() -> None:
    class Grows(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[int] = []

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.seen.append(1)
            return x + 1

    try:
        torch.export.export(Grows(), (torch.rand(2),), strict=False)
    except ValueError as exc:
        assert "arity" in str(exc)
        traced = False
    else:
        traced = True
    assert traced == CAPS.export_traces_growing_containers


def _guard_outcome(fn: Any, *args: Any) -> str:
    try:
        return repr(fn(*args))
    except AssertionError as exc:
        return f"AssertionError: {exc}"


def test_export_guards_fn_in_closure() -> None:
    """The function found inside the guard submodule's ``forward`` checks
    what ``forward`` checks: it passes a size the trace holds and refuses
    one its guards exclude, with the same message."""

    class Special(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.shape[1] == 7:
                return x * 3
            return x + 1

    dims = ({1: torch.export.Dim.AUTO},)  # type: ignore[attr-defined]
    ep = torch.export.export(Special(), (torch.rand(2, 5),), dynamic_shapes=dims, strict=False)
    gm: Any = ep.module()
    guards = getattr(gm, "_guards_fn", None)
    found = False
    if guards is not None:
        body = _torchcaps._find_guards_fn_body(guards.forward)
        cases = (torch.ones(2, 9), torch.ones(2, 7))
        outcomes = [_guard_outcome(guards.forward, x) for x in cases]
        assert outcomes[0] == "None" and outcomes[1].startswith("AssertionError: Guard failed")
        found = body is not None and body is not guards.forward and \
            [_guard_outcome(body, x) for x in cases] == outcomes
    assert found == CAPS.export_guards_fn_in_closure
    if guards is not None:  # what the flat program calls: the body only where it is known
        assert (_torchcaps.guards_fn_body(guards.forward) is not None) == found


class TakesPairs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor], *, scale: torch.Tensor
                ) -> dict[str, torch.Tensor]:
        return {"sum": self.lin(pair[0]) + pair[1] * scale, "diff": pair[0] - pair[1]}


def test_fx_pytree_codegen() -> None:
    """``module()``'s graph takes the in-spec's leaves as its placeholders
    and returns the out-spec's leaves: its graph run on the flat leaves
    (``enable_io_processing=False``) and rebuilt by the out-spec gives what
    the module gives, and its code generator names those specs."""
    from torch.utils import _pytree as pytree

    args = ((torch.rand(2, 4), torch.rand(2, 4)),)
    kwargs = {"scale": torch.rand(2, 4)}
    ep = torch.export.export(TakesPairs(), args, kwargs, strict=False)
    gm: Any = ep.module()
    info = getattr(getattr(gm.graph, "_codegen", None), "pytree_info", None)
    holds = info is not None and info.in_spec == ep.call_spec.in_spec \
        and info.out_spec == ep.call_spec.out_spec
    if holds:
        leaves = pytree.tree_leaves((args, kwargs))
        placeholders = list(gm.graph.find_nodes(op="placeholder"))
        flat = torch.fx.Interpreter(gm).run(*leaves, enable_io_processing=False)
        rebuilt = pytree.tree_unflatten(list(flat), info.out_spec)
        want = gm(*args, **kwargs)
        holds = len(placeholders) == len(leaves) and rebuilt.keys() == want.keys() and \
            all(torch.equal(rebuilt[k], want[k]) for k in want)
    assert holds == CAPS.fx_pytree_codegen


def test_op_overload_calls_op() -> None:
    """Calling an overload calls its ``_op`` once, with the same arguments,
    and returns what ``_op`` returned (seen by a recording ``_op``)."""
    op: Any = torch.ops.aten.sin.default
    real = op._op
    seen: list[tuple[Any, Any]] = []
    marker = object()

    def recording(*args: Any, **kwargs: Any) -> Any:
        seen.append((args, kwargs))
        return marker

    x = torch.rand(3)
    op._op = recording
    try:
        got = op(x)
    finally:
        op._op = real
    forwards = got is marker and len(seen) == 1 and seen[0][0] == (x,) and seen[0][1] == {}
    # where the cap holds, the call is ``_op``'s; where it does not, the
    # method reads more than ``_op`` (torch 2.14 first asks a Python
    # dispatcher), though for this op it may still reach ``_op``
    assert forwards if CAPS.op_overload_calls_op else (
        torch._ops.OpOverload.__call__.__code__.co_names != ("_op",))
    assert torch.equal(op(x), torch.sin(x))


def _flags() -> tuple[Any, ...]:
    nesting = torch.autocast_increment_nesting() - 1
    torch.autocast_decrement_nesting()
    return (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"),
            torch.is_autocast_cache_enabled(), nesting)


def _what_runs() -> tuple[Any, ...]:
    a = torch.rand(2, 2)
    return (*_flags(), (a @ a).dtype)


@pytest.mark.parametrize("outer", [None, torch.float16])
@pytest.mark.parametrize("args", [("cpu", BF16), ("cpu", torch.float16, False),
                                  ("cpu", BF16, True, False), ("cpu", BF16, False, False),
                                  ("cpu",)])
def test_autocast_inlinable(outer: torch.dtype | None, args: tuple[Any, ...]) -> None:
    """Inside and after ``torch.autocast(*args)`` -- alone or nested in another
    autocast -- the flags and what a matmul computes in are those of the
    inlined pair."""
    with contextlib.ExitStack() as stack:
        if outer is not None:
            stack.enter_context(torch.autocast("cpu", dtype=outer))
        with torch.autocast(*args):
            by_torch = _what_runs()
        after_torch = _what_runs()
        found = _torchcaps.autocast_enter(*_torchcaps.autocast_resolved(*args))
        try:
            inlined = _what_runs()
        finally:
            _torchcaps.autocast_exit("cpu", found)
        after_inlined = _what_runs()
    assert (by_torch == inlined and after_torch == after_inlined) == CAPS.autocast_inlinable


_DTENSOR_EXPORT = '''
import os, sys, torch, torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
parallelize_module(m, init_device_mesh("cpu", (1,)), plan)
from ctxreplay.backends.dtensor import traceable
try:
    with traceable(m):
        torch.export.export(m, (torch.rand(2, 8),), strict=False)
    print("traced")
except RuntimeError as exc:
    print("refused", exc)
dist.destroy_process_group()
'''


def test_export_traces_dtensor(tmp_path: Path) -> None:
    """A one-rank tensor-parallel MLP exported in a fresh process (a process
    group is process-wide state)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _DTENSOR_EXPORT, str(tmp_path / "store")],
                          capture_output=True, text=True, timeout=300, cwd=Path.cwd())
    assert proc.returncode == 0, proc.stderr[-2000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("traced" if CAPS.export_traces_dtensor else "refused"), last
