"""Triton kernel for one chunk of the fused linear cross-entropy: softmax gradient in place.

Given one chunk's logits ``[C, V]`` (in the matmul's dtype, as the reference rounds them) and
its targets, one program per row reads the row in vocabulary blocks, keeps a running max and
sum (online logsumexp, in float32), writes the row's loss, then overwrites the row with the
gradient of its loss, ``softmax - onehot`` (zero where the target is the ignore index). The
logits buffer becomes the gradient buffer, so a chunk never holds a float32 ``[C, V]`` copy —
the torch implementation needs one. Same idea as Liger-Kernel's cross-entropy kernel; written
from the description, not copied.

The kernel is a ``torch.library`` custom op that mutates its input, with a fake implementation,
so a graph that contains it can be traced. Triton is optional: without it (a CPU-only torch
wheel does not bring it), :func:`triton_available` is False and the op raises. On CPU the op
runs only under Triton's interpreter (``TRITON_INTERPRET=1`` set before triton is imported),
which is how the CPU tests check it.
"""

from __future__ import annotations

import torch

from hone.kernels.triton_support import tl, triton, triton_available  # noqa: F401 (re-exported)

# Largest vocabulary block one program loads at a time: 32K elements keep a row's pass to a
# handful of iterations at Qwen's 151,936 (5 blocks) while staying within registers at 32 warps.
MAX_BLOCK_V = 32768


if triton is not None:

    @triton.jit
    def _softmax_grad_kernel(
        logits_ptr,
        row_stride,
        targets_ptr,
        loss_ptr,
        n_cols,
        ignore_index,
        BLOCK_V: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * row_stride
        target = tl.load(targets_ptr + row)
        ignored = target == ignore_index
        safe_target = tl.where(ignored, 0, target)
        offsets = tl.arange(0, BLOCK_V)

        # Pass 1: online max and sum of exponentials over the row, in float32.
        running_max = float("-inf")
        running_sum = 0.0
        for start in range(0, n_cols, BLOCK_V):
            cols = start + offsets
            x = tl.load(base + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
            new_max = tl.maximum(running_max, tl.max(x, 0))
            running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), 0)
            running_max = new_max
        lse = running_max + tl.log(running_sum)
        target_logit = tl.load(base + safe_target).to(tl.float32)
        tl.store(loss_ptr + row, tl.where(ignored, 0.0, lse - target_logit))

        # Pass 2: overwrite the row with d(loss)/d(logits) = softmax - onehot (zero if ignored).
        keep = tl.where(ignored, 0.0, 1.0)
        for start in range(0, n_cols, BLOCK_V):
            cols = start + offsets
            mask = cols < n_cols
            x = tl.load(base + cols, mask=mask, other=float("-inf")).to(tl.float32)
            grad = tl.exp(x - lse) - tl.where(cols == safe_target, 1.0, 0.0)
            tl.store(base + cols, (grad * keep).to(logits_ptr.dtype.element_ty), mask=mask)


def _launch_config(n_cols: int, block_v: int) -> tuple[int, int]:
    """(BLOCK_V, num_warps): the whole row's power of two up to :data:`MAX_BLOCK_V`, or the
    caller's ``block_v`` (tests pass a small one so rows take several blocks)."""
    block = block_v if block_v > 0 else min(MAX_BLOCK_V, triton.next_power_of_2(n_cols))
    num_warps = 32 if block >= 16384 else (16 if block >= 4096 else 4)
    return block, num_warps


@torch.library.custom_op("hone::cross_entropy_softmax_grad_", mutates_args=("logits",))
def cross_entropy_softmax_grad_(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int, block_v: int) -> torch.Tensor:
    """Overwrite ``logits`` [C, V] with ``softmax - onehot(targets)`` (rows whose target is
    ``ignore_index`` become zero) and return the float32 per-row losses [C] (0 when ignored).

    ``block_v`` 0 picks the vocabulary block size; a power of two forces one."""
    if not triton_available(logits.device):
        raise RuntimeError("hone::cross_entropy_softmax_grad_ needs triton and a CUDA tensor (or TRITON_INTERPRET=1)")
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(
            f"logits must be a 2-D tensor with contiguous rows, got shape {tuple(logits.shape)} strides {logits.stride()}"
        )
    rows, n_cols = logits.shape
    losses = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows == 0:
        return losses
    block, num_warps = _launch_config(n_cols, block_v)
    _softmax_grad_kernel[(rows,)](
        logits,
        logits.stride(0),
        targets.contiguous(),
        losses,
        n_cols,
        ignore_index,
        BLOCK_V=block,
        num_warps=num_warps,
    )
    return losses


@cross_entropy_softmax_grad_.register_fake
def _(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int, block_v: int) -> torch.Tensor:
    return logits.new_empty(logits.shape[0], dtype=torch.float32)
