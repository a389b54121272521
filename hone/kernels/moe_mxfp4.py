"""Routed experts with LoRA over a frozen MXFP4 base: the grouped GEMMs decode MXFP4 tiles in registers.

The same grouped kernel as the bf16 path (:func:`hone.kernels.moe_lora_triton.grouped_mm_kernel`,
sorted rows, per-expert ``ends`` on the device, no host sync) with ``W_MXFP4`` on: its weight
tile is loaded as packed bytes and E8M0 scales (:mod:`hone.kernels.mxfp4_dequant`'s layout,
``blocks [E, out, in / 32, 16]``, ``scales [E, out, in / 32]``, gpt-oss' checkpoint layout) and
decoded to float32 in registers (each value exact: two significant bits times a power of two),
then cast to the compute dtype (bf16 on Hopper, which has no FP4 tensor cores; exact too). The
weight in bf16 never exists in memory.

:func:`moe_mxfp4_linear` is the ``torch.library`` op ``hone::moe_mxfp4_lora_linear`` with a fake
implementation and an autograd formula; per expert ``e``, on its sorted rows,

    y  = x W_e^T (+ bias_e) + s (x A_e^T) B_e^T          (one launch for ``xa = x A^T``, one for y)
    dX = dY W_e + (s dY B_e) A_e                          (``dY W_e``: the W tile read along ``in``)
    dA = (s dY B)_e^T x_e,  dB = s dY_e^T xa_e,  dbias_e = sum of dY_e

The base is frozen: there is no ``dW``. ``dA`` / ``dB`` (and the rank-r intermediates they use)
are the bf16 path's own launches (:func:`hone.kernels.moe_lora.grouped_mm` /
:func:`~hone.kernels.moe_lora.grouped_wgrad`) on the same inputs and never read ``W``, so they
are bit for bit what :func:`hone.kernels.moe_lora.moe_lora_linear` computes on the dequantized
weight. :func:`moe_mxfp4_experts` is :func:`hone.kernels.moe_lora.moe_experts` with both
projections in MXFP4; :mod:`hone.kernels.moe_mxfp4_reference` is the plain-PyTorch yardstick.
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import register_flop_formula

from hone.kernels.moe_lora import (
    MxWeight,
    combine,
    grouped_mm,
    mm_launch,
    moe_triton_available,
    projection_backward,
    projection_flops,
    route,
)
from hone.kernels.moe_lora_reference import ExpertsLayout, LoraFactors, gated_activation
from hone.kernels.moe_lora_triton import grouped_mm_kernel
from hone.kernels.mxfp4_dequant import MXFP4_BLOCK, MXFP4_BLOCK_BYTES, check_mxfp4

__all__ = ["MxExperts", "moe_mxfp4_experts", "moe_mxfp4_linear"]

#: An MXFP4 expert projection: ``(blocks [E, out, in / 32, 16], scales [E, out, in / 32])``.
MxExperts = tuple[torch.Tensor, torch.Tensor]


def _mx_weight(blocks: torch.Tensor, scales: torch.Tensor, k_is_in: bool) -> MxWeight:
    """The launch's view of the weight: contiguous bytes ``[E, out, in / 2]`` and contiguous scales."""
    blocks = blocks.contiguous()
    return MxWeight(blocks.view(blocks.shape[0], blocks.shape[1], -1), scales.contiguous(), k_is_in)


