"""Triton kernel of the scaled row gather over a buffer's first rows (:mod:`hone.kernels.scaled_rows`).

One program covers ``BLOCK_R`` output rows by ``BLOCK_H`` columns; loads and stores are masked by
the real-row count read from the device, so programs past it touch no memory. The product is
formed in float32 and rounded once to the output dtype.
"""

from __future__ import annotations

import torch

from hone.kernels.triton_support import tl, triton, triton_available  # noqa: F401 (re-exported)

BLOCK_R = 16
BLOCK_H = 256


if triton is not None:

    @triton.jit
    def _scaled_rows_kernel(
        source_ptr,
        index_ptr,
        scale_ptr,
        out_ptr,
        count_ptr,
        n_source,
        width,
        BLOCK_R: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        count = tl.load(count_ptr).to(tl.int64)
        live = rows < count
        index = tl.load(index_ptr + rows, mask=live, other=0).to(tl.int64)
        scale = tl.load(scale_ptr + rows, mask=live, other=0.0).to(tl.float32)
        mask = live[:, None] & (cols[None, :] < width)
        # an index past the source (a padding pair) reads zero, as the reference's appended zero row
        read = mask & (index[:, None] < n_source)
        value = tl.load(source_ptr + index[:, None] * width + cols[None, :], mask=read, other=0.0).to(tl.float32)
        out = scale[:, None] * value
        tl.store(out_ptr + rows[:, None] * width + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


def scaled_rows_triton(
    source: torch.Tensor, index: torch.Tensor, scale: torch.Tensor, count: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """``out[r] = scale[r] * source[index[r]]`` for rows below ``count``, the rest left unwritten."""
    rows, width = index.shape[0], source.shape[1]
    out = source.new_empty(rows, width, dtype=dtype)
    if rows and width:
        grid = (triton.cdiv(rows, BLOCK_R), triton.cdiv(width, BLOCK_H))
        _scaled_rows_kernel[grid](source, index, scale, out, count, source.shape[0], width, BLOCK_R=BLOCK_R, BLOCK_H=BLOCK_H)
    return out
