"""diffusers' step caches on the suite's tiny video transformers: one config
per cache hook the installed diffusers ships, a denoising loop that calls
the transformer directly with changing latents and timesteps, and a record
of every cache hook's state (by identity, tensors by value too) to compare
before and after ``finalize()``.

Each config is set so that the cache both computes and reuses within
``STEPS`` steps of the loop below (thresholds high, skip ranges that leave
the first step computed, as the caches require).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from real_models import cogvideox, wan
from torch import nn

STEPS = 5
#: timesteps of the loop: 999, 799, ... (in every skip range but the first)
TIMESTEPS = tuple(999 - 200 * i for i in range(STEPS))


class Clock:
    """The loop's current timestep, as a pipeline's callback reads it."""

    def __init__(self) -> None:
        self.t = TIMESTEPS[0]

    def __call__(self) -> int:
        return self.t


def shipped_cache_configs() -> set[str]:
    """The step-cache config classes the installed ``diffusers.hooks`` exports."""
    hooks = pytest.importorskip("diffusers.hooks")
    return {n for n in dir(hooks) if n.endswith("CacheConfig")
            or n == "PyramidAttentionBroadcastConfig"}


def config(name: str, clock: Clock) -> Any:
    """The config of cache ``name`` (a class name of ``diffusers.hooks``)."""
    h = pytest.importorskip("diffusers.hooks")
    skip = {"current_timestep_callback": clock}
    made = {
        "PyramidAttentionBroadcastConfig": lambda: h.PyramidAttentionBroadcastConfig(
            spatial_attention_block_skip_range=2,
            spatial_attention_timestep_skip_range=(-1, 900), **skip),
        "FasterCacheConfig": lambda: h.FasterCacheConfig(
            spatial_attention_block_skip_range=2,
            spatial_attention_timestep_skip_range=(-1, 900), is_guidance_distilled=True,
            attention_weight_callback=lambda _: 0.5, tensor_format="BFCHW", **skip),
        "FirstBlockCacheConfig": lambda: h.FirstBlockCacheConfig(threshold=0.9),
        "MagCacheConfig": lambda: h.MagCacheConfig(
            threshold=0.5, num_inference_steps=STEPS, mag_ratios=[1.0] * STEPS),
        "SeaCacheConfig": lambda: h.SeaCacheConfig(threshold=0.9),
        # its default patterns ("^blocks.*attn") match no attention named
        # attn1/attn2 under re.fullmatch: these hook the models' own
        "TaylorSeerCacheConfig": lambda: h.TaylorSeerCacheConfig(
            cache_interval=2, disable_cache_before_step=1,
            taylor_factors_dtype=torch.float32,
            cache_identifiers=[r"(transformer_)?blocks\.\d+\.attn\d"]),
        # applies to NucleusMoE image blocks only: on these models it installs
        # nothing, and the model must still run and capture as without it
        "TextKVCacheConfig": lambda: h.TextKVCacheConfig(),
    }
    return made[name]()


def build(kind: str, cache: str, clock: Clock) -> nn.Module:
    """A tiny ``"wan"`` (2 blocks) or ``"cogvideox"`` with ``cache`` enabled."""
    model = wan(num_layers=2) if kind == "wan" else cogvideox()
    model.enable_cache(config(cache, clock))  # type: ignore[operator]
    return model


def step_inputs(kind: str, i: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(100 + i)
    text = torch.rand(1, 4, 16, generator=torch.Generator().manual_seed(7))
    shape = (1, 4, 2, 8, 8) if kind == "wan" else (1, 2, 4, 8, 8)
    return {"hidden_states": torch.rand(*shape, generator=g), "encoder_hidden_states": text,
            "timestep": torch.tensor([TIMESTEPS[i]])}


def denoise(model: nn.Module, kind: str, clock: Clock) -> list[torch.Tensor]:
    """``STEPS`` calls of the transformer, each in a ``cache_context`` that
    says where the loop is (SeaCache reads the step, sigma and count)."""
    return _loop(model, clock, lambda i: step_inputs(kind, i))


def _loop(model: nn.Module, clock: Clock, inputs: Callable[[int], dict[str, Any]]
          ) -> list[torch.Tensor]:
    """The transformer on ``inputs(i)`` at each step ``i``, in its
    ``cache_context``, with the clock at that step's timestep."""
    outs = []
    with torch.no_grad():
        for i, t in enumerate(TIMESTEPS):
            clock.t = t
            with model.cache_context(  # type: ignore[operator]
                    "cond", step_index=i, num_inference_steps=STEPS,
                    timestep=float(t), sigma=t / 1000):
                outs.append(model(**inputs(i), return_dict=False)[0])
    return outs