@torch.library.custom_op("hone::moe_mxfp4_grouped_mm", mutates_args=())
def mxfp4_grouped_mm(
    x: torch.Tensor,
    rows: torch.Tensor | None,
    ends: torch.Tensor,
    blocks: torch.Tensor,
    scales: torch.Tensor,
    k_is_in: bool,
    bias: torch.Tensor | None,
    xa: torch.Tensor | None,
    lora_b: torch.Tensor | None,
    scaling: float,
) -> torch.Tensor:
    """``y [S, N]`` in ``x``'s dtype: for the sorted rows of each expert ``e``, ``x[rows] W_e^T``
    (``k_is_in``: N = out) or ``x[rows] W_e`` (N = in), ``W`` the MXFP4 weight ``[E, out, in]``
    of ``blocks`` / ``scales``, ``(+ bias[e]) (+ scaling * xa @ lora_b[e].T)`` as
    :func:`hone.kernels.moe_lora.grouped_mm`. Rows outside ``0:ends[-1]`` are left unwritten."""
    if not moe_triton_available(x.device):
        raise RuntimeError(f"hone::moe_mxfp4_grouped_mm needs triton and a CUDA tensor (or TRITON_INTERPRET=1); got {x.device}")
    mx = _mx_weight(blocks, scales, k_is_in)
    num_experts, _, n_dim = mx.k_n()
    s = rows.shape[0] if rows is not None else x.shape[0]
    y = torch.empty(s, n_dim, dtype=x.dtype, device=x.device)
    if s == 0 or n_dim == 0:
        return y
    grid, args, kwargs = mm_launch(x, rows, ends, None, bias, xa, lora_b, scaling, y, s, mxfp4=mx)
    grouped_mm_kernel[grid](*args, **kwargs)
    return y


@mxfp4_grouped_mm.register_fake
def _(x, rows, ends, blocks, scales, k_is_in, bias, xa, lora_b, scaling):
    s = rows.shape[0] if rows is not None else x.shape[0]
    n_dim = blocks.shape[1] if k_is_in else blocks.shape[2] * MXFP4_BLOCK
    return x.new_empty(s, n_dim)


@torch.library.custom_op("hone::moe_mxfp4_lora_linear", mutates_args=())
def _moe_mxfp4_lora_linear(
    x: torch.Tensor,
    rows: torch.Tensor | None,
    ends: torch.Tensor,
    blocks: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None,
    lora_a: torch.Tensor | None,
    lora_b: torch.Tensor | None,
    scaling: float,
    readers: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y [S, out], xa [S, r] or empty): see :func:`moe_mxfp4_linear`; ``xa`` is kept for ``dB``."""
    if lora_a is None or lora_b is None:
        return mxfp4_grouped_mm(x, rows, ends, blocks, scales, True, bias, None, None, 0.0), x.new_empty(0)
    xa = grouped_mm(x, rows, ends, lora_a.transpose(1, 2), None, None, None, 0.0)
    return mxfp4_grouped_mm(x, rows, ends, blocks, scales, True, bias, xa, lora_b, scaling), xa


@_moe_mxfp4_lora_linear.register_fake
def _(x, rows, ends, blocks, scales, bias, lora_a, lora_b, scaling, readers):
    s = rows.shape[0] if rows is not None else x.shape[0]
    xa = x.new_empty(s, lora_a.shape[1]) if lora_a is not None and lora_b is not None else x.new_empty(0)
    return x.new_empty(s, blocks.shape[1]), xa


def _setup_context(ctx, inputs, output) -> None:
    x, rows, ends, blocks, scales, bias, lora_a, lora_b, scaling, readers = inputs
    _, xa = output
    ctx.scaling = scaling
    ctx.x_shape = x.shape
    ctx.has_rows = rows is not None
    ctx.has_bias = bias is not None
    ctx.has_lora = lora_a is not None and lora_b is not None
    ctx.mark_non_differentiable(xa)
    ctx.save_for_backward(x, rows, ends, blocks, scales, bias, lora_a, lora_b, xa, readers)


def _backward(ctx, grad_y, _grad_xa):
    x, rows, ends, blocks, scales, bias, lora_a, lora_b, xa, readers = ctx.saved_tensors
    dy = grad_y.contiguous()

    def input_grad(dxa, a_t):  # dY W_e: the MXFP4 tile read along ``in``
        return mxfp4_grouped_mm(dy, None, ends, blocks, scales, False, None, dxa, a_t, 1.0)

    bias_dtype = bias.dtype if bias is not None else dy.dtype
    d_x, d_a, d_b, d_bias = projection_backward(ctx, dy, x, rows, ends, lora_a, lora_b, xa, bias_dtype, input_grad, readers)
    return d_x, None, None, None, None, d_bias, d_a, d_b, None, None


_moe_mxfp4_lora_linear.register_autograd(_backward, setup_context=_setup_context)


@register_flop_formula(torch.ops.hone.moe_mxfp4_lora_linear)
def _moe_mxfp4_lora_linear_flops(x, rows, ends, blocks, scales, bias, lora_a, lora_b, scaling, readers, **kwargs) -> int:
    """The op's FLOPs for the compiler's recompute planner (see :func:`hone.kernels.moe_lora.projection_flops`):
    ``blocks`` is ``[E, out, ...]``, the input width ``x``'s."""
    n_rows = rows[0] if rows is not None else x[0]
    rank = lora_a[1] if lora_a is not None and lora_b is not None else 0
    return projection_flops(n_rows, x[-1], blocks[1], rank)


