"""The MoE kernels' autotune space on a GPU: which tiles are timed for which problem, and the
key that decides when tuning runs again (pure Python: no triton or GPU needed)."""

from dataclasses import dataclass, field

import pytest

from hone.kernels.moe_lora_triton import _MM_TILES, _WGRAD_TILES, _fitting, rows_bucket


@dataclass
class _Config:  # the part of triton.Config the pruning reads
    kwargs: dict = field(default_factory=dict)


def _space(tiles):
    return [_Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k}) for m, n, k, _, _ in tiles]


def _tiles(configs):
    return sorted((c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) for c in configs)


def test_a_rank_sized_weight_gradient_is_timed_with_rank_sized_tiles_only():
    # dA = dxa^T x: M = r = 16 rows of the gradient
    assert _tiles(_fitting(_space(_WGRAD_TILES), 16, 2048)) == [(16, 128)]
    # dB = s dY^T xa: N = r = 16
    assert _tiles(_fitting(_space(_WGRAD_TILES), 768 * 2, 16)) == [(128, 16)]
    # r = 32: the 32-wide tiles come in
    assert (32, 128) in _tiles(_fitting(_space(_WGRAD_TILES), 32, 2048))


def test_full_size_problems_keep_the_whole_space_and_tiny_ones_keep_one():
    assert len(_fitting(_space(_WGRAD_TILES), 2880, 5760)) == len(_WGRAD_TILES)
    assert len(_fitting(_space(_MM_TILES), None, 5760)) == len(_MM_TILES)
    assert _tiles(_fitting(_space(_MM_TILES), None, 16)) == [(128, 32)]  # x A^T: N = r (no 16-wide mm tile)
    assert _tiles(_fitting(_space(_WGRAD_TILES), 3, 3)) == [(16, 128), (128, 16)]  # least overshoot


@pytest.mark.parametrize("rows, experts, bucket", [(4096 * 8, 128, 256), (2048 * 4, 32, 256), (100, 128, 1), (300, 1, 512)])
def test_rows_bucket_is_rows_per_expert_rounded_up_to_a_power_of_two(rows, experts, bucket):
    assert rows_bucket(rows, experts) == bucket
