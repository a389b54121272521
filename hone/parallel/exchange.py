"""The all-to-all exchange expert parallelism moves tokens with, differentiable.

One module so that how the exchange is issued is decided in one place: the dispatch and combine
of :mod:`hone.parallel.expert_parallel` only call :func:`exchange`.

- **Eager**: ``torch.distributed.all_to_all_single`` into a fresh buffer, its gradient the same
  exchange of the output's gradient (:class:`_Exchange`).
- **Under** ``torch.compile``: torch's functional collective
  (``torch.distributed._functional_collectives.all_to_all_single_autograd``, what torchtitan's
  expert parallelism uses), which Dynamo puts in the graph as one ``all_to_all_single`` and a
  ``wait_tensor``, with torch's own backward (the reverse exchange), so a compiled decoder layer
  is one graph with its four exchanges in it (two each way) and Inductor may schedule other work
  around them. Dynamo would also trace the eager path (it rewrites the in-place collective into
  the functional one), but with an empty buffer and a copy into it per exchange.

Both move the same bytes: the compiled and the eager exchange give identical results
(tests/distributed/test_expert_parallel_compile.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

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
    if torch.compiler.is_compiling():
        # equal splits (None, None); the group as the collective needs it (None: the default group)
        return funcol.all_to_all_single_autograd(x.contiguous(), None, None, group or dist.group.WORLD)
    if x.is_floating_point():
        return _Exchange.apply(x, group)
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x.contiguous(), group=group)
    return out
