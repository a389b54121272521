"""The gradient norm of a step over every rank, and clipping by it.

With FSDP2 each rank holds a shard of every gradient (a DTensor); the norm of the step is the
norm of the whole gradient, over all shards. ``torch.nn.utils.get_total_norm`` of DTensor
gradients is itself a DTensor whose ``full_tensor()`` is that global norm (one all-reduce), and
clipping scales every shard by the same factor. Plain tensors (one process, or DDP's replicated
gradients, already all-reduced) take the same path without communication.

Under expert parallelism each rank holds the gradients of its own block of experts (and of
their LoRA factors), complete but different on every rank: the squares of those are summed over
the ranks of the expert-parallel group (one all-reduce on the device, no host sync; the
replicas of a smaller group hold the same blocks, summed over them first) and added to the replicated part's,
counted once, so every rank clips by the same global norm. Beside FSDP2 the replicated part is
FSDP2's DTensor shards (its norm is already global) and the experts' blocks stay plain tensors;
torch's multi-tensor scaling refuses the two kinds in one call, so each is clipped on its own, by
the same factor.
"""

import torch
import torch.distributed as dist
from torch import nn


def global_grad_norm(
    params: list[nn.Parameter],
    max_norm: float | None,
    sharded: list[nn.Parameter] = (),
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """The L2 norm of all gradients of ``params`` over every rank (a plain device tensor, no host
    sync), clipping them to ``max_norm`` when it is set (scale ``min(1, max_norm / norm)``).
    ``sharded``: those of ``params`` whose gradient each rank of ``group`` holds a different block
    of (expert parallelism; None: the default group). Where the group is a part of the job, its
    blocks' replicas hold the same (already summed) gradients: the squares are summed over the
    group alone, so each block counts once."""
    from torch.distributed.tensor import DTensor

    apart = {id(p) for p in sharded}
    grads = [p.grad for p in params if p.grad is not None and id(p) not in apart]
    own = [p.grad for p in params if p.grad is not None and id(p) in apart]
    if not grads and not own and not apart:
        return torch.zeros(())
    device = (grads or own)[0].device if grads or own else sharded[0].device
    total = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros((), device=device)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    if apart:  # every rank joins the sum, whether or not its blocks got gradients this step
        squares = torch.nn.utils.get_total_norm(own).float().square() if own else torch.zeros((), device=device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(squares, group=group)
        total = (total.float().square() + squares).sqrt().to(total.dtype)
    if max_norm is not None:
        rest, blocks = [p for p in params if id(p) not in apart], [p for p in params if id(p) in apart]
        for part in (rest, blocks):
            if part:
                torch.nn.utils.clip_grads_with_norm_(part, max_norm, total)
    return total
