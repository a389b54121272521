"""A scaled row gather over a buffer's first ``count`` rows, the count kept on the device.

The weighted sum of expert parallelism's local pairs (:mod:`hone.parallel.expert_parallel`) has
a backward that forms, for every row of the capacity-sized pair buffer, that pair's routing
weight times its token's output gradient: ``weight[r] * grad[token[r]]``. The buffer holds about
``N`` times the real pairs at ``N`` ranks, and the rows past the real ones (weight zero, the
zero row) are never read. :func:`scaled_rows` forms the real rows only: a Triton kernel masks
every load and store by the count, a device tensor (no host sync). Rows at or past ``count`` are
**left unwritten**; :func:`scaled_rows_reference` forms every row and agrees below ``count``.

It is the ``torch.library`` custom op ``hone::scaled_rows`` with a fake implementation, for use
inside a backward (no autograd formula of its own). Where Triton cannot run, the reference.
"""

from __future__ import annotations

import torch

from hone.kernels.moe_lora import with_zero_row
from hone.kernels.scaled_rows_triton import scaled_rows_triton, triton_available

__all__ = ["scaled_rows", "scaled_rows_reference"]


def scaled_rows_reference(
    source: torch.Tensor, index: torch.Tensor, scale: torch.Tensor, count: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """``scale[r] * source[index[r]]`` for every row, in float32, then ``dtype``; an index equal
    to ``len(source)`` reads a zero row."""
    del count
    return (scale.float().unsqueeze(1) * with_zero_row(source.float())[index]).to(dtype)


@torch.library.custom_op("hone::scaled_rows", mutates_args=())
def _scaled_rows(
    source: torch.Tensor, index: torch.Tensor, scale: torch.Tensor, count: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    if triton_available(source.device):
        return scaled_rows_triton(source.contiguous(), index.contiguous(), scale.contiguous(), count, dtype)
    return scaled_rows_reference(source, index, scale, count, dtype)


@_scaled_rows.register_fake
def _(source, index, scale, count, dtype):
    return source.new_empty(index.shape[0], source.shape[1], dtype=dtype)


def scaled_rows(
    source: torch.Tensor, index: torch.Tensor, scale: torch.Tensor, count: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """``[R, H]`` in ``dtype``: row ``r < count`` is ``scale[r] * source[index[r]]`` (float32
    product; ``index`` = ``len(source)`` reads zero); the other rows are left unwritten."""
    return _scaled_rows(source, index, scale, count.reshape(1), dtype)
