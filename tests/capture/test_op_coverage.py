"""Every op CPU autocast casts, captured faithfully -- or refused for torch's reason.

The cases are the ``AutocastCPU`` kernels of ``aten/src/ATen/autocast_mode.cpp``
(the lists behind the AMP documentation's "CPU Ops that can autocast to
bfloat16", "CPU Ops that can autocast to float32" and the promote list) of
every supported torch release; the ops *this* torch registers for
``AutocastCPU`` are the ones tested, and an op it registers that has no case
fails ``test_every_autocast_cpu_op_has_a_case``.

For each op a tiny module calls it (inputs inside the op's domain: SPD
matrices for Cholesky, probabilities for BCE, in-range indices), it runs live
under CPU bfloat16 autocast, and ctxreplay captures it (``backend="export"``,
``verify="execute"``).  Lower-precision ops get float32 inputs and must give
bfloat16; float32 ops get bfloat16 inputs and must give float32 (complex64,
or an integer result where the op returns one); promote ops get mixed inputs
and must give the widest.

What ctxreplay must produce is derived from the installed torch, never from
a list written for one release: the same module is exported by torch alone
(``torch.export.export``, non-strict, the autocast entered inside ``forward``
-- what embedded replay does, DESIGN.md fact 3).  Then

* torch refuses it: ctxreplay reports exactly one ``CaptureFailure`` whose
  reason is the reason code of torch's exception, looked up by its type in
  ``TORCH_REFUSALS`` (a type not listed there fails the test: classify it);
* torch's program disagrees with the live call (its output metadata or its
  outputs when run): ctxreplay's fidelity reports exactly those differences,
  at those levels, and is not ok;
* torch's program agrees: ctxreplay's capture is ok, and live dtype ==
  captured graph dtype == executed-artifact dtype.

Which ops fall where differs by release (measured): quantile / nanquantile
are data-dependent for export up to 2.11 and trace from 2.13;
``_grid_sampler_2d_cpu_fallback`` has no fake kernel up to 2.13 and traces on
2.14; nn.LSTM's ``mkldnn_rnn_layer`` is kept whole as ``aten.lstm.input``,
whose fake kernel reports float32 (and, up to 2.11, other shapes) for a
program that computes bfloat16.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, NamedTuple

import attrs
import pytest
import torch
import torch.nn.functional as F
from capability import BF16_LSTM_NEEDS, cpu_description, refusal, torch_limit
from torch import nn

import ctxreplay
from ctxreplay.fidelity.verify import flat_tensor_spec

pytestmark = [pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning")]

aten = torch.ops.aten
BF16, F32, C64, I64 = torch.bfloat16, torch.float32, torch.complex64, torch.int64


class Case(NamedTuple):
    op: str  # the registration: aten::<name>[.<overload>]
    fn: Callable[..., Any]  # called with the inputs (and the submodule, if ``make``)
    inputs: Callable[[], tuple[torch.Tensor, ...]]
    expect: torch.dtype  # dtype of the first output leaf under autocast
    make: Callable[[], nn.Module] | None = None  # a submodule holding parameters
    # registered for autocast, but aten's kernel refuses every call: the text
    # it raises (asserted -- an op that starts working needs a real case)
    unrunnable: str | None = None
    # what the CPU must offer for torch itself to run the op under autocast,
    # as measured (tests/helpers/capability.py); None: every CPU torch supports
    needs: str | None = None


def r(*shape: int, dtype: torch.dtype = F32) -> Callable[[], torch.Tensor]:
    return lambda: torch.rand(shape, dtype=dtype)


def ins(*makers: Callable[[], torch.Tensor]) -> Callable[[], tuple[torch.Tensor, ...]]:
    return lambda: tuple(m() for m in makers)


def b(*shape: int) -> Callable[[], torch.Tensor]:
    return r(*shape, dtype=BF16)


def zeros_long(*shape: int) -> Callable[[], torch.Tensor]:
    return lambda: torch.zeros(*shape, dtype=I64)


# Domain helpers, all computed in bfloat16 inside the module (so the op under
# test is the one that sees bfloat16): x is uniform in [0, 1).
def eye(n: int) -> torch.Tensor:
    return torch.eye(n, dtype=BF16)


def spd(x: torch.Tensor) -> torch.Tensor:
    """Symmetric positive definite: x^T x + n I (the matmul itself autocasts)."""
    return (x.mT @ x).to(BF16) + x.shape[-1] * eye(x.shape[-1])


def dominant(x: torch.Tensor) -> torch.Tensor:
    """Diagonally dominant, hence invertible."""
    return x + x.shape[-1] * eye(x.shape[-1])


def lower_tri(x: torch.Tensor) -> torch.Tensor:
    return torch.tril(x) + 2 * eye(x.shape[-1])


def pm_ones(n: int) -> torch.Tensor:
    return torch.tensor([1.0, -1.0] * (n // 2), dtype=BF16)


def unpool2d(x: torch.Tensor) -> torch.Tensor:
    pooled, idx = F.max_pool2d(x, 2, return_indices=True)
    return aten.max_unpool2d.default(pooled, idx, [4, 4])


def unpool3d(x: torch.Tensor) -> torch.Tensor:
    pooled, idx = F.max_pool3d(x, 2, return_indices=True)
    return aten.max_unpool3d.default(pooled, idx, [4, 4, 4], [2, 2, 2], [0, 0, 0])


def ctc_inputs(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    log_probs = x.log_softmax(-1)  # T=6, N=2, C=4
    targets = torch.ones(2, 3, dtype=I64)  # class 1; 0 is the blank
    return log_probs, targets


LOWER = [  # float32 in, bfloat16 out
    Case("conv1d", lambda x, w: F.conv1d(x, w), ins(r(1, 2, 8), r(3, 2, 3)), BF16),
    Case("conv1d.padding", lambda x, w: F.conv1d(x, w, padding="same"),
         ins(r(1, 2, 8), r(3, 2, 3)), BF16),
    Case("conv2d", lambda x, w: F.conv2d(x, w), ins(r(1, 2, 6, 6), r(3, 2, 3, 3)), BF16),
    Case("conv2d.padding", lambda x, w: F.conv2d(x, w, padding="same"),
         ins(r(1, 2, 6, 6), r(3, 2, 3, 3)), BF16),
    Case("conv3d", lambda x, w: F.conv3d(x, w), ins(r(1, 2, 4, 4, 4), r(3, 2, 3, 3, 3)), BF16),
    Case("conv3d.padding", lambda x, w: F.conv3d(x, w, padding="same"),
         ins(r(1, 2, 4, 4, 4), r(3, 2, 3, 3, 3)), BF16),
    Case("bmm", torch.bmm, ins(r(2, 3, 4), r(2, 4, 5)), BF16),
    Case("mm", torch.mm, ins(r(3, 4), r(4, 5)), BF16),
    Case("linalg_vecdot", torch.linalg.vecdot, ins(r(3, 4), r(3, 4)), BF16),
    Case("baddbmm", torch.baddbmm, ins(r(2, 3, 5), r(2, 3, 4), r(2, 4, 5)), BF16),
    Case("addmm", torch.addmm, ins(r(3, 5), r(3, 4), r(4, 5)), BF16),
    Case("_addmm_activation", lambda c, a, m: aten._addmm_activation.default(c, a, m),
         ins(r(3, 5), r(3, 4), r(4, 5)), BF16),
    Case("addbmm", torch.addbmm, ins(r(3, 5), r(2, 3, 4), r(2, 4, 5)), BF16),
    Case("linear", F.linear, ins(r(3, 4), r(5, 4), r(5)), BF16),
    Case("_convolution.deprecated",
         lambda x, w, bias: aten._convolution.deprecated(x, w, bias, [1, 1], [0, 0], [1, 1],
                                                         False, [0, 0], 1, False, False, True),
         ins(r(1, 2, 6, 6), r(3, 2, 3, 3), r(3)), BF16),
    Case("matmul", torch.matmul, ins(r(2, 3, 4), r(4, 5)), BF16),
    Case("conv_tbc", lambda x, w, bias: torch.conv_tbc(x, w, bias, 1),
         ins(r(6, 2, 3), r(3, 3, 4), r(4)), BF16),
    # what nn.LSTM runs on CPU (with mkldnn) under autocast
    Case("mkldnn_rnn_layer", lambda lstm, x: lstm(x), ins(r(5, 2, 3)), BF16,
         make=lambda: nn.LSTM(3, 4), needs=BF16_LSTM_NEEDS),
    Case("conv_transpose1d", lambda x, w: F.conv_transpose1d(x, w),
         ins(r(1, 2, 8), r(2, 3, 3)), BF16),
    Case("conv_transpose2d.input", lambda x, w: F.conv_transpose2d(x, w),
         ins(r(1, 2, 5, 5), r(2, 3, 3, 3)), BF16),
    Case("conv_transpose3d.input", lambda x, w: F.conv_transpose3d(x, w),
         ins(r(1, 2, 3, 3, 3), r(2, 3, 2, 2, 2)), BF16),
    Case("prelu", F.prelu, ins(r(2, 3, 4), r(3)), BF16),
    Case("scaled_dot_product_attention", F.scaled_dot_product_attention,
         ins(r(1, 2, 4, 8), r(1, 2, 4, 8), r(1, 2, 4, 8)), BF16),
    Case("_native_multi_head_attention",
         lambda q, w, bias, pw, pb: torch._native_multi_head_attention(
             q, q, q, 8, 2, w, bias, pw, pb, need_weights=True),
         ins(r(2, 3, 8), r(24, 8), r(24), r(8, 8), r(8)), BF16),
]

FP32 = [  # bfloat16 in, float32 (complex64, int64) out
    Case("avg_pool3d", lambda x: F.avg_pool3d(x, 2), ins(b(1, 1, 4, 4, 4)), F32),
    Case("binary_cross_entropy", F.binary_cross_entropy, ins(b(6), b(6)), F32),
    Case("grid_sampler", lambda x, g: F.grid_sample(x, g * 2 - 1, align_corners=False),
         ins(b(1, 1, 4, 4), b(1, 3, 3, 2)), F32),
    Case("grid_sampler_2d", lambda x, g: torch.grid_sampler_2d(x, g * 2 - 1, 0, 0, False),
         ins(b(1, 1, 4, 4), b(1, 3, 3, 2)), F32),
    Case("_grid_sampler_2d_cpu_fallback",
         lambda x, g: torch._grid_sampler_2d_cpu_fallback(x, g * 2 - 1, 0, 0, False),
         ins(b(1, 1, 4, 4), b(1, 3, 3, 2)), F32),
    Case("grid_sampler_3d", lambda x, g: torch.grid_sampler_3d(x, g * 2 - 1, 0, 0, False),
         ins(b(1, 1, 4, 4, 4), b(1, 2, 2, 2, 3)), F32),
    Case("polar", torch.polar, ins(b(4), b(4)), C64),
    Case("prod", lambda x: torch.prod(x), ins(b(6)), F32),
    Case("prod.dim_int", lambda x: torch.prod(x, 1), ins(b(2, 3)), F32),
    # named-tensor overload (registered up to 2.12)
    Case("prod.dim_Dimname", lambda x: torch.prod(x.refine_names("N", "C"), "C"),
         ins(b(2, 3)), F32),
    Case("quantile", lambda x, q: torch.quantile(x, q), ins(b(8), b(2)), F32),
    Case("quantile.scalar", lambda x: torch.quantile(x, 0.5), ins(b(8)), F32),
    Case("nanquantile", lambda x, q: torch.nanquantile(x, q), ins(b(8), b(2)), F32),
    Case("nanquantile.scalar", lambda x: torch.nanquantile(x, 0.5), ins(b(8)), F32),
    Case("stft", lambda x: aten.stft.default(x, 8, 2, None, None, False, None, True),
         ins(b(32)), C64),
    Case("stft.center", lambda x: aten.stft.center(x, 8, 2, None, None, True, "reflect",
                                                    False, None, True),
         ins(b(32)), C64),
    Case("cdist", torch.cdist, ins(b(3, 4), b(5, 4)), F32),
    Case("trace", torch.trace, ins(b(4, 4)), F32),
    Case("view_as_complex", torch.view_as_complex, ins(b(4, 2)), C64),
    Case("cholesky", lambda x: torch.cholesky(spd(x)), ins(b(4, 4)), F32),
    Case("cholesky_inverse", lambda x: torch.cholesky_inverse(lower_tri(x)), ins(b(4, 4)), F32),
    Case("cholesky_solve", lambda rhs, x: torch.cholesky_solve(rhs, lower_tri(x)),
         ins(b(4, 2), b(4, 4)), F32),
    Case("inverse", lambda x: torch.inverse(dominant(x)), ins(b(4, 4)), F32),
    Case("lu_solve",
         lambda rhs, x: aten.lu_solve.default(rhs, dominant(x),
                                              torch.arange(1, 5, dtype=torch.int32)),
         ins(b(4, 2), b(4, 4)), F32),
    Case("orgqr", torch.orgqr, ins(b(4, 3), b(3)), F32),
    Case("ormqr", torch.ormqr, ins(b(4, 3), b(3), b(4, 2)), F32),
    Case("pinverse", lambda x: torch.pinverse(dominant(x)), ins(b(4, 4)), F32),
    Case("max_pool3d", lambda x: torch.max_pool3d(x, 2), ins(b(1, 1, 4, 4, 4)), F32),
    Case("max_unpool2d", unpool2d, ins(b(1, 1, 4, 4)), F32),
    Case("max_unpool3d", unpool3d, ins(b(1, 1, 4, 4, 4)), F32),
    Case("adaptive_avg_pool3d", lambda x: F.adaptive_avg_pool3d(x, 2),
         ins(b(1, 1, 4, 4, 4)), F32),
    Case("reflection_pad1d", lambda x: aten.reflection_pad1d.default(x, [1, 1]),
         ins(b(1, 2, 4)), F32),
    Case("reflection_pad2d", lambda x: aten.reflection_pad2d.default(x, [1, 1, 1, 1]),
         ins(b(1, 2, 4, 4)), F32),
    Case("replication_pad1d", lambda x: aten.replication_pad1d.default(x, [1, 1]),
         ins(b(1, 2, 4)), F32),
    Case("replication_pad2d", lambda x: aten.replication_pad2d.default(x, [1, 1, 1, 1]),
         ins(b(1, 2, 4, 4)), F32),
    Case("replication_pad3d",
         lambda x: aten.replication_pad3d.default(x, [1, 1, 1, 1, 1, 1]),
         ins(b(1, 1, 3, 3, 3)), F32),
    Case("mse_loss", F.mse_loss, ins(b(6), b(6)), F32),
    Case("cosine_embedding_loss", lambda x1, x2: F.cosine_embedding_loss(x1, x2, pm_ones(4)),
         ins(b(4, 3), b(4, 3)), F32),
    Case("nll_loss", lambda x, t: F.nll_loss(x.log_softmax(-1), t),
         ins(b(4, 5), zeros_long(4)), F32),
    Case("nll_loss2d", lambda x, t: aten.nll_loss2d.default(x.log_softmax(1), t, None, 1, -100),
         ins(b(2, 3, 4, 4), zeros_long(2, 4, 4)), F32),
    Case("hinge_embedding_loss", lambda x: F.hinge_embedding_loss(x, pm_ones(6)),
         ins(b(6)), F32),
    Case("poisson_nll_loss", F.poisson_nll_loss, ins(b(6), b(6)), F32),
    Case("smooth_l1_loss", F.smooth_l1_loss, ins(b(6), b(6)), F32),
    Case("cross_entropy_loss", F.cross_entropy, ins(b(4, 5), zeros_long(4)), F32),
    Case("l1_loss", F.l1_loss, ins(b(6), b(6)), F32),
    Case("huber_loss", F.huber_loss, ins(b(6), b(6)), F32),
    Case("margin_ranking_loss", lambda x1, x2: F.margin_ranking_loss(x1, x2, pm_ones(6)),
         ins(b(6), b(6)), F32),
    Case("soft_margin_loss", lambda x: F.soft_margin_loss(x, pm_ones(6)), ins(b(6)), F32),
    Case("triplet_margin_loss", F.triplet_margin_loss, ins(b(4, 3), b(4, 3), b(4, 3)), F32),
    Case("multi_margin_loss", F.multi_margin_loss, ins(b(4, 5), zeros_long(4)), F32),
    Case("ctc_loss.IntList",
         lambda x: aten.ctc_loss.IntList(*ctc_inputs(x), [6, 6], [3, 3], 0, 1, False),
         ins(b(6, 2, 4)), F32),
    Case("ctc_loss.Tensor",
         lambda x: aten.ctc_loss.Tensor(*ctc_inputs(x), torch.tensor([6, 6]),
                                        torch.tensor([3, 3]), 0, 1, False),
         ins(b(6, 2, 4)), F32),
    Case("kl_div", lambda x, t: F.kl_div(x.log_softmax(-1), t, reduction="batchmean"),
         ins(b(4, 5), b(4, 5)), F32),
    Case("multilabel_margin_loss", F.multilabel_margin_loss,
         ins(b(3, 4), zeros_long(3, 4)), F32),
    Case("multilabel_margin_loss_forward",
         lambda x, t: aten.multilabel_margin_loss_forward.default(x, t, 1),
         ins(b(3, 4), zeros_long(3, 4)), F32),
    Case("binary_cross_entropy_with_logits", F.binary_cross_entropy_with_logits,
         ins(b(6), b(6)), F32),
    Case("fft_fft", torch.fft.fft, ins(b(8)), C64),
    Case("fft_ifft", torch.fft.ifft, ins(b(8)), C64),
    Case("fft_fft2", torch.fft.fft2, ins(b(4, 4)), C64),
    Case("fft_ifft2", torch.fft.ifft2, ins(b(4, 4)), C64),
    Case("fft_fftn", torch.fft.fftn, ins(b(2, 4, 4)), C64),
    Case("fft_ifftn", torch.fft.ifftn, ins(b(2, 4, 4)), C64),
    Case("fft_rfft", torch.fft.rfft, ins(b(8)), C64),
    Case("fft_irfft", torch.fft.irfft, ins(b(8)), F32),
    Case("fft_rfft2", torch.fft.rfft2, ins(b(4, 4)), C64),
    Case("fft_irfft2", torch.fft.irfft2, ins(b(4, 4)), F32),
    Case("fft_rfftn", torch.fft.rfftn, ins(b(2, 4, 4)), C64),
    Case("fft_irfftn", torch.fft.irfftn, ins(b(2, 4, 4)), F32),
    Case("fft_hfft", torch.fft.hfft, ins(b(8)), F32),
    Case("fft_ihfft", torch.fft.ihfft, ins(b(8)), C64),
    Case("linalg_cond", lambda x: torch.linalg.cond(dominant(x)), ins(b(4, 4)), F32),
    Case("linalg_cond.p_str", lambda x: torch.linalg.cond(dominant(x), "fro"),
         ins(b(4, 4)), F32),
    Case("linalg_matrix_rank",
         lambda x: aten.linalg_matrix_rank.default(dominant(x), 1e-3, False),
         ins(b(4, 4)), I64),
    Case("linalg_matrix_rank.tol_tensor",
         lambda x, tol: aten.linalg_matrix_rank.tol_tensor(dominant(x), tol * 1e-3, False),
         ins(b(4, 4), b()), I64),
    Case("linalg_matrix_rank.atol_rtol_tensor",
         lambda x, tol: aten.linalg_matrix_rank.atol_rtol_tensor(dominant(x), atol=tol * 1e-3),
         ins(b(4, 4), b()), I64),
    Case("linalg_matrix_rank.atol_rtol_float",
         lambda x: aten.linalg_matrix_rank.atol_rtol_float(dominant(x), atol=1e-3),
         ins(b(4, 4)), I64),
    Case("linalg_solve", lambda x, rhs: torch.linalg.solve(dominant(x), rhs),
         ins(b(4, 4), b(4, 2)), F32),
    Case("linalg_cholesky", lambda x: torch.linalg.cholesky(spd(x)), ins(b(4, 4)), F32),
    Case("linalg_svdvals", torch.linalg.svdvals, ins(b(4, 3)), F32),
    Case("linalg_eigvals", lambda x: torch.linalg.eigvals(dominant(x)), ins(b(4, 4)), C64),
    Case("linalg_eigvalsh", lambda x: torch.linalg.eigvalsh(spd(x)), ins(b(4, 4)), F32),
    # new in 2.14 (torch.linalg.matrix_sqrth: square root of an SPD matrix)
    Case("linalg_matrix_sqrth", lambda x: torch.linalg.matrix_sqrth(spd(x)), ins(b(4, 4)), F32),
    Case("linalg_inv", lambda x: torch.linalg.inv(dominant(x)), ins(b(4, 4)), F32),
    Case("linalg_householder_product", torch.linalg.householder_product,
         ins(b(4, 3), b(3)), F32),
    Case("linalg_tensorinv",
         lambda x: torch.linalg.tensorinv(dominant(x).reshape(4, 2, 2), ind=1),
         ins(b(4, 4)), F32),
    Case("linalg_tensorsolve",
         lambda x, rhs: torch.linalg.tensorsolve(dominant(x).reshape(2, 3, 6), rhs),
         ins(b(6, 6), b(2, 3)), F32),
    Case("fake_quantize_per_tensor_affine",
         lambda x: torch.fake_quantize_per_tensor_affine(x, 0.1, 0, 0, 255), ins(b(6)), F32),
    Case("geqrf", torch.geqrf, ins(b(4, 3)), F32),
    Case("_lu_with_info", lambda x: aten._lu_with_info.default(dominant(x)), ins(b(4, 4)), F32),
    Case("qr", lambda x: aten.qr.default(x), ins(b(4, 3)), F32),
    Case("svd", lambda x: aten.svd.default(x), ins(b(4, 3)), F32),
    Case("triangular_solve", lambda rhs, x: torch.triangular_solve(rhs, lower_tri(x),
                                                                   upper=False),
         ins(b(4, 2), b(4, 4)), F32),
    Case("fractional_max_pool2d",
         lambda x, s: aten.fractional_max_pool2d.default(x, [2, 2], [2, 2], s),
         ins(b(1, 2, 5, 5), b(1, 2, 2)), F32),
    Case("fractional_max_pool3d",
         lambda x, s: aten.fractional_max_pool3d.default(x, [2, 2, 2], [2, 2, 2], s),
         ins(b(1, 2, 5, 5, 5), b(1, 2, 3)), F32),
    Case("adaptive_max_pool3d", lambda x: F.adaptive_max_pool3d(x, 2),
         ins(b(1, 1, 4, 4, 4)), F32),
    Case("linalg_qr", torch.linalg.qr, ins(b(4, 3)), F32),
    Case("linalg_cholesky_ex", lambda x: torch.linalg.cholesky_ex(spd(x)), ins(b(4, 4)), F32),
    Case("linalg_svd", torch.linalg.svd, ins(b(4, 3)), F32),
    Case("linalg_eig", lambda x: torch.linalg.eig(dominant(x)), ins(b(4, 4)), C64),
    Case("linalg_eigh", lambda x: torch.linalg.eigh(spd(x)), ins(b(4, 4)), F32),
    Case("linalg_lstsq", lambda x, rhs: torch.linalg.lstsq(dominant(x), rhs),
         ins(b(4, 4), b(4, 2)), F32),
    Case("linalg_inv_ex", lambda x: torch.linalg.inv_ex(dominant(x)), ins(b(4, 4)), F32),
]

PROMOTE = [  # mixed bfloat16 / float32 in, the widest out
    Case("stack", lambda x, y: torch.stack([x, y]), ins(b(3), r(3)), F32),
    Case("cat", lambda x, y: torch.cat([x, y]), ins(b(3), r(3)), F32),
    Case("index_copy", lambda x, src: x.index_copy(0, torch.arange(2), src),
         ins(b(4, 3), r(2, 3)), F32),
    # named-tensor overload (registered up to 2.12); aten's kernel raises
    # for every call (measured on 2.7.0, 2.9.1, 2.11.0)
    Case("index_copy.dimname",
         lambda x, src: x.refine_names("A", "B").index_copy(
             "A", torch.arange(2), src.refine_names("A", "B")),
         ins(b(4, 3), r(2, 3)), F32,
         unrunnable="passed a dimname (string) to this op in place of a dimension index"),
]

CASES = {c.op: c for c in LOWER + FP32 + PROMOTE}

#: why torch.export refuses an op, by the type of the exception it raises (or of
#: its cause), as ctxreplay's reason code; an exception type not listed here
#: is a new kind of refusal: the test fails until it is classified
TORCH_REFUSALS: dict[str, str] = {
    # the output shape depends on input values (ctc_loss, lstsq): fake
    # tensors cannot know it
    "DynamicOutputShapeException": "data_dependent_output_shape",
    # a value read during tracing (quantile's checks up to 2.11): a guard on
    # data-dependent state
    "DataDependentOutputException": "data_dependent_control_flow",
    "GuardOnDataDependentSymNode": "data_dependent_control_flow",
    # no fake (meta) kernel: tracing runs the CPU kernel on a data-less fake
    # tensor, which raises a plain RuntimeError (_grid_sampler_2d_cpu_fallback
    # up to 2.13); a subclass of RuntimeError is not matched by this entry
    "RuntimeError": "trace_error",
    # fake tensors do not support named tensors (the Dimname overloads, up
    # to 2.12)
    "UnsupportedFakeTensorException": "unsupported_graph",
}


def _registered() -> set[str]:
    return {n.removeprefix("aten::")
            for n in torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCPU")}


REGISTERED = _registered()


def test_every_autocast_cpu_op_has_a_case() -> None:
    missing = sorted(REGISTERED - set(CASES))
    assert not missing, f"torch autocasts these CPU ops; add a case for each: {missing}"


class OpModule(nn.Module):
    def __init__(self, fn: Callable[..., Any], inner: nn.Module | None) -> None:
        super().__init__()
        self.fn = fn
        self.inner = inner

    def forward(self, *inputs: torch.Tensor) -> Any:
        if self.inner is not None:
            return self.fn(self.inner, *inputs)
        return self.fn(*inputs)


def _leaf_dtypes(value: Any) -> list[torch.dtype]:
    spec = ctxreplay.specs.signature.spec_of(value)
    return [s.dtype for s in flat_tensor_spec(spec).items]  # type: ignore[union-attr]


@attrs.frozen
class TorchExport:
    """What torch alone makes of a case: refused (``reason``) or a program
    whose output metadata and outputs disagree with the live call in
    ``differences`` (``(level, field)`` pairs, empty when it agrees)."""

    reason: str | None
    exc_type: str
    differences: frozenset[tuple[str, str]]


class EmbeddedOpModule(OpModule):
    """The op with CPU bfloat16 autocast entered inside ``forward`` (DESIGN.md
    fact 3): what ctxreplay's embedded replay makes torch trace, without ctxreplay."""

    def forward(self, *inputs: torch.Tensor) -> Any:
        ctx = torch.autocast("cpu", dtype=BF16)
        ctx.__enter__()
        try:
            out = super().forward(*inputs)
        except BaseException:
            # not __exit__(*exc_info): during export on torch 2.7-2.8 it returns
            # a truthy value and would swallow torch's own error
            # (CAPS.autocast_exit_swallows_errors)
            ctx.__exit__(None, None, None)
            raise
        ctx.__exit__(None, None, None)
        return out


