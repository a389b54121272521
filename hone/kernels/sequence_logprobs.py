"""Per-sequence log-probabilities ``sum_{i in s} log p(target_i)`` without the logits.

Preference objectives (DPO, IPO, ORPO) need, for every sequence of a packed micro-batch, the
sum of its completion tokens' log-probabilities; the plain recipe builds the ``[tokens x
vocab]`` logits for that, four times per step (policy and reference, chosen and rejected).
:func:`sequence_logprobs` walks the tokens in chunks as the fused linear cross-entropy does
(:mod:`hone.kernels.cross_entropy`, the same rounding: the matmul in the inputs'
dtype, then float32) and adds each token's ``log p(target)`` into its sequence's slot.

Unlike the cross-entropy, whose incoming gradient is one scalar (so it computes the gradients
in the forward), the output here is a vector: each sequence's log-probability gets its own
weight from the objective (``beta * sigmoid(...)`` for DPO), which is unknown until the
backward. So the forward keeps nothing but its inputs and the backward recomputes each chunk's
logits, turns them into ``g[seq] * (onehot - softmax)`` and into the chunk's share of the
gradients of the hidden states, the head and its bias. Only ``[chunk x vocab]`` logits exist
at any time: memory is the same as the fused cross-entropy's, at the price of a second head
matmul per chunk (Apple's Cut Cross-Entropy makes the same trade).

Both passes are ``torch.library`` custom ops (``hone::sequence_logprobs`` and
``hone::sequence_logprobs_backward``) with fake implementations, so ``torch.compile(fullgraph=True)``
traces a model's forward and backward through them without a graph break.

Each chunk's softmax step has two implementations (``impl``): ``"torch"`` (plain ops on a
float32 copy of the chunk's logits) and ``"triton"``, the fused cross-entropy's kernel
(:mod:`hone.kernels.cross_entropy_triton`), which reads the logits in their own dtype, returns
``-log p(target)`` per row and overwrites the row with ``softmax - onehot``; the backward then
scales each row by ``-g[seq]`` in place, so no float32 ``[chunk x vocab]`` copy exists (CUDA
only; the forward ignores the gradient it writes). ``"auto"`` is ``"triton"`` on CUDA.

A token counts if its target is not ``ignore_index`` and its segment id is in ``[0,
num_segments)``; segment ids below 0 mark tokens of no sequence (padding, prompts). Segment ids
at or past ``num_segments`` are the caller's error (an index error on CPU, a device assert on
CUDA): checking them here would cost a host sync per call.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from hone.kernels.cross_entropy import (
    DEFAULT_LOGITS_BUDGET_BYTES,
    KernelUnavailableError,
    accumulate_weight_grad,
    default_chunk_tokens,
    resolve_impl,
)
from hone.kernels.cross_entropy_triton import cross_entropy_softmax_grad_

Impl = Literal["auto", "torch", "triton"]
IMPLS: tuple[str, ...] = ("auto", "torch", "triton")

#: The float32-logits budget of a chunk when the head gets no gradient (LoRA, a frozen head):
#: half the fused cross-entropy's. The forward's chunk is alive at the step's peak (the end of
#: the forward, every layer's activations saved), and with no weight gradient every matmul of a
#: chunk contracts over the hidden size or the vocabulary, never over the chunk, so a smaller
#: chunk costs only launches. qwen3 (V=151,936): 384 tokens, 0.11 GiB of bf16 logits instead of
#: 0.22 (qwen3-8b DPO on an H200, benchmarks/2026-11-29-h200-dpo.md). A trained head keeps the
#: larger chunk: its gradient is accumulated chunk by chunk, a read and write of ``[V x H]``
#: each.
FROZEN_HEAD_LOGITS_BUDGET_BYTES = DEFAULT_LOGITS_BUDGET_BYTES // 2


def default_sequence_chunk_tokens(n_tokens: int, vocab: int, head_trained: bool) -> int:
    """Tokens per chunk when the caller names none: the fused cross-entropy's rule, at half its
    budget for a head that gets no gradient (:data:`FROZEN_HEAD_LOGITS_BUDGET_BYTES`). The memory
    estimate counts the chunk by the same function."""
    return default_chunk_tokens(n_tokens, vocab, DEFAULT_LOGITS_BUDGET_BYTES if head_trained else FROZEN_HEAD_LOGITS_BUDGET_BYTES)


def sequence_logprobs_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    segments: torch.Tensor,
    num_segments: int,
    ignore_index: int = -100,
) -> torch.Tensor:
    """The plain-PyTorch value the fused op must equal: ``log_softmax(float32(hidden @ weight.T
    + bias))`` at the targets, summed per segment into a float32 ``[num_segments]`` vector."""
    logits = F.linear(hidden, weight, bias).float()
    counted = _counted(targets, segments, ignore_index)
    token_logps = logits.log_softmax(-1).gather(1, torch.where(counted, targets, 0).unsqueeze(1)).squeeze(1)
    slots = torch.where(counted, segments, num_segments)
    out = token_logps.new_zeros(num_segments + 1).index_add(0, slots, torch.where(counted, token_logps, 0.0))
    return out[:num_segments]


def segment_token_counts(
    targets: torch.Tensor, segments: torch.Tensor, num_segments: int, ignore_index: int = -100
) -> torch.Tensor:
    """The number of counted tokens per segment (float32 ``[num_segments]``): the lengths that
    length-normalised objectives (IPO, ORPO) divide by."""
    counted = _counted(targets, segments, ignore_index)
    slots = torch.where(counted, segments, num_segments)
    ones = counted.to(torch.float32)
    return ones.new_zeros(num_segments + 1).index_add(0, slots, ones)[:num_segments]


def _counted(targets: torch.Tensor, segments: torch.Tensor, ignore_index: int) -> torch.Tensor:
    return (targets != ignore_index) & (segments >= 0)


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The reference's rounding: the projection in the inputs' dtype, then float32."""
    return F.linear(h, weight, bias).float()


