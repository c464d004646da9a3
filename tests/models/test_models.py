"""Real models, tiny configs built in code (no downloads), run live under CPU
bfloat16 autocast + inference mode, every repeated block captured and
verified by execution (``verify="execute"``).

Needs the ``models`` extra (``pip install -e '.[models]'``); a missing
package skips its test.  Every capture must match its live call: there are
no classified failures among these models today (a future one must be
asserted here by its reason code, never skipped).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import real_models
import torch
from torch import nn

import ctxreplay
from ctxreplay.fidelity.verify import flat_tensor_spec

pytestmark = [pytest.mark.models,
              pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning")]


def _capture_live(model: nn.Module, calls: Callable[[nn.Module], list[Any]]
                  ) -> tuple[list[Any], ctxreplay.CaptureReport]:
    with ctxreplay.capture_with(model, targets="repeated", verify="execute") as session, \
            torch.autocast("cpu", dtype=torch.bfloat16), torch.inference_mode():
        outs = calls(model)
    return outs, session.finalize()


def _assert_faithful(report: ctxreplay.CaptureReport, *, min_captures: int,
                     cache_grows: bool = False) -> None:
    """Every capture reproduces its calls; with ``cache_grows`` (a
    ``DynamicCache`` argument the forward grows by assignment) each
    program returns the cache's new tensors (``assigned``)."""
    assert not report.failures, [(f.scope, f.variant, f.reason) for f in report.failures]
    assert len(report.captures) >= min_captures
    assert report.ok, report.summary
    for c in report.captures:
        where = f"{c.scope}#{c.variant}"
        assert not c.fidelity.mismatches, where
        assert (c.assigned is not None and len(c.assigned.tensors) >= 2) is cache_grows, where
        assert c.fidelity.checked == ("signature", "execute"), where
        assert c.backend == "export", where
        assert "autocast" in c.embedded, where
        assert "grad_mode" in c.ambient_only, where  # inference mode is not embeddable
        assert c.outputs is not None and c.graph_outputs is not None
        live = [s.dtype for s in flat_tensor_spec(c.outputs).items]  # type: ignore[union-attr]
        graph = [s.dtype for s in flat_tensor_spec(c.graph_outputs).items]  # type: ignore[union-attr]
        assert live == graph, where
    # the replayed autocast shaped every graph: each computes in bfloat16 somewhere
    for c in report.captures:
        assert any(dtype == "bfloat16" for _, dtype in c.ops), f"{c.scope}#{c.variant}"


def _save_and_reload(c: ctxreplay.Capture, tmp_path: Path) -> None:
    """The capture as a .pt2 still behaves like the live call, and its sidecar
    rebuilds inputs for it."""
    saved = c.save(tmp_path / f"{c.scope}-{c.variant}.pt2")
    assert saved.fidelity.ok, saved.fidelity.mismatches
    side = ctxreplay.load_sidecar(saved.path)
    args, kwargs = side.example_inputs()
    assert side.check(side.load_program().module()(*args, **kwargs)) == ()


# -- transformers: decoder-only LMs, prefill and one cached decode step -----------

def _prefill_and_decode(vocab: int) -> Callable[[nn.Module], list[Any]]:
    def calls(model: nn.Module) -> list[Any]:
        prompt = model(torch.randint(0, vocab, (1, 8)), use_cache=True)
        step = model(torch.randint(0, vocab, (1, 1)), past_key_values=prompt.past_key_values,
                     use_cache=True)
        return [prompt.logits, step.logits]
    return calls


def _check_lm(model: nn.Module, vocab: int, tmp_path: Path) -> None:
    torch.manual_seed(0)
    outs, report = _capture_live(model.eval(), _prefill_and_decode(vocab))
    assert [o.dtype for o in outs] == [torch.bfloat16, torch.bfloat16]
    _assert_faithful(report, min_captures=2, cache_grows=True)
    assert len({c.scope for c in report.captures}) == 1  # one structure: the decoder layer
    # Each layer's calls are its own variants: the layers differ in layer_idx,
    # and the cache a layer receives already holds the layers before it.
    assert len(report.captures) == 4
    assert all(len(c.members) == 1 for c in report.captures)
    by_member: dict[str, list[ctxreplay.Capture]] = {}
    for c in sorted(report.captures, key=lambda c: c.variant):
        by_member.setdefault(c.members[0], []).append(c)
    assert len(by_member) == 2
    for member, (prefill, decode) in by_member.items():
        # The decode step's cache already held the prompt's keys and values when
        # the layer was called; the capture rebuilt it with tensors of those
        # shapes, not the state the live forward left it in.
        fresh = {p for p, _ in prefill.signature.leaves()}
        cache = [s.shape for p, s in decode.signature.leaves() if p not in fresh]
        assert cache and all(len(shape) == 4 and shape[-2] in (8, 9) for shape in cache), \
            (member, cache)
    last = by_member[sorted(by_member)[-1]][1]
    # the second layer's decode call sees the first layer's entry grown by one
    assert any(s.shape[-2] == 9 for _, s in last.signature.leaves() if len(s.shape) == 4)
    _save_and_reload(last, tmp_path)