def _refusal(exc: BaseException) -> str:
    chain: list[str] = []
    cur: BaseException | None = exc
    while cur is not None and len(chain) < 8:
        for cls in type(cur).__mro__:
            # RuntimeError only as itself: most of torch's errors derive from it
            if cls.__name__ in TORCH_REFUSALS and (cls is not RuntimeError
                                                   or type(cur) is RuntimeError):
                return TORCH_REFUSALS[cls.__name__]
        chain.append(f"{type(cur).__module__}.{type(cur).__qualname__}")
        cur = cur.__cause__ or cur.__context__
    pytest.fail(f"torch.export refused the case with {chain} (torch {torch.__version__}): "
                f"an unclassified refusal; add its type to TORCH_REFUSALS with the reason")


def _fields(live: Any, other: Any) -> set[str]:
    """The fields in which two flat output specs differ, as ctxreplay's
    ``compare_specs`` names them: dtype, shape (an int against an int; a
    symbolic size matches any), device type, or the structure."""
    a, b = flat_tensor_spec(live).items, flat_tensor_spec(other).items
    if len(a) != len(b):
        return {"structure"}
    out = set()
    for x, y in zip(a, b):
        if x.dtype != y.dtype:
            out.add("dtype")
        if len(x.shape) != len(y.shape) or any(
                type(i) is int and type(j) is int and i != j for i, j in zip(x.shape, y.shape)):
            out.add("shape")
        if torch.device(x.device).type != torch.device(y.device).type:
            out.add("device")
    return out


