"""The all-to-all exchange expert and context parallelism move tokens with, differentiable.

One module so that how the exchange is issued is decided in one place: the dispatch and combine
of :mod:`hone.parallel.expert_parallel` and the head exchanges of
:mod:`hone.parallel.context_parallel` only call :func:`exchange`.

- **Eager**: :class:`_Exchange`, an autograd Function around ``dist.all_to_all_single`` whose
  backward is the same exchange of the gradient.
- **While ``torch.compile`` traces**: torch's functional ``all_to_all_single_autograd``, which
  *returns* its output. Traced, the autograd Function is wrong: Dynamo inlines its forward, in
  which ``dist.all_to_all_single`` fills an ``empty_like`` buffer in place, so the traced output
  carries no dependence on the input; the derivative comes out exactly zero and the hand-written
  backward never runs (the forward is right: the collective still moves the bytes). With torch
  2.11 every gradient through a compiled exchange was zero: hidden states, routing weights,
  expert weights and their LoRA factors (``tests/distributed/test_expert_parallel_compile.py``;
  DeepSpeed hit the same in its Ulysses exchange, deepspeedai/DeepSpeed#8491). torch 2.13
  happened to trace it right; the functional form is right on both.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as functional

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
        if torch.compiler.is_compiling():  # see the module's docstring: the traced Function's gradient is zero
            return functional.all_to_all_single_autograd(x.contiguous(), None, None, dist.group.WORLD if group is None else group)
        return _Exchange.apply(x, group)
    # integers (the send plan's ids) need no gradient: the in-place collective, traced or not, as
    # measured (Inductor 2.11 failed on H100s when the plan's integer scan fed the functional one)
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x.contiguous(), group=group)
    return out
