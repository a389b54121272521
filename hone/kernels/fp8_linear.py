"""A linear layer on a frozen float8 weight: ``y = x @ W.T`` with both operands in float8.

LoRA on a frozen base spends most of its time in the base's matmuls: per token the forward
``x @ W.T`` and the backward's input gradient ``dY @ W`` (no weight gradient: ``W`` is frozen).
On Hopper a float8 matmul (``torch._scaled_mm``) runs at about twice the bf16 rate. Because ``W``
never changes, it is quantized **once** (:func:`quantize_frozen_weight`), into the two layouts
the two matmuls need; only the activations (forward) and the output gradients (backward) are
quantized per call, with the current amax (no history, no delayed scaling).

Scaling modes (``mode``):

- ``"rowwise"``: one scale per row of the left operand and per output column of the right one.
  The forward's right operand is ``W`` ``[N, K]`` scaled per output row; the input gradient's is
  ``W.T`` ``[K, N]`` scaled per *input column* of ``W`` -- a different scaling of the same
  weight, hence two float8 copies (together the size of the bf16 weight).
- ``"tensorwise"``: one scale per tensor. The same quantized values serve both matmuls, but
  ``_scaled_mm`` wants its right operand column-major, so the transposed copy is kept too.

Every operand is ``float8_e4m3fn`` (with current scaling its 3 mantissa bits beat e5m2's range
on gradients; torchao's rowwise recipe makes the same choice). Scales are float32; the matmul
accumulates in float32 and writes the input's dtype.

The computation is plain PyTorch (the quantization, then ``torch._scaled_mm``, an ATen op with
a meta implementation) inside an autograd function, which ``torch.compile(fullgraph=True)``
traces without a graph break. That is deliberate, rather than one opaque ``torch.library``
custom op: traced, the per-call quantization (an amax reduction and a scaled cast) is fused by
Inductor into a couple of kernels, next to the op that produced the activation; inside an
opaque op it would be several eager passes over a float32 copy of the activation, a large share
of the time the float8 matmul saves at 8K tokens. :func:`fp8_linear_reference` is the same
arithmetic on dequantized operands in float32: what tests compare against.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

Mode = Literal["rowwise", "tensorwise"]
MODES: tuple[str, ...] = ("rowwise", "tensorwise")

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
# An all-zero row (or tensor) gets this amax: its scale stays finite and it quantizes to zeros.
_EPS = 1e-12
#: ``_scaled_mm`` needs both matmul dimensions of the weight to be multiples of 16.
ALIGN = 16


def quantize(t: torch.Tensor, mode: Mode) -> tuple[torch.Tensor, torch.Tensor]:
    """``(t_q, scale)`` with ``t ~= t_q.float() * scale``: per row (``[rows, 1]`` scales) for
    rowwise, one float32 scalar for tensorwise. ``t`` is 2-D, last dimension the reduction one."""
    t32 = t.float()
    if mode == "rowwise":
        amax = t32.abs().amax(dim=-1, keepdim=True)
    else:
        amax = t32.abs().amax()
    # The two constants are written out (they equal _EPS and FP8_MAX, which a test checks): under
    # dynamic shapes Dynamo traces a module-level float as a symbolic float, and one created while
    # it speculates the first autograd function of a graph cannot be used by the second
    # ("lift_tracked_freevar_to_input should not be called on root SubgraphTracer", torch 2.11-2.13).
    scale = amax.clamp(min=1e-12) / 448.0
    t_q = (t32 / scale).clamp(-448.0, 448.0).to(FP8)
    return t_q, scale


def dequantize(t_q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 values a quantized tensor stands for."""
    return t_q.float() * scale


@dataclass(frozen=True)
class FrozenFp8Weight:
    """A frozen weight ``W [N, K]`` in the two layouts its matmuls need (see the module docstring)."""

    w_q: torch.Tensor
    """``[N, K]`` row-major: the forward's right operand (``x @ W.T``)."""
    w_scale: torch.Tensor
    """``[N, 1]`` (rowwise: per output row) or a scalar."""
    wt_q: torch.Tensor
    """``[K, N]`` row-major, i.e. ``W`` column-major: the input gradient's right operand (``dY @ W``)."""
    wt_scale: torch.Tensor
    """``[K, 1]`` (rowwise: per input column of ``W``) or a scalar."""


def quantize_frozen_weight(weight: torch.Tensor, mode: Mode) -> FrozenFp8Weight:
    """Quantize a frozen ``[N, K]`` weight once, for the forward and for the input gradient."""
    if weight.dim() != 2 or weight.shape[0] % ALIGN or weight.shape[1] % ALIGN:
        raise ValueError(f"a float8 weight must be 2-D with both dimensions multiples of {ALIGN}, got {tuple(weight.shape)}")
    with torch.no_grad():
        w_q, w_scale = quantize(weight, mode)
        if mode == "rowwise":
            wt_q, wt_scale = quantize(weight.t(), mode)
            wt_q = wt_q.contiguous()
        else:  # the same values, transposed (the scale a separate tensor: autograd functions
            # under Dynamo take no tensor twice)
            wt_q, wt_scale = w_q.t().contiguous(), w_scale.clone()
    return FrozenFp8Weight(w_q, w_scale, wt_q, wt_scale)