def _torch_export(case: Case, live: Any) -> TorchExport:
    torch.manual_seed(0)
    module = EmbeddedOpModule(case.fn, case.make() if case.make is not None else None)
    try:
        ep = torch.export.export(module, case.inputs(), strict=False)
    except Exception as exc:
        return TorchExport(_refusal(exc), type(exc).__name__, frozenset())
    gm = ep.graph_module
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    user = [a for a, s in zip(out.args[0], ep.graph_signature.output_specs)
            if s.kind.name == "USER_OUTPUT"]
    graph = ctxreplay.specs.signature.spec_of(
        [a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in user])
    differences = {("signature", f) for f in _fields(live, graph)}
    assert not torch.is_autocast_enabled("cpu")
    try:
        executed = ctxreplay.specs.signature.spec_of(ep.module()(*case.inputs()))
    except Exception:
        differences.add(("execute", "ran"))
    else:
        differences |= {("execute", f) for f in _fields(live, executed)}
    return TorchExport(None, "", frozenset(differences))


def _leaf_specs(value: Any) -> Any:
    return flat_tensor_spec(ctxreplay.specs.signature.spec_of(value))


def _mark_what_torch_cannot_run_here(case: Case, request: pytest.FixtureRequest) -> None:
    """Run the op live under autocast without ctxreplay: where torch alone
    cannot on this CPU, the case is that torch limit (a strict xfail) -- but
    only where the case says what it needs; an op no case expected to depend
    on the CPU fails, to be measured."""
    if case.unrunnable is not None:
        return
    torch.manual_seed(0)
    module = OpModule(case.fn, case.make() if case.make is not None else None)

    def live() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            module(*case.inputs())

    error = refusal(live)
    if error is None:
        return
    if case.needs is None:
        pytest.fail(f"{case.op}: torch alone cannot run it on this CPU ({cpu_description()}): "
                    f"{error}; measure what it needs and record it as the case's needs=")
    request.applymarker(torch_limit(error, case.needs))


