"""A frozen linear layer and its LoRA in one autograd function, the LoRA product accumulated into
the base's output by the matmul that computes it.

PEFT's ``lora.Linear`` computes ``base(x) + lora_B(lora_A(x)) * s``: the base matmul writes its
``[tokens, out]`` output, the LoRA ``B`` matmul writes another ``[tokens, out]`` tensor, the
scaling and the sum read both and write a third; the backward does the same with the input
gradient (``dY @ W`` plus ``(dY @ B) @ A * s``) and multiplies the output-wide gradient by ``s``.
At rank 16 those matmuls are bound by memory: on a llama3-8b layer at 8K tokens LoRA costs ~2.4
ms beside a 10.5 ms bf16 base and a 6.5 ms float8 one (benchmarks/2026-11-29-h200-fp8.md).

Here, with the same numbers up to the dtype's rounding:

- the scaling multiplies the rank-wide ``[tokens, r]`` tensors, never an output-wide one
  (``((x @ A.T) * s) @ B.T``; its gradient ``(dY @ B) * s``);
- the ``B`` product is added into the base's output by cuBLAS's ``beta = 1`` epilogue, and the
  ``A`` product of the backward into the base's input gradient the same way: the LoRA output
  and the LoRA input gradient are never written. The accumulation happens in float32 inside the
  matmul, so the sum is rounded once, where PEFT rounds the LoRA output, its scaling and the sum.

The base matmul and the accumulating one are **one** ``torch.library`` custom op, functional
(:func:`mm_lora` for a bf16 weight, :func:`scaled_mm_lora` for a float8 one): inside it the
second matmul runs in place (``addmm_``) on the output the first just allocated. Two things
rule out the obvious alternatives. ``torch.addmm`` into a new tensor first copies its addend
into it (measured slower than PEFT's separate sum on a float8 base). And an in-place op visible
to the compiler lets Inductor's memory-budget partitioner keep the base's output for the
backward and recompute only the cheap LoRA sum, which costs a copy of every such output before
the sum can run in place (seen at a 0.4 budget: the whole step no faster than PEFT's). As one
opaque op with a FLOP formula, the pair is saved or recomputed whole, like a matmul. The rest
(the rank-wide matmuls, the casts, the float8 quantization of :mod:`hone.kernels.fp8_linear`)
is plain PyTorch that Dynamo traces and Inductor fuses, as there.

The base is a bf16 (or float32) weight with an optional bias, or a frozen float8 weight
(:class:`~hone.kernels.fp8_linear.FrozenFp8Weight`, with the float8 layer's matmul precision).
The LoRA factors may be float32 (hone creates them so): the matmuls run in the compute dtype
(autocast's where it is on, as PEFT's layers under autocast), gradients return in each factor's
own dtype. :func:`lora_linear_reference` is PEFT's arithmetic on the same operands.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import register_flop_formula

from hone.kernels.fp8_linear import FrozenFp8Weight, float8_mm, float8_operands, fp8_linear_reference

__all__ = ["lora_linear", "lora_linear_reference", "mm_lora", "scaled_mm_lora"]


@torch.library.custom_op("hone::mm_lora", mutates_args=())
def mm_lora(
    a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, lora_in: torch.Tensor, lora_out: torch.Tensor
) -> torch.Tensor:
    """``a @ b + bias + lora_in @ lora_out``: the second matmul accumulates into the first's
    output in place (cuBLAS ``beta = 1``), which this op allocated itself."""
    out = torch.mm(a, b) if bias is None else torch.addmm(bias, a, b)
    return out.addmm_(lora_in, lora_out)


@mm_lora.register_fake
def _(a, b, bias, lora_in, lora_out):
    return a.new_empty(a.shape[0], b.shape[1])


@torch.library.custom_op("hone::scaled_mm_lora", mutates_args=())
def scaled_mm_lora(
    a_q: torch.Tensor,
    scale_a: torch.Tensor,
    b_q: torch.Tensor,
    scale_b: torch.Tensor,
    lora_in: torch.Tensor,
    lora_out: torch.Tensor,
    out_dtype: torch.dtype,
    fast_accum: bool,
) -> torch.Tensor:
    """``torch._scaled_mm(a_q, b_q, ...) + lora_in @ lora_out``, the sum in the second matmul's epilogue."""
    out = torch._scaled_mm(a_q, b_q, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype, use_fast_accum=fast_accum)
    return out.addmm_(lora_in, lora_out)


