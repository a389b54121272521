"""Routed experts with LoRA, the obvious way: a float32 loop over experts.

This is what :mod:`hone.kernels.moe_lora` (the grouped-GEMM Triton path) must equal. Each
routed token ``t`` with experts ``e_1..e_k`` and routing weights ``w_1..w_k`` gets

    out[t] = sum_j w_j * expert_{e_j}(x[t])
    expert_e(x) = down_e(act(gate_up_e(x)))
    proj_e(x)   = x W_e (+ bias_e) + s * (x A_e^T) B_e^T

where ``W_e`` is the expert's weight seen as ``[in, out]``, ``A_e`` is ``[r, in]``, ``B_e`` is
``[out, r]`` and ``s`` the LoRA scaling. Those factor shapes are PEFT's own per-expert view of
a ``target_parameters`` adapter (``ParamWrapper.get_delta_factors``: ``lora_A.weight`` viewed
as ``[E, r, in]``, ``lora_B.weight`` as ``[out, r, E]`` permuted to ``[E, out, r]``), so a saved
PEFT adapter maps onto them without copying.

Two weight layouts exist in transformers 5 (``ExpertsLayout``):

- qwen3_moe / olmoe / mixtral: ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``, i.e.
  ``[E, out, in]``; gate and up are the two halves of the ``2I`` outputs; SiLU(gate) * up.
- gpt_oss: ``gate_up_proj [E, H, 2I]`` and ``down_proj [E, I, H]`` (``[E, in, out]``,
  ``is_transposed``), gate and up *interleaved* (even columns gate, odd up), a bias per expert
  on both projections, and the clamped SwiGLU ``(clamp(up, -L, L) + 1) * g * sigmoid(alpha g)``
  with ``g = clamp(gate, max=L)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

Activation = Literal["silu", "clamped_swiglu"]

#: LoRA factors of one 3-D expert parameter: ``A [E, r, in]``, ``B [E, out, r]``.
LoraFactors = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class ExpertsLayout:
    """How an experts module stores its weights and gates them (see the module docstring)."""

    transposed: bool  # weights are [E, in, out] (gpt_oss) rather than [E, out, in]
    interleaved: bool  # gate/up columns alternate (gpt_oss) rather than being two halves
    activation: Activation = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0


QWEN3_MOE = ExpertsLayout(transposed=False, interleaved=False, activation="silu")
GPT_OSS = ExpertsLayout(transposed=True, interleaved=True, activation="clamped_swiglu")


def gated_activation(gate_up: torch.Tensor, layout: ExpertsLayout) -> torch.Tensor:
    """``[S, 2I] -> [S, I]``: split gate and up as the layout stores them and gate."""
    if layout.interleaved:
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    else:
        gate, up = gate_up.chunk(2, dim=-1)
    if layout.activation == "silu":
        return F.silu(gate) * up
    if layout.activation == "clamped_swiglu":
        gate = gate.clamp(max=layout.swiglu_limit)
        up = up.clamp(min=-layout.swiglu_limit, max=layout.swiglu_limit)
        return (up + 1) * (gate * torch.sigmoid(gate * layout.swiglu_alpha))
    raise ValueError(f"activation {layout.activation!r} is not one of: silu, clamped_swiglu")


def as_in_out(weight: torch.Tensor, transposed: bool) -> torch.Tensor:
    """The expert weights as ``[E, in, out]`` (a view)."""
    return weight if transposed else weight.transpose(1, 2)


def expert_projection(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    lora: LoraFactors | None,
    scaling: float,
) -> torch.Tensor:
    """``x [n, in] @ weight [in, out] (+ bias) + s (x A^T) B^T`` for one expert, in the inputs'
    dtype (the reference and expert parallelism's plain path pass float32)."""
    y = x @ weight
    if bias is not None:
        y = y + bias
    if lora is not None:
        a, b = lora
        y = y + scaling * ((x @ a.T) @ b.T)
    return y


def moe_experts_reference(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    layout: ExpertsLayout,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    gate_up_lora: LoraFactors | None = None,
    down_lora: LoraFactors | None = None,
    scaling: float = 1.0,
    down_scaling: float | None = None,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Routed experts output ``[T, H]`` for ``hidden [T, H]``, ``top_k_index / top_k_weights
    [T, k]``: every expert's tokens in one matmul chain in ``compute_dtype`` (float32: the
    yardstick; bfloat16: what plain PyTorch rounds, the GPU tests' measure of a fair bf16
    error), the weighted sum accumulated in float32 and returned in ``hidden``'s dtype.
    Differentiable w.r.t. every floating input; host syncs and per-expert loops are fine here.
    ``down_scaling`` is the down projection's LoRA scaling where it differs from ``scaling``."""
    if down_scaling is None:
        down_scaling = scaling
    dtype = hidden.dtype
    x = hidden.to(compute_dtype)
    w_gu = as_in_out(gate_up_proj, layout.transposed).to(compute_dtype)
    w_dn = as_in_out(down_proj, layout.transposed).to(compute_dtype)
    out = torch.zeros_like(x, dtype=torch.float32)
    num_experts = gate_up_proj.shape[0]
    for e in range(num_experts):
        token, slot = torch.nonzero(top_k_index == e, as_tuple=True)
        if token.numel() == 0:
            continue
        xe = x[token]
        cast = lambda t: None if t is None else t.to(compute_dtype)  # noqa: E731
        gu_lora = None if gate_up_lora is None else (cast(gate_up_lora[0][e]), cast(gate_up_lora[1][e]))
        dn_lora = None if down_lora is None else (cast(down_lora[0][e]), cast(down_lora[1][e]))
        gu_bias = None if gate_up_bias is None else cast(gate_up_bias[e])
        dn_bias = None if down_bias is None else cast(down_bias[e])
        h = gated_activation(expert_projection(xe, w_gu[e], gu_bias, gu_lora, scaling), layout)
        y = expert_projection(h, w_dn[e], dn_bias, dn_lora, down_scaling)
        out = out.index_add(0, token, y.float() * top_k_weights[token, slot].float().unsqueeze(1))
    return out.to(dtype)
