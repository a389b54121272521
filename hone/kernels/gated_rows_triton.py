"""Triton kernels of the gated activation over a buffer's first rows (:mod:`hone.kernels.gated_rows`).

One program covers ``BLOCK_R`` rows by ``BLOCK_I`` intermediate columns. The real-row count is
read from the device, and every load and store is masked by it: a program past it touches no
memory, so the passes cost the real rows, not the buffer. Arithmetic in float32, one rounding to
the buffer's dtype.
"""

from __future__ import annotations

import torch

from hone.kernels.triton_support import tl, triton, triton_available  # noqa: F401 (re-exported)

BLOCK_R = 32
BLOCK_I = 128


if triton is not None:

    @triton.jit
    def _columns(pid_i, inter, INTERLEAVED: tl.constexpr, BLOCK: tl.constexpr):
        """This program's intermediate columns and where their gate and up values sit in a row
        of ``gate_up``: alternating (gpt_oss) or the two halves (qwen3-moe and most models)."""
        cols = pid_i * BLOCK + tl.arange(0, BLOCK)
        if INTERLEAVED:
            return cols, 2 * cols, 2 * cols + 1
        return cols, cols, cols + inter

    @triton.jit
    def _counted_gate_and_up(
        gate_up_ptr, count_ptr, inter, INTERLEAVED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_I: tl.constexpr
    ):
        """This program's rows and columns, the mask of those below the count, and their gate and
        up values in float32 (zero where masked)."""
        rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols, gate_cols, up_cols = _columns(tl.program_id(1), inter, INTERLEAVED, BLOCK_I)
        count = tl.load(count_ptr).to(tl.int64)
        mask = (rows[:, None] < count) & (cols[None, :] < inter)
        base = gate_up_ptr + rows[:, None] * (2 * inter)
        gate = tl.load(base + gate_cols[None, :], mask=mask, other=0.0).to(tl.float32)
        up = tl.load(base + up_cols[None, :], mask=mask, other=0.0).to(tl.float32)
        return rows, cols, gate_cols, up_cols, mask, gate, up

    @triton.jit
    def _gated_rows_forward_kernel(
        gate_up_ptr,
        out_ptr,
        count_ptr,
        inter,
        alpha,
        limit,
        INTERLEAVED: tl.constexpr,
        CLAMPED: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_I: tl.constexpr,
    ):
        rows, cols, gate_cols, up_cols, mask, gate, up = _counted_gate_and_up(
            gate_up_ptr, count_ptr, inter, INTERLEAVED, BLOCK_R, BLOCK_I
        )
        if CLAMPED:
            gate = tl.minimum(gate, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
            h = (up + 1.0) * (gate * tl.sigmoid(gate * alpha))
        else:
            h = gate * tl.sigmoid(gate) * up
        tl.store(out_ptr + rows[:, None] * inter + cols[None, :], h.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _gated_rows_backward_kernel(
        grad_ptr,
        gate_up_ptr,
        d_gate_up_ptr,
        count_ptr,
        inter,
        alpha,
        limit,
        INTERLEAVED: tl.constexpr,
        CLAMPED: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_I: tl.constexpr,
    ):
        rows, cols, gate_cols, up_cols, mask, gate, up = _counted_gate_and_up(
            gate_up_ptr, count_ptr, inter, INTERLEAVED, BLOCK_R, BLOCK_I
        )
        grad = tl.load(grad_ptr + rows[:, None] * inter + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if CLAMPED:
            # torch.clamp passes the gradient where the input lies within its bounds, ends included
            gate_c = tl.minimum(gate, limit)
            up_c = tl.minimum(tl.maximum(up, -limit), limit)
            sig = tl.sigmoid(gate_c * alpha)
            d_up = tl.where((up >= -limit) & (up <= limit), grad * gate_c * sig, 0.0)
            d_gate_c = grad * (up_c + 1.0) * (sig + alpha * gate_c * sig * (1.0 - sig))
            d_gate = tl.where(gate <= limit, d_gate_c, 0.0)
        else:
            sig = tl.sigmoid(gate)
            d_up = grad * gate * sig
            d_gate = grad * up * sig * (1.0 + gate * (1.0 - sig))
        out = d_gate_up_ptr + rows[:, None] * (2 * inter)
        dtype = d_gate_up_ptr.dtype.element_ty
        tl.store(out + gate_cols[None, :], d_gate.to(dtype), mask=mask)
        tl.store(out + up_cols[None, :], d_up.to(dtype), mask=mask)


def _grid(rows: int, inter: int) -> tuple[int, int]:
    return (triton.cdiv(rows, BLOCK_R), triton.cdiv(inter, BLOCK_I))


def gated_rows_forward_triton(
    gate_up: torch.Tensor, count: torch.Tensor, interleaved: bool, clamped: bool, alpha: float, limit: float
) -> torch.Tensor:
    """``[R, 2I] -> [R, I]`` for rows below ``count``; the rest of the output is left unwritten."""
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty(rows, inter)
    if rows and inter:
        _gated_rows_forward_kernel[_grid(rows, inter)](
            gate_up, out, count, inter, alpha, limit, interleaved, clamped, BLOCK_R=BLOCK_R, BLOCK_I=BLOCK_I
        )
    return out


def gated_rows_backward_triton(
    grad: torch.Tensor,
    gate_up: torch.Tensor,
    count: torch.Tensor,
    interleaved: bool,
    clamped: bool,
    alpha: float,
    limit: float,
) -> torch.Tensor:
    """The gradient of ``gate_up`` ``[R, 2I]`` for rows below ``count``; the rest left unwritten."""
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    d_gate_up = torch.empty_like(gate_up)
    if rows and inter:
        _gated_rows_backward_kernel[_grid(rows, inter)](
            grad, gate_up, d_gate_up, count, inter, alpha, limit, interleaved, clamped, BLOCK_R=BLOCK_R, BLOCK_I=BLOCK_I
        )
    return d_gate_up
