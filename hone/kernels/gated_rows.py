"""The gated activation of a buffer's first ``count`` rows, the count kept on the device.

Expert parallelism sizes a rank's grouped buffers for the worst case: ``N x S x min(k, E/N)``
(token, expert) rows, about ``N`` times the pairs a rank really computes
(:mod:`hone.parallel.expert_parallel`). The grouped kernels skip the rows past the real pairs
(their ``ends``), but the gated activation between the two projections, traced as a plain
elementwise op, read and wrote every row forward and backward: at four ranks three quarters of
that traffic was for rows nobody reads. Slicing to the real rows would need their count on the
host, a sync per layer. :func:`gated_rows` instead passes the count as a device tensor to a
Triton kernel that masks every load and store by it.

Rows at or past ``count`` of the output, and of the gradient the backward returns, are **left
unwritten** (whatever the allocator handed out): the caller guarantees nothing reads them (the
grouped kernels' ``ends`` stop at ``count``). The reference (:func:`gated_rows_reference`)
computes every row; the two agree on the rows below ``count``.

:func:`gated_rows` is the ``torch.library`` custom op ``hone::gated_rows`` with a fake
implementation and an autograd formula (``hone::gated_rows_backward``): compiled layers trace
through it without a graph break. Where Triton cannot run (a CPU without the interpreter) both
ops compute every row with the reference.
"""

from __future__ import annotations

import torch

from hone.kernels.gated_rows_triton import gated_rows_backward_triton, gated_rows_forward_triton, triton_available
from hone.kernels.moe_lora_reference import ExpertsLayout, gated_activation

__all__ = ["gated_rows", "gated_rows_reference"]


def gated_rows_reference(gate_up: torch.Tensor, count: torch.Tensor, layout: ExpertsLayout) -> torch.Tensor:
    """The plain-PyTorch definition: :func:`~hone.kernels.moe_lora_reference.gated_activation`
    of every row (``count`` only says which rows the kernel computes)."""
    del count
    return gated_activation(gate_up, layout)


def _backward_every_row(grad: torch.Tensor, gate_up: torch.Tensor, layout: ExpertsLayout) -> torch.Tensor:
    """The gradient of :func:`~hone.kernels.moe_lora_reference.gated_activation` with respect to
    ``gate_up``, written out (a custom op's inside runs below autograd, so it cannot call it), in
    the kernel's arithmetic: float32 (float64 stays), one rounding to ``gate_up``'s dtype."""
    work = torch.float64 if gate_up.dtype == torch.float64 else torch.float32
    x, g = gate_up.to(work), grad.to(work)
    gate, up = (x[:, ::2], x[:, 1::2]) if layout.interleaved else x.chunk(2, dim=-1)
    if layout.activation == "clamped_swiglu":
        limit, alpha = layout.swiglu_limit, layout.swiglu_alpha
        gate_c, up_c = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
        sig = torch.sigmoid(gate_c * alpha)
        d_up = torch.where((up >= -limit) & (up <= limit), g * gate_c * sig, 0.0)
        d_gate = torch.where(gate <= limit, g * (up_c + 1) * (sig + alpha * gate_c * sig * (1 - sig)), 0.0)
    else:
        sig = torch.sigmoid(gate)
        d_up, d_gate = g * gate * sig, g * up * sig * (1 + gate * (1 - sig))
    if layout.interleaved:
        return torch.stack([d_gate, d_up], dim=-1).reshape(x.shape).to(gate_up.dtype)
    return torch.cat([d_gate, d_up], dim=-1).to(gate_up.dtype)


def _layout(interleaved: bool, activation: str, alpha: float, limit: float) -> ExpertsLayout:
    return ExpertsLayout(transposed=False, interleaved=interleaved, activation=activation, swiglu_alpha=alpha, swiglu_limit=limit)


@torch.library.custom_op("hone::gated_rows", mutates_args=())
def _gated_rows(
    gate_up: torch.Tensor, count: torch.Tensor, interleaved: bool, activation: str, alpha: float, limit: float
) -> torch.Tensor:
    if triton_available(gate_up.device):
        clamped = activation == "clamped_swiglu"
        return gated_rows_forward_triton(gate_up.contiguous(), count, interleaved, clamped, alpha, limit)
    return gated_activation(gate_up, _layout(interleaved, activation, alpha, limit)).contiguous()


@_gated_rows.register_fake
def _(gate_up, count, interleaved, activation, alpha, limit):
    return gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)


@torch.library.custom_op("hone::gated_rows_backward", mutates_args=())
def _gated_rows_backward(
    grad: torch.Tensor, gate_up: torch.Tensor, count: torch.Tensor, interleaved: bool, activation: str, alpha: float, limit: float
) -> torch.Tensor:
    if triton_available(gate_up.device):
        clamped = activation == "clamped_swiglu"
        return gated_rows_backward_triton(grad.contiguous(), gate_up.contiguous(), count, interleaved, clamped, alpha, limit)
    return _backward_every_row(grad, gate_up, _layout(interleaved, activation, alpha, limit))


@_gated_rows_backward.register_fake
def _(grad, gate_up, count, interleaved, activation, alpha, limit):
    return torch.empty_like(gate_up)


def _setup_context(ctx, inputs, output) -> None:
    gate_up, count, interleaved, activation, alpha, limit = inputs
    ctx.save_for_backward(gate_up, count)
    ctx.options = (interleaved, activation, alpha, limit)


def _backward(ctx, grad):
    gate_up, count = ctx.saved_tensors
    return _gated_rows_backward(grad, gate_up, count, *ctx.options), None, None, None, None, None


_gated_rows.register_autograd(_backward, setup_context=_setup_context)


def gated_rows(gate_up: torch.Tensor, count: torch.Tensor, layout: ExpertsLayout) -> torch.Tensor:
    """``[R, 2I] -> [R, I]``: the layout's gated activation of the rows below ``count`` (an
    integer tensor of one element on ``gate_up``'s device); the other rows of the result, and of
    its gradient, are left unwritten (module docstring)."""
    if layout.activation not in ("silu", "clamped_swiglu"):
        raise ValueError(f"activation {layout.activation!r} is not one of: silu, clamped_swiglu")
    return _gated_rows(
        gate_up, count.reshape(1), layout.interleaved, layout.activation, float(layout.swiglu_alpha), float(layout.swiglu_limit)
    )