@torch.library.custom_op("hone::sequence_logprobs", mutates_args=())
def _forward_op(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    segments: torch.Tensor,
    num_segments: int,
    ignore_index: int,
    chunk_tokens: int,
    impl: str,
) -> torch.Tensor:
    """Float32 ``[num_segments]`` sums of the counted tokens' log-probabilities, chunk by chunk."""
    out = torch.zeros(num_segments + 1, dtype=torch.float32, device=hidden.device)
    for start in range(0, hidden.shape[0], chunk_tokens):
        stop = start + chunk_tokens
        t, s = targets[start:stop], segments[start:stop]
        counted = _counted(t, s, ignore_index)
        if impl == "triton":
            logits = F.linear(hidden[start:stop], weight, bias)
            token_logps = -cross_entropy_softmax_grad_(logits, torch.where(counted, t, ignore_index), ignore_index, 0)
            del logits
        else:
            x = _chunk_logits(hidden[start:stop], weight, bias)
            lse = torch.logsumexp(x, dim=-1)
            token_logps = x.gather(1, torch.where(counted, t, 0).unsqueeze(1)).squeeze(1) - lse
            del x
        out.index_add_(0, torch.where(counted, s, num_segments), torch.where(counted, token_logps, 0.0))
    return out[:num_segments].clone()


@_forward_op.register_fake
def _(hidden, weight, bias, targets, segments, num_segments, ignore_index, chunk_tokens, impl):
    return hidden.new_empty((num_segments,), dtype=torch.float32)