@scaled_mm_lora.register_fake
def _(a_q, scale_a, b_q, scale_b, lora_in, lora_out, out_dtype, fast_accum):
    return a_q.new_empty(a_q.shape[0], b_q.shape[1], dtype=out_dtype)


def _mm_lora_flops(rows: int, k_in: int, n_out: int, rank: int) -> int:
    return 2 * rows * n_out * (k_in + rank)


# Without formulas torch's flop counter counts an opaque op as 0, and Inductor's memory-budget
# partitioner, which weighs what to recompute by counted FLOPs, would take these matmuls for free
# (hone.transforms.checkpointing.memory_budget_context).
@register_flop_formula(torch.ops.hone.mm_lora)
def _(a, b, bias, lora_in, lora_out, *args, **kwargs) -> int:
    return _mm_lora_flops(a[0], a[1], b[1], lora_in[1])


@register_flop_formula(torch.ops.hone.scaled_mm_lora)
def _(a_q, scale_a, b_q, scale_b, lora_in, lora_out, *args, **kwargs) -> int:
    return _mm_lora_flops(a_q[0], a_q[1], b_q[1], lora_in[1])


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the matmuls run in: autocast's where it is on (what ``F.linear`` would use), else ``x``'s."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def _base_plus_lora(
    x2: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    lora_in: torch.Tensor | None,
    lora_out: torch.Tensor | None,
    fast_accum: bool,
) -> torch.Tensor:
    """``x2 @ W.T + bias + lora_in @ lora_out`` with ``W`` in bf16 (``weight`` given, ``[N, K]``)
    or float8 (``w_q`` ``[N, K]`` row-major); the float8 quantization of ``x2`` stays traced, as
    in :func:`~hone.kernels.fp8_linear.float8_mm`. Without ``lora_in``: the base alone."""
    if weight is not None:
        w, b = weight.to(x2.dtype).t(), None if bias is None else bias.to(x2.dtype)
        if lora_in is None:
            return x2 @ w if b is None else torch.addmm(b, x2, w)
        return mm_lora(x2, w, b, lora_in, lora_out)
    if lora_in is None:
        out = float8_mm(x2, w_q, w_scale, fast_accum)
    else:
        a_q, scale_a, scale_b = float8_operands(x2, w_scale)
        out = scaled_mm_lora(a_q, scale_a, w_q.t(), scale_b, lora_in, lora_out, x2.dtype, fast_accum)
    return out if bias is None else out + bias.to(out.dtype)


