"""MXFP4 routed experts, the obvious way: dequantize to float32, then the bf16 path's reference.

What :mod:`hone.kernels.moe_mxfp4` must equal. The weights are dequantized with
:func:`hone.kernels.mxfp4_dequant.mxfp4_dequantize_reference` (plain PyTorch) to their
``[E, out, in]`` layout and handed to :func:`hone.kernels.moe_lora_reference.moe_experts_reference`
as untransposed weights; the layout's gate/up split and activation stay the model's.
"""

from __future__ import annotations

import dataclasses

import torch

from hone.kernels.moe_lora_reference import ExpertsLayout, LoraFactors, moe_experts_reference
from hone.kernels.mxfp4_dequant import mxfp4_dequantize_reference

MxExperts = tuple[torch.Tensor, torch.Tensor]


def dequantized(weight: MxExperts, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The ``[E, out, in]`` weight of ``(blocks, scales)`` in ``dtype`` (float32: exact)."""
    return mxfp4_dequantize_reference(weight[0], weight[1], dtype)


def mxfp4_linear_reference(
    x: torch.Tensor,
    expert_of_row: torch.Tensor,
    weight: MxExperts,
    bias: torch.Tensor | None = None,
    lora: LoraFactors | None = None,
    scaling: float = 1.0,
) -> torch.Tensor:
    """One projection, row by row: ``y[i] = x[i] W_e^T (+ bias_e) + s (x[i] A_e^T) B_e^T`` with
    ``e = expert_of_row[i]``, in float32 on the dequantized weight (differentiable)."""
    w = dequantized(weight)[expert_of_row]  # [S, out, in]
    x = x.float()
    y = torch.einsum("si,soi->so", x, w)
    if bias is not None:
        y = y + bias.float()[expert_of_row]
    if lora is not None:
        a, b = lora[0].float()[expert_of_row], lora[1].float()[expert_of_row]
        y = y + scaling * torch.einsum("sor,sr->so", b, torch.einsum("sri,si->sr", a, x))
    return y


def moe_mxfp4_experts_reference(
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
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """:func:`hone.kernels.moe_mxfp4.moe_mxfp4_experts`'s result, through the float32 loop over experts."""
    return moe_experts_reference(
        hidden,
        top_k_index,
        top_k_weights,
        dequantized(gate_up),
        dequantized(down),
        dataclasses.replace(layout, transposed=False),
        gate_up_bias,
        down_bias,
        gate_up_lora,
        down_lora,
        scaling,
        down_scaling,
        compute_dtype,
    )
