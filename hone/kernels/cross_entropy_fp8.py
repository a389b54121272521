"""The fused linear cross-entropy with a frozen output head multiplied in float8.

With LoRA the output head is frozen, and at a 128K-152K vocabulary its two matmuls (the
logits, ``hidden @ W.T``, and the hidden states' gradient, ``dlogits @ W``) are the largest
single GEMMs of a step: on llama3-8b at 8K tokens ~17 TFLOP a step, ~26 ms in bf16 on an H100.
Here both run as ``torch._scaled_mm`` on a weight quantized once
(:class:`~hone.kernels.fp8_linear.FrozenFp8Weight`, as the float8 base linears are), with
each chunk's hidden rows and logit gradients quantized per call, inside the same chunk loop as the bf16 fused loss
(:func:`hone.kernels.cross_entropy.chunked_cross_entropy`), so no ``[tokens x vocab]`` logits
exist either. The softmax step is the bf16 one: the logits come out of the matmul in the hidden
states' dtype.

**Rowwise only**, whatever the base's scaling: one scale per row of the hidden states and of
the logit gradient (and per vocabulary row / hidden column of the head) makes a chunk's
quantization independent of where the chunks fall, so the loss does not depend on the chunk
size. Tensorwise would scale each chunk by its own amax (the reference, by the whole tensor's).

Not exact against the bf16 loss: the logits carry float8's rounding of both operands (as every
float8 base linear's output does). What the tests hold it to is
:func:`linear_cross_entropy_fp8_reference`, the same quantization on dequantized operands in
float32 (:func:`hone.kernels.fp8_linear.fp8_linear_reference`) followed by the standard loss.
One ``torch.library`` custom op with a fake implementation and an autograd formula (the hidden
states only: the head is frozen), so compiled models trace through it without a graph break.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hone.kernels.cross_entropy import (
    Impl,
    check_shapes,
    chunked_cross_entropy,
    resolve_impl_and_chunk,
    scaled_gradient,
)
from hone.kernels.fp8_linear import FrozenFp8Weight, float8_mm, fp8_linear_reference, quantize

__all__ = ["fused_linear_cross_entropy_fp8", "linear_cross_entropy_fp8_reference"]


def linear_cross_entropy_fp8_reference(
    hidden: torch.Tensor, weight: FrozenFp8Weight, targets: torch.Tensor, ignore_index: int = -100
) -> torch.Tensor:
    """The loss the float8 fused op must equal: the float8 head's logits on dequantized operands
    (in ``hidden``'s dtype; the backward's logit gradient quantized per row as the op does), then
    the summed float32 cross entropy over targets != ``ignore_index``."""
    logits = fp8_linear_reference(hidden, weight)
    return F.cross_entropy(logits.float(), targets, ignore_index=ignore_index, reduction="sum")


_compiled_quantize_rows = None


def _quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rowwise quantization of a chunk's logit gradient (``[chunk x vocab]``, the largest tensor
    quantized here). Eager, :func:`~hone.kernels.fp8_linear.quantize` makes a float32 copy and
    four more passes over it (~3 GiB of traffic a 1,024-token chunk at a 128K vocabulary);
    compiled by Inductor on a GPU it is a row reduction and one cast that read the bf16 rows
    twice. Compiled once per process on first use, with dynamic shapes (one graph for the
    gradient's and the hidden chunk's widths and a ragged last chunk: no recompiles for the
    run's compile watch to report); the CPU keeps the eager function, the reference's own bits."""
    global _compiled_quantize_rows
    if not t.is_cuda:
        return quantize(t, "rowwise")
    if _compiled_quantize_rows is None:
        _compiled_quantize_rows = torch.compile(_rowwise, dynamic=True)
    return _compiled_quantize_rows(t)


def _rowwise(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize(t, "rowwise")


@torch.library.custom_op("hone::fused_linear_cross_entropy_fp8", mutates_args=())
def _fused_fp8_op(
    hidden: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    wt_q: torch.Tensor,
    wt_scale: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int,
    chunk_tokens: int,
    impl: str,
    need_hidden_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss sum float32 [], d loss/d hidden [N, H] in hidden's dtype or empty), chunk by chunk.
    The logits take the fast accumulation (as the float8 base's forward does), the hidden
    states' gradient does not (as its backward)."""
    grad_hidden = hidden.new_empty(hidden.shape) if need_hidden_grad else hidden.new_empty(0)

    def take_grad(start: int, h: torch.Tensor, grad_logits: torch.Tensor) -> None:
        grad_hidden[start : start + h.shape[0]] = float8_mm(grad_logits, wt_q, wt_scale, False, _quantize_rows)

    def logits_of(h: torch.Tensor) -> torch.Tensor:
        return float8_mm(h, w_q, w_scale, True, _quantize_rows)

    loss = chunked_cross_entropy(
        hidden, targets, ignore_index, chunk_tokens, impl, logits_of, take_grad if need_hidden_grad else None
    )
    return loss, grad_hidden


@_fused_fp8_op.register_fake
def _(hidden, w_q, w_scale, wt_q, wt_scale, targets, ignore_index, chunk_tokens, impl, need_hidden_grad):
    grad_hidden = hidden.new_empty(hidden.shape) if need_hidden_grad else hidden.new_empty(0)
    return hidden.new_empty((), dtype=torch.float32), grad_hidden


def _setup_context(ctx, inputs, output) -> None:
    hidden, *_, need_hidden_grad = inputs
    _, grad_hidden = output
    ctx.need_hidden_grad = need_hidden_grad
    ctx.hidden_dtype = hidden.dtype
    ctx.save_for_backward(grad_hidden)
    ctx.mark_non_differentiable(grad_hidden)


def _backward(ctx, grad_loss, _grad_hidden_out):
    (grad_hidden,) = ctx.saved_tensors
    d_hidden = scaled_gradient(grad_hidden, grad_loss.float(), ctx.hidden_dtype) if ctx.need_hidden_grad else None
    return d_hidden, None, None, None, None, None, None, None, None, None


_fused_fp8_op.register_autograd(_backward, setup_context=_setup_context)


def fused_linear_cross_entropy_fp8(
    hidden: torch.Tensor,
    weight: FrozenFp8Weight,
    targets: torch.Tensor,
    ignore_index: int = -100,
    chunk_tokens: int | None = None,
    impl: Impl = "auto",
) -> torch.Tensor:
    """Float32 sum of cross entropies of ``hidden [N, H]`` through the frozen float8 head
    ``weight`` (``[V, H]`` quantized) against ``targets [N]``, equal to
    :func:`linear_cross_entropy_fp8_reference` without the ``[N, V]`` logits. Differentiable in
    ``hidden`` (when it requires grad and grad mode is on); the logits come out in ``hidden``'s
    dtype, which must be a 16-bit float or float32 (``_scaled_mm``'s outputs)."""
    check_shapes(hidden, weight.w_q, targets, impl)
    if weight.w_scale.numel() == 1:
        raise ValueError(
            "the float8 head must be quantized rowwise (quantize_frozen_weight(weight, 'rowwise')): "
            "a tensorwise scale would make the loss depend on the chunk size"
        )
    impl, chunk_tokens = resolve_impl_and_chunk(hidden, weight.w_q.shape[0], impl, chunk_tokens)
    need_hidden_grad = torch.is_grad_enabled() and hidden.requires_grad
    head = (weight.w_q, weight.w_scale, weight.wt_q, weight.wt_scale)
    loss, _ = _fused_fp8_op(hidden, *head, targets, ignore_index, chunk_tokens, impl, need_hidden_grad)
    return loss