@contextlib.contextmanager
def open_context(model: nn.Module, inside: bool) -> Iterator[None]:
    """An open ``cache_context`` (``inside``), as a pipeline's loop holds one."""
    if not inside:
        yield
        return
    with model.cache_context("cond", step_index=STEPS - 1,  # type: ignore[operator]
                             num_inference_steps=STEPS):
        yield


def hook_state(model: nn.Module) -> dict[str, Any]:
    """Every cache hook's state, recursively: per path, the object held (by
    identity) and, for a tensor, a copy of its values."""
    out: dict[str, Any] = {}
    for name, sub in model.named_modules():
        registry = sub.__dict__.get("_diffusers_hook")
        if registry is None:
            continue
        for hook_name, hook in registry.hooks.items():
            _walk(hook, f"{name}:{hook_name}", out, set())
    return out


def _walk(obj: Any, path: str, out: dict[str, Any], seen: set[int]) -> None:
    if isinstance(obj, torch.Tensor):
        out[path] = (obj, obj.detach().clone() if type(obj) is torch.Tensor else type(obj))
        return
    out[path] = (obj, None)
    if id(obj) in seen or isinstance(obj, (nn.Module, type, str, int, float, bool)) \
            or callable(obj):
        return
    seen.add(id(obj))
    if isinstance(obj, dict):
        for k, v in obj.items():
            _walk(v, f"{path}[{k!r}]", out, seen)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _walk(v, f"{path}[{i}]", out, seen)
    elif type(getattr(obj, "__dict__", None)) is dict:
        for k, v in vars(obj).items():
            _walk(v, f"{path}.{k}", out, seen)


def state_changes(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """Paths whose object or tensor values differ (empty: none)."""
    bad = sorted(set(before) ^ set(after))
    for path, (obj, value) in before.items():
        if path not in after:
            continue
        now, now_value = after[path]
        if now is not obj:
            bad.append(f"{path}: {type(obj).__name__} -> {type(now).__name__}")
        elif isinstance(value, torch.Tensor) and (
                type(now_value) is not torch.Tensor or not torch.equal(value, now_value)):
            bad.append(f"{path}: values")
    return bad


def generation_inputs(kind: str, i: int, prompt: int) -> dict[str, Any]:
    """Step ``i`` of a generation with classifier-free guidance, as a
    pipeline batches it: the latents twice (unconditional, conditional),
    the prompt's embedding (seeded by ``prompt``) beside an empty one."""
    g = torch.Generator().manual_seed(1000 * prompt + i)
    shape = (1, 4, 2, 8, 8) if kind == "wan" else (1, 2, 4, 8, 8)
    latents = torch.rand(*shape, generator=g)
    text = torch.rand(1, 4, 16, generator=torch.Generator().manual_seed(prompt))
    return {"hidden_states": torch.cat([latents, latents]),
            "encoder_hidden_states": torch.cat([torch.zeros_like(text), text]),
            "timestep": torch.tensor([TIMESTEPS[i]] * 2)}


def generate(model: nn.Module, kind: str, clock: Clock, prompt: int,
             end: Any = None) -> list[torch.Tensor]:
    """One generation: ``STEPS`` calls of the transformer (CFG batch 2), each
    in its ``cache_context``; ``end()`` (if given) runs after the last step,
    before the cache is reset as a pipeline resets it when it finishes."""
    outs = _loop(model, clock, lambda i: generation_inputs(kind, i, prompt))
    if end is not None:
        end()
    model._reset_stateful_cache()  # type: ignore[operator]
    return outs


@contextlib.contextmanager
def counted(model: nn.Module, names: list[str]) -> Iterator[dict[str, int]]:
    """How often each named module's own forward computed: a forward hook on
    its first leaf submodule (a step the cache reuses runs none of it)."""
    counts = dict.fromkeys(names, 0)
    handles = []
    for name in names:
        leaf = next(m for m in model.get_submodule(name).modules()
                    if not list(m.children()))

        def hook(*_: Any, name: str = name) -> None:
            counts[name] += 1
        handles.append(leaf.register_forward_hook(hook))
    try:
        yield counts
    finally:
        for h in handles:
            h.remove()


def hook_values(model: nn.Module) -> dict[str, Any]:
    """Every cache hook's state by value, per path: a tensor's copy, a plain
    value itself, any other object by its type (to compare two models)."""
    out: dict[str, Any] = {}
    for path, (obj, value) in hook_state(model).items():
        if isinstance(value, torch.Tensor):
            out[path] = value
        elif isinstance(obj, (int, float, bool, str, type(None))):
            out[path] = obj
        else:
            out[path] = type(obj).__qualname__
    return out


def value_differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Paths whose values differ between two ``hook_values`` (empty: none)."""
    bad = sorted(set(a) ^ set(b))
    for path in set(a) & set(b):
        x, y = a[path], b[path]
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            same = isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and \
                x.shape == y.shape and torch.equal(x, y)
        else:
            same = x == y
        if not same:
            bad.append(path)
    return sorted(bad)
