"""The gradient norm of a step over every rank, and clipping by it.

With FSDP2 each rank holds a shard of every gradient (a DTensor); the norm of the step is the
norm of the whole gradient, over all shards. ``torch.nn.utils.get_total_norm`` of DTensor
gradients is itself a DTensor whose ``full_tensor()`` is that global norm (one all-reduce), and
clipping scales every shard by the same factor. Plain tensors (one process, or DDP's replicated
gradients, already all-reduced) take the same path without communication.
"""

import torch
from torch import nn


def global_grad_norm(params: list[nn.Parameter], max_norm: float | None) -> torch.Tensor:
    """The L2 norm of all gradients of ``params`` over every rank (a plain device tensor, no host
    sync), clipping them to ``max_norm`` when it is set (scale ``min(1, max_norm / norm)``)."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    total = torch.nn.utils.get_total_norm(grads)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    if max_norm is not None:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total