# ---------------------------------------------------------------- reference


def fp8_linear_reference(x: torch.Tensor, weight: FrozenFp8Weight) -> torch.Tensor:
    """The forward on dequantized operands in float32, in ``x``'s dtype; differentiable in ``x``
    with the same quantized backward (``dY`` rounded per row, times the dequantized ``W``)."""
    return _ReferenceLinear.apply(x, weight.w_q, weight.w_scale, weight.wt_q, weight.wt_scale)


def _reference_mm(a: torch.Tensor, b_q: torch.Tensor, b_scale: torch.Tensor) -> torch.Tensor:
    """``a @ b.T`` with ``a`` quantized as :func:`fp8_frozen_linear` does (mode read off ``b``'s scale)."""
    mode: Mode = "rowwise" if b_scale.numel() > 1 else "tensorwise"
    a2 = a.reshape(-1, a.shape[-1])
    a_q, a_scale = quantize(a2, mode)
    with torch.autocast(a.device.type, enabled=False):  # float32 even inside a bf16 autocast region
        out = dequantize(a_q, a_scale) @ dequantize(b_q, b_scale).t()
    return out.to(a.dtype).reshape(*a.shape[:-1], b_q.shape[0])


class _ReferenceLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_q, w_scale, wt_q, wt_scale):
        ctx.save_for_backward(wt_q, wt_scale)
        return _reference_mm(x, w_q, w_scale)

    @staticmethod
    def backward(ctx, grad):
        wt_q, wt_scale = ctx.saved_tensors
        return _reference_mm(grad, wt_q, wt_scale), None, None, None, None


# ---------------------------------------------------------------- the float8 linear


def float8_mm(
    a: torch.Tensor,
    b_q: torch.Tensor,
    b_scale: torch.Tensor,
    fast_accum: bool,
    quantize_rows: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> torch.Tensor:
    """``a @ b.T`` through ``torch._scaled_mm``: ``a`` (any leading dims) quantized now, ``b``
    already quantized ``[N, K]`` row-major (so ``b.T`` is the column-major operand it wants).

    ``fast_accum``: Hopper's float8 tensor cores can skip the periodic promotion of their
    partial sums to full float32, which makes the matmul ~10% faster at a small accuracy cost.
    The forward takes it (its output feeds a bf16 residual stream anyway); the input gradient
    does not (gradients are where accumulated error compounds) -- torchao's recipes split the
    same way. ``quantize_rows``: how a rowwise ``a`` is quantized, where a caller outside a
    compiled region has a faster form of :func:`quantize` (the same arithmetic)."""
    a_q, a_scale, scale_b = float8_operands(a.reshape(-1, a.shape[-1]), b_scale, quantize_rows)
    out = torch._scaled_mm(a_q, b_q.t(), scale_a=a_scale, scale_b=scale_b, out_dtype=a.dtype, use_fast_accum=fast_accum)
    return out.reshape(*a.shape[:-1], b_q.shape[0])


def float8_operands(
    a2: torch.Tensor,
    b_scale: torch.Tensor,
    quantize_rows: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(a_q, scale_a, scale_b)`` as ``torch._scaled_mm`` takes them for ``a2 @ b.T``: the 2-D
    ``a2`` quantized the way ``b`` was (rowwise where ``b_scale`` has a scale per row), and
    ``b``'s scales shaped as its column-major operand wants them."""
    rowwise = b_scale.numel() > 1
    if not a2.is_contiguous():
        a2 = a2.contiguous()
    a_q, a_scale = quantize_rows(a2) if rowwise and quantize_rows else quantize(a2, "rowwise" if rowwise else "tensorwise")
    return a_q, a_scale, (b_scale.reshape(1, -1) if rowwise else b_scale)


class _Fp8FrozenLinear(torch.autograd.Function):
    """Saves nothing but the (already resident) transposed float8 weight: the base matmul keeps
    no activation for the backward, which needs only ``dY`` and ``W``."""

    @staticmethod
    def forward(ctx, x, w_q, w_scale, wt_q, wt_scale):
        ctx.save_for_backward(wt_q, wt_scale)
        return float8_mm(x, w_q, w_scale, fast_accum=True)

    @staticmethod
    def backward(ctx, grad):
        # dX = dY @ W = dY @ (W.T).T: the same matmul on the transposed copy
        wt_q, wt_scale = ctx.saved_tensors
        return float8_mm(grad, wt_q, wt_scale, fast_accum=False), None, None, None, None


def fp8_frozen_linear(x: torch.Tensor, weight: FrozenFp8Weight) -> torch.Tensor:
    """``x @ W.T`` in float8 (no bias), differentiable in ``x``; ``W`` gets no gradient."""
    return _Fp8FrozenLinear.apply(x, weight.w_q, weight.w_scale, weight.wt_q, weight.wt_scale)
