"""The MoE kernels' tiles on a GPU: the one tile each problem launches with by default (no
autotuning in the first step), which tiles ``HONE_MOE_AUTOTUNE=1`` times, and the key that
decides when either runs again (pure Python: no triton or GPU needed)."""

from dataclasses import dataclass, field

import pytest

from hone.kernels import moe_lora_triton
from hone.kernels.moe_lora_triton import _MM_TILES, _WGRAD_TILES, BIG_TILE_ROWS, _fitting, heuristic_tile, rows_bucket


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


def test_fitting_reads_plain_tiles_like_configs():
    assert _fitting(_WGRAD_TILES, 16, 2048) == [(16, 128, 64, 4, 3)]


@pytest.mark.parametrize("rows, experts, bucket", [(4096 * 8, 128, 256), (2048 * 4, 32, 256), (100, 128, 1), (300, 1, 512)])
def test_rows_bucket_is_rows_per_expert_rounded_up_to_a_power_of_two(rows, experts, bucket):
    assert rows_bucket(rows, experts) == bucket


# The LoRA step's problems at the bench shapes (seq 2048, r16): qwen3-30b-a3b (hidden 2048,
# expert intermediate 768, 128 experts, top-8: 128 rows per expert) and gpt-oss-20b (hidden
# 2880, intermediate 2880, 32 experts, top-4: 256 rows per expert).
QWEN, GPT_OSS = rows_bucket(2048 * 8, 128), rows_bucket(2048 * 4, 32)


@pytest.mark.parametrize(
    "kernel, m, n, rows, tile",
    [
        ("mm", None, 2 * 768, QWEN, (64, 128, 64, 4, 4)),  # gate_up: x W + s xa B^T
        ("mm", None, 2048, QWEN, (64, 128, 64, 4, 4)),  # down, and dX of gate_up
        ("mm", None, 2 * 2880, GPT_OSS, (64, 128, 64, 4, 4)),
        ("mm", None, 2880, BIG_TILE_ROWS, (128, 128, 64, 8, 3)),  # many rows per expert: the big tile
        ("mm", None, 16, QWEN, (128, 32, 64, 4, 3)),  # x A^T and dY B: N = r
        ("wgrad", 16, 2048, QWEN, (16, 128, 64, 4, 3)),  # dA
        ("wgrad", 2 * 768, 16, QWEN, (128, 16, 64, 4, 3)),  # dB
        ("wgrad", 2 * 768, 2048, QWEN, (128, 128, 64, 8, 3)),  # dW (full fine-tune)
    ],
)
def test_each_problem_launches_one_tile_chosen_from_its_shape(kernel, m, n, rows, tile):
    assert heuristic_tile(kernel, m, n, rows, element_size=2) == tile


def test_the_heuristic_tile_is_one_autotuning_would_time():
    for kernel, tiles, m in (("mm", _MM_TILES, None), ("wgrad", _WGRAD_TILES, 2048)):
        for n in (16, 32, 768, 2880):
            for rows in (1, 64, 128, 1024):
                assert heuristic_tile(kernel, m, n, rows, 2) in _fitting(tiles, m, n)


def test_float32_halves_the_k_tile():
    assert heuristic_tile("mm", None, 2048, QWEN, element_size=4) == (64, 128, 32, 4, 4)
    assert heuristic_tile("wgrad", 16, 2048, QWEN, element_size=4) == (16, 128, 32, 4, 3)


def test_autotuning_is_off_unless_asked_for(monkeypatch):
    monkeypatch.delenv(moe_lora_triton.AUTOTUNE_ENV, raising=False)
    assert not moe_lora_triton.autotuning()
    monkeypatch.setenv(moe_lora_triton.AUTOTUNE_ENV, "1")
    assert moe_lora_triton.autotuning() is (not moe_lora_triton.INTERPRET)


def test_autotuning_times_the_fitting_configs_and_the_default_one_tile(monkeypatch):
    if moe_lora_triton.triton is None:
        pytest.skip("triton is not installed: the configs are triton.Config objects")
    monkeypatch.setattr(moe_lora_triton, "INTERPRET", False)  # the GPU's behaviour, whatever this process runs
    configs = [moe_lora_triton._config(t) for t in _MM_TILES]
    monkeypatch.setenv(moe_lora_triton.AUTOTUNE_ENV, "1")
    assert moe_lora_triton._prune("mm", configs, None, 2048, QWEN, 2) == configs
    monkeypatch.delenv(moe_lora_triton.AUTOTUNE_ENV)
    (only,) = moe_lora_triton._prune("mm", configs, None, 2048, QWEN, 2)
    assert (only.kwargs, only.num_warps, only.num_stages) == ({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64}, 4, 4)


def test_nothing_is_compiled_ahead_under_the_interpreter_or_when_switched_off(monkeypatch):
    import torch

    from hone.kernels import moe_lora

    x = torch.randn(4, 8)
    args = (x, None, torch.tensor([4], dtype=torch.int32), torch.randn(1, 8, 8), False, None, None, None, 1.0)
    monkeypatch.setenv(moe_lora.PRECOMPILE_ENV, "0")
    assert moe_lora.precompile_projection(*args) is False
    monkeypatch.delenv(moe_lora.PRECOMPILE_ENV)
    if moe_lora.INTERPRET or moe_lora.triton is None:
        assert moe_lora.precompile_projection(*args) is False
