"""The all-to-all exchange expert parallelism moves tokens with, differentiable.

One module so that how the exchange is issued (eager ``torch.distributed`` calls, or
collectives ``torch.compile`` can trace) is decided in one place: the dispatch and combine of
:mod:`hone.parallel.expert_parallel` only call :func:`exchange`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["exchange"]


class _Exchange(torch.autograd.Function):
    """``torch.distributed.all_to_all_single`` with equal splits, differentiable: block ``j`` of
    the input goes to rank ``j``, block ``i`` of the output came from rank ``i``. The gradient is
    the same exchange of the output's gradient. (What ``torch.distributed.nn.functional``'s
    deprecated ``all_to_all_single`` does, without its warning on every call.)"""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        dist.all_to_all_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _Exchange.apply(grad, ctx.group), None


def exchange(x: torch.Tensor, size: int, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``x``'s ``size`` equal blocks (along dim 0) swapped across ``group`` (differentiable for
    floating-point ``x``); ``x`` itself for ``size == 1``."""
    if size == 1:
        return x
    if x.is_floating_point():
        return _Exchange.apply(x, group)
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x.contiguous(), group=group)
    return out
