"""The FLOP model behind MFU: every MoE family's expert width is found (gpt-oss names it
intermediate_size, qwen3-moe moe_intermediate_size), and only routed experts count."""

from types import SimpleNamespace

import pytest

from hone.bench.flops import active_matmul_params


def _moe(**fields) -> SimpleNamespace:
    base = dict(hidden_size=64, vocab_size=100, num_hidden_layers=2, num_experts=8, num_experts_per_tok=2)
    return SimpleNamespace(**{**base, **fields})


@pytest.mark.parametrize(
    "config",
    [_moe(moe_intermediate_size=32, intermediate_size=999), _moe(intermediate_size=32)],
    ids=["qwen3-moe naming", "gpt-oss naming"],
)
def test_only_routed_experts_count(config):
    total = 1_000_000
    per_expert = 3 * 64 * 32
    expected = total - 100 * 64 - 2 * (8 - 2) * per_expert
    assert active_matmul_params(config, total) == expected


def test_gpt_oss_preset_config_is_understood():
    from hone.models.presets import build_preset_config

    config = build_preset_config("gpt-oss-20b", {}, 201_088)
    assert 0 < active_matmul_params(config, 20_914_757_184) < 20_914_757_184