class _LoraLinear(torch.autograd.Function):
    """Differentiable in ``x``, ``x_lora`` (LoRA's own input, where dropout made one), ``lora_a``
    and ``lora_b``; the base (weight, bias, float8 copies) is frozen. Saves LoRA's input and the
    rank-wide ``(x @ A.T) * s`` (what PEFT's layers save: the input for ``A``'s gradient,
    ``x @ A.T`` for ``B``'s), and nothing of the base's."""

    @staticmethod
    def forward(ctx, x, x_lora, lora_a, lora_b, scaling, weight, bias, w_q, w_scale, wt_q, wt_scale):
        dtype = _compute_dtype(x)
        with torch.autocast(x.device.type, enabled=False):
            x2 = x.reshape(-1, x.shape[-1]).to(dtype)
            lora_in = x2 if x_lora is None else x_lora.reshape(-1, x_lora.shape[-1]).to(dtype)
            a, b = lora_a.to(dtype), lora_b.to(dtype)
            hs = (lora_in @ a.t()) * scaling
            out = _base_plus_lora(x2, weight, bias, w_q, w_scale, hs, b.t(), fast_accum=True)
        ctx.save_for_backward(lora_in, hs, a, b, weight, wt_q, wt_scale)
        ctx.scaling = scaling
        ctx.separate = x_lora is not None
        ctx.dtypes = (x.dtype, None if x_lora is None else x_lora.dtype, lora_a.dtype, lora_b.dtype)
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        lora_in, hs, a, b, weight, wt_q, wt_scale = ctx.saved_tensors
        x_dtype, x_lora_dtype, a_dtype, b_dtype = ctx.dtypes
        lead = dy.shape[:-1]
        dy2 = dy.reshape(-1, dy.shape[-1]).to(lora_in.dtype)
        g = (dy2 @ b) * ctx.scaling
        dx = dx_lora = None
        if ctx.needs_input_grad[0]:
            # dX = dY @ W (+ g @ A where LoRA's input is x: into the base's, in the epilogue)
            lora = (None, None) if ctx.separate else (g, a)
            base_t = None if weight is None else weight.t()  # dY @ W = dY @ (W.T).T
            dx = _base_plus_lora(dy2, base_t, None, wt_q, wt_scale, *lora, fast_accum=False)
            dx = dx.to(x_dtype).view(*lead, dx.shape[-1])
        if ctx.separate and ctx.needs_input_grad[1]:
            dx_lora = (g @ a).to(x_lora_dtype).view(*lead, a.shape[-1])
        da = (g.t() @ lora_in).to(a_dtype) if ctx.needs_input_grad[2] else None
        db = (dy2.t() @ hs).to(b_dtype) if ctx.needs_input_grad[3] else None
        return dx, dx_lora, da, db, None, None, None, None, None, None, None


def lora_linear(
    x: torch.Tensor,
    base: torch.Tensor | FrozenFp8Weight,
    bias: torch.Tensor | None,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: float,
    x_lora: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ W.T + bias + ((x @ A.T) * s) @ B.T`` with the LoRA product accumulated inside the
    base's matmul (forward) and input-gradient matmul (backward); see the module docstring.

    ``base`` is the frozen weight ``[out, in]`` or its float8 form; ``lora_a`` ``[r, in]`` and
    ``lora_b`` ``[out, r]`` are PEFT's ``lora_A`` / ``lora_B`` weights; ``scaling`` PEFT's
    ``alpha / r`` (or ``alpha / sqrt(r)``). ``x_lora``: LoRA's input where it is not ``x``
    (``dropout(x)``, which PEFT applies to the LoRA path only); its gradient then flows back
    through it rather than into the base's input gradient."""
    if isinstance(base, FrozenFp8Weight):
        return _LoraLinear.apply(x, x_lora, lora_a, lora_b, scaling, None, bias, base.w_q, base.w_scale, base.wt_q, base.wt_scale)
    return _LoraLinear.apply(x, x_lora, lora_a, lora_b, scaling, base, bias, None, None, None, None)


def lora_linear_reference(
    x: torch.Tensor,
    base: torch.Tensor | FrozenFp8Weight,
    bias: torch.Tensor | None,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: float,
    x_lora: torch.Tensor | None = None,
) -> torch.Tensor:
    """PEFT's arithmetic, ``base(x) + lora_B(lora_A(x)) * s``, with the base as hone's layers
    compute it (:func:`~hone.kernels.fp8_linear.fp8_linear_reference` for a float8 weight)."""
    if isinstance(base, FrozenFp8Weight):
        out = fp8_linear_reference(x, base)
        out = out if bias is None else out + bias.to(out.dtype)
    else:
        out = F.linear(x, base, bias)
    lora_in = x if x_lora is None else x_lora
    return out + F.linear(F.linear(lora_in.to(lora_a.dtype), lora_a), lora_b) * scaling