def test_llama_decoder(tmp_path: Path) -> None:
    _check_lm(real_models.llama(), real_models.VOCAB, tmp_path)


def test_gpt2_decoder(tmp_path: Path) -> None:
    _check_lm(real_models.gpt2(), real_models.VOCAB, tmp_path)


# -- diffusers: a UNet and two transformers ------------------------------------------

def test_diffusers_unet2d_condition(tmp_path: Path) -> None:
    unet = real_models.unet2d_condition()

    def calls(model: nn.Module) -> list[Any]:
        return [model(torch.rand(1, 4, 8, 8), torch.tensor([10]),
                      encoder_hidden_states=torch.rand(1, 4, 32)).sample]

    outs, report = _capture_live(unet.eval(), calls)
    assert outs[0].dtype == torch.bfloat16
    _assert_faithful(report, min_captures=8)
    scopes = {c.scope for c in report.captures}
    assert any(".resnets." in s for s in scopes) and any(".attentions." in s for s in scopes)
    _save_and_reload(next(c for c in report.captures if c.scope.endswith("attentions.0")),
                     tmp_path)


def test_diffusers_flux_transformer(tmp_path: Path) -> None:
    flux = real_models.flux()
    seq, txt = 16, 4

    def calls(model: nn.Module) -> list[Any]:
        return [model(hidden_states=torch.rand(1, seq, 4),
                      encoder_hidden_states=torch.rand(1, txt, 16),
                      pooled_projections=torch.rand(1, 16), timestep=torch.tensor([0.5]),
                      img_ids=torch.zeros(seq, 3), txt_ids=torch.zeros(txt, 3)).sample]

    outs, report = _capture_live(flux.eval(), calls)
    assert outs[0].dtype == torch.bfloat16
    _assert_faithful(report, min_captures=2)
    assert {c.scope for c in report.captures} == {"transformer_blocks.0",
                                                   "single_transformer_blocks.0"}
    for c in report.captures:
        _save_and_reload(c, tmp_path)


def test_diffusers_dit_transformer() -> None:
    dit = real_models.dit()

    def calls(model: nn.Module) -> list[Any]:
        return [model(torch.rand(1, 4, 8, 8), timestep=torch.tensor([3]),
                      class_labels=torch.tensor([1])).sample]

    _outs, report = _capture_live(dit.eval(), calls)
    _assert_faithful(report, min_captures=1)


# -- torchvision ----------------------------------------------------------------------

_TORCHVISION_LIMIT = (
    "platform limit (torch/torchvision build mismatch): no torchvision build loads beside "
    f"this torch {torch.__version__}; PyPI's torchvision wheels (0.28.0 pairs with torch "
    "2.13.0) are linked against CUDA torch libraries, so their compiled operators "
    "(torchvision::nms) do not register with a CPU-only torch wheel")


def _torchvision() -> Any:
    try:
        import torchvision
    except ImportError as exc:
        if torch.version.cuda is not None or torch.version.hip is not None:
            # a standard (CUDA/ROCm) build: its paired torchvision loads; it is
            # only not installed here (make test-matrix installs it)
            pytest.skip(f"torchvision is not installed beside this torch {torch.__version__} "
                        "(not a platform limit: install the torchvision release paired "
                        "with it)")
        pytest.skip(f"torchvision is not importable ({type(exc).__name__}): "
                    f"{_TORCHVISION_LIMIT}")
    except (RuntimeError, OSError) as exc:  # its C extension fails to load
        pytest.skip(f"torchvision fails to import ({type(exc).__name__}): {_TORCHVISION_LIMIT}")
    return torchvision


def test_torchvision_resnet() -> None:
    torchvision = _torchvision()
    torch.manual_seed(0)
    resnet = torchvision.models.resnet18(num_classes=10)

    def calls(model: nn.Module) -> list[Any]:
        return [model(torch.rand(1, 3, 32, 32))]

    outs, report = _capture_live(resnet.eval(), calls)
    assert outs[0].dtype == torch.bfloat16
    _assert_faithful(report, min_captures=2)