@pytest.mark.parametrize("op", sorted(set(CASES) & REGISTERED))
def test_op_is_captured_in_its_autocast_dtype(op: str, request: pytest.FixtureRequest) -> None:
    case = CASES[op]
    _mark_what_torch_cannot_run_here(case, request)
    torch.manual_seed(0)
    module = OpModule(case.fn, case.make() if case.make is not None else None)
    inputs = case.inputs()
    if case.unrunnable is not None:  # nothing runs live, so nothing to capture
        with torch.autocast("cpu", dtype=torch.bfloat16), \
                pytest.raises(RuntimeError, match=re.escape(case.unrunnable)):
            module(*inputs)
        return
    with ctxreplay.capture_with(module, backend="export", verify="execute") as session, \
            torch.autocast("cpu", dtype=torch.bfloat16):
        out = module(*inputs)
        live_spec = _leaf_specs(out)
    live = _leaf_dtypes(out)
    del out
    assert live[0] == case.expect, f"{op}: the case itself is wrong ({live[0]} live)"
    report = session.finalize()
    expected = _torch_export(case, live_spec)

    if expected.reason is not None:  # torch refuses it: ctxreplay says why
        assert not report.captures, f"{op}: torch.export refuses it ({expected.exc_type})"
        (failure,) = report.failures
        assert (failure.reason, failure.exc_type) == (expected.reason, expected.exc_type), \
            failure
        return
    assert not report.failures, report.failures
    (c,) = report.captures
    assert c.fidelity.checked == ("signature", "execute")
    assert c.graph_outputs is not None
    graph = [s.dtype for s in flat_tensor_spec(c.graph_outputs).items]  # type: ignore[union-attr]
    found = {(m.level, m.field) for m in c.fidelity.mismatches}
    assert found == expected.differences, \
        f"{op}: ctxreplay found {sorted(found)}, torch.export alone {sorted(expected.differences)}"
    if expected.differences:  # torch's program disagrees with the live call
        assert not c.fidelity.ok and not report.ok
        if ("signature", "dtype") in expected.differences:
            assert graph != live
        return
    assert c.fidelity.ok, c.fidelity.mismatches
    assert graph == live
    # the artifact on its own, outside autocast, on fresh inputs
    assert not torch.is_autocast_enabled("cpu")
    executed = _leaf_dtypes(c.artifact.module()(*case.inputs()))
    assert executed == live