@torch.library.custom_op("hone::sequence_logprobs_backward", mutates_args=())
def _backward_op(
    grad_out: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    segments: torch.Tensor,
    ignore_index: int,
    chunk_tokens: int,
    impl: str,
    need_hidden_grad: bool,
    need_weight_grad: bool,
    need_bias_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d/d hidden [N, H] in hidden's dtype, d/d weight [V, H] in weight's dtype, d/d bias [V];
    each empty when not needed). Recomputes each chunk's logits: the gradient of a token's
    ``log p(t)`` w.r.t. its logits is ``onehot(t) - softmax``, weighted by its segment's
    incoming gradient. The head's and the bias's gradients sum in float32 and round once."""
    num_segments = grad_out.shape[0]
    g_slots = torch.cat([grad_out.float(), grad_out.new_zeros(1, dtype=torch.float32)])
    grad_hidden = hidden.new_empty(hidden.shape) if need_hidden_grad else hidden.new_empty(0)
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight_grad else None
    grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_bias_grad else None
    for start in range(0, hidden.shape[0], chunk_tokens):
        stop = start + chunk_tokens
        t, s, h = targets[start:stop], segments[start:stop], hidden[start:stop]
        counted = _counted(t, s, ignore_index)
        g = g_slots[torch.where(counted, s, num_segments)]  # 0 for tokens that do not count
        # d logits = g * (onehot - softmax), built in place on the chunk's logits.
        if impl == "triton":
            grad_logits = F.linear(h, weight, bias)
            cross_entropy_softmax_grad_(grad_logits, torch.where(counted, t, ignore_index), ignore_index, 0)
            grad_logits.mul_(-g.unsqueeze(1))  # float32 product, rounded once to the logits' dtype
        else:
            x = _chunk_logits(h, weight, bias)
            lse = torch.logsumexp(x, dim=-1, keepdim=True)
            grad_logits = x.sub_(lse).exp_().mul_(-g.unsqueeze(1))
            grad_logits.scatter_add_(1, torch.where(counted, t, 0).unsqueeze(1), g.unsqueeze(1))
            del x
        if grad_bias is not None:
            grad_bias += grad_logits.sum(0, dtype=torch.float32)
        grad_logits = grad_logits.to(hidden.dtype)
        if need_hidden_grad:
            torch.mm(grad_logits, weight, out=grad_hidden[start:stop])
        if grad_weight is not None:
            accumulate_weight_grad(grad_weight, grad_logits, h)
        del grad_logits
    d_weight = grad_weight.to(weight.dtype) if grad_weight is not None else weight.new_empty(0)
    d_bias = grad_bias.to(bias.dtype) if grad_bias is not None and bias is not None else weight.new_empty(0)
    return grad_hidden, d_weight, d_bias


@_backward_op.register_fake
def _(
    grad_out,
    hidden,
    weight,
    bias,
    targets,
    segments,
    ignore_index,
    chunk_tokens,
    impl,
    need_hidden_grad,
    need_weight_grad,
    need_bias_grad,
):
    grad_hidden = hidden.new_empty(hidden.shape if need_hidden_grad else (0,))
    grad_weight = weight.new_empty(weight.shape if need_weight_grad else (0,))
    grad_bias = weight.new_empty((weight.shape[0],) if need_bias_grad else (0,), dtype=bias.dtype if bias is not None else None)
    return grad_hidden, grad_weight, grad_bias


def _setup_context(ctx, inputs, output) -> None:
    hidden, weight, bias, targets, segments, _, ignore_index, chunk_tokens, impl = inputs
    ctx.ignore_index = ignore_index
    ctx.chunk_tokens = chunk_tokens
    ctx.impl = impl
    ctx.has_bias = bias is not None
    ctx.save_for_backward(hidden, weight, bias, targets, segments)


def _backward(ctx, grad_out):
    hidden, weight, bias, targets, segments = ctx.saved_tensors
    need_hidden, need_weight, need_bias = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
    d_hidden, d_weight, d_bias = _backward_op(
        grad_out.contiguous(),
        hidden,
        weight,
        bias,
        targets,
        segments,
        ctx.ignore_index,
        ctx.chunk_tokens,
        ctx.impl,
        need_hidden,
        need_weight,
        need_bias and ctx.has_bias,
    )
    return (
        d_hidden if need_hidden else None,
        d_weight if need_weight else None,
        d_bias if need_bias and ctx.has_bias else None,
        None,
        None,
        None,
        None,
        None,
        None,
    )


_forward_op.register_autograd(_backward, setup_context=_setup_context)


def sequence_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    segments: torch.Tensor,
    num_segments: int,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    chunk_tokens: int | None = None,
    impl: Impl = "auto",
) -> torch.Tensor:
    """Float32 ``[num_segments]``: for each segment ``s``, the sum over tokens ``i`` with
    ``segments[i] == s`` and ``targets[i] != ignore_index`` of ``log softmax(hidden_i @ weight.T
    + bias)[targets_i]``, equal to :func:`sequence_logprobs_reference` without materialising the
    ``[N, V]`` logits (``hidden [N, H]``, ``weight [V, H]``, ``bias [V]``, ``targets`` and
    ``segments`` ``[N]`` integers; segment ids < 0 count nowhere).

    Differentiable w.r.t. ``hidden``, ``weight`` and ``bias`` (the backward recomputes each
    chunk's logits). Under ``torch.autocast`` the operands are cast to the autocast dtype first,
    as the reference's matmul is. ``chunk_tokens`` defaults to the fused cross-entropy's
    :func:`~hone.kernels.cross_entropy.default_chunk_tokens`, at half its budget when the head
    gets no gradient (:data:`FROZEN_HEAD_LOGITS_BUDGET_BYTES`); ``impl`` picks the softmax step
    (module docstring).
    """
    if impl not in IMPLS:
        raise KernelUnavailableError(f"sequence_logprobs impl {impl!r} is not one of {', '.join(IMPLS)}")
    if hidden.dim() != 2 or weight.dim() != 2 or targets.dim() != 1 or segments.dim() != 1:
        raise ValueError(
            f"expected hidden [N, H], weight [V, H], targets [N], segments [N]; got {tuple(hidden.shape)}, "
            f"{tuple(weight.shape)}, {tuple(targets.shape)}, {tuple(segments.shape)}"
        )
    n, vocab = hidden.shape[0], weight.shape[0]
    if targets.shape[0] != n or segments.shape[0] != n or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"shapes do not match: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}, "
            f"targets {tuple(targets.shape)}, segments {tuple(segments.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (vocab,):
        raise ValueError(f"bias must be [V] = [{vocab}], got {tuple(bias.shape)}")
    if num_segments < 0:
        raise ValueError(f"num_segments must be at least 0, got {num_segments}")
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        with torch.autocast(device_type, enabled=False):
            return sequence_logprobs(
                hidden.to(dtype),
                weight.to(dtype),
                targets,
                segments,
                num_segments,
                None if bias is None else bias.to(dtype),
                ignore_index,
                chunk_tokens,
                impl,
            )
    if hidden.dtype != weight.dtype or (bias is not None and bias.dtype != weight.dtype):
        raise ValueError(
            f"hidden ({hidden.dtype}), weight ({weight.dtype}) and bias "
            f"({None if bias is None else bias.dtype}) must share a dtype, as the reference's projection does"
        )
    impl = resolve_impl(hidden, impl, "sequence_logprobs")
    if chunk_tokens is None:
        trained = weight.requires_grad or (bias is not None and bias.requires_grad)
        chunk_tokens = default_sequence_chunk_tokens(n, vocab, trained)
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be at least 1, got {chunk_tokens}")
    return _forward_op(hidden, weight, bias, targets, segments, num_segments, ignore_index, chunk_tokens, impl)