def check_mxfp4_experts(blocks: torch.Tensor, scales: torch.Tensor, in_dim: int, name: str = "MXFP4 experts") -> None:
    """Refuse an MXFP4 expert weight that is not ``[E, out, in / 32, 16]`` bytes with matching
    scales and ``in`` inputs, naming both shapes."""
    check_mxfp4(blocks, scales)
    if blocks.dim() != 4 or blocks.shape[2] * MXFP4_BLOCK != in_dim:
        raise ValueError(
            f"{name}: blocks {tuple(blocks.shape)} must be [experts, out, in / {MXFP4_BLOCK}, {MXFP4_BLOCK_BYTES}] "
            f"for inputs of width {in_dim} (so [E, out, {in_dim / MXFP4_BLOCK:g}, {MXFP4_BLOCK_BYTES}])"
        )


def moe_mxfp4_linear(
    x: torch.Tensor,
    rows: torch.Tensor | None,
    ends: torch.Tensor,
    weight: MxExperts,
    bias: torch.Tensor | None = None,
    lora: LoraFactors | None = None,
    scaling: float = 1.0,
    dtype: torch.dtype | None = None,
    readers: torch.Tensor | None = None,
) -> torch.Tensor:
    """One MXFP4 expert projection for rows sorted by expert: ``y [S, out]`` with, for the rows of
    expert ``e``, ``y = x[rows] W_e^T (+ bias_e) + s (x[rows] A_e^T) B_e^T``, ``W`` the
    ``[E, out, in]`` weight of ``weight = (blocks, scales)`` (frozen), ``lora = (A [E, r, in],
    B [E, out, r])``. Computes in ``dtype`` (default ``x``'s): every floating input is cast to it
    first, differentiably. Differentiable w.r.t. ``x``, ``bias`` and both factors. ``readers``:
    as :func:`hone.kernels.moe_lora.moe_lora_linear`'s."""
    blocks, scales = weight
    check_mxfp4_experts(blocks, scales, x.shape[-1])
    dtype = dtype or x.dtype
    lora_a = lora_b = None
    if lora is not None:
        lora_a, lora_b = lora[0].to(dtype), lora[1].to(dtype)
    bias = None if bias is None else bias.to(dtype)
    y, _ = _moe_mxfp4_lora_linear(x.to(dtype), rows, ends, blocks, scales, bias, lora_a, lora_b, float(scaling), readers)
    return y


def moe_mxfp4_experts(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up: MxExperts,
    down: MxExperts,
    layout: ExpertsLayout,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    gate_up_lora: LoraFactors | None = None,
    down_lora: LoraFactors | None = None,
    scaling: float = 1.0,
    down_scaling: float | None = None,
) -> torch.Tensor:
    """Routed experts ``[T, H]`` over MXFP4 expert weights (both ``[E, out, in]`` as blocks and
    scales, whatever ``layout.transposed`` says of the bf16 parameters: the checkpoint stores
    them so), computing in ``hidden``'s dtype; otherwise :func:`hone.kernels.moe_lora.moe_experts`
    (``layout``'s gate/up split and activation, biases, LoRA)."""
    k = top_k_index.shape[1]
    perm, ends = route(top_k_index, gate_up[0].shape[0])
    gu = moe_mxfp4_linear(hidden, perm // k, ends, gate_up, gate_up_bias, gate_up_lora, scaling)
    h = gated_activation(gu, layout)
    y = moe_mxfp4_linear(h, None, ends, down, down_bias, down_lora, scaling if down_scaling is None else down_scaling)
    return combine(y, perm, top_k_weights).to(hidden.dtype)
