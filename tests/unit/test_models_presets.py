"""Architecture presets: names, published shapes, overrides, deterministic random init."""

from typing import get_args

import pytest
import torch

from hone.config.model import ModelConfig, PresetName
from hone.errors import HoneError
from hone.models.loader import build_preset_model
from hone.models.presets import PRESET_NAMES, PRESETS, build_preset_config
from hone.testing import tiny_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def test_every_preset_name_has_a_preset_and_no_more():
    assert set(PRESETS) == set(get_args(PresetName))


@pytest.mark.parametrize("name", [n for n in get_args(PresetName) if n.startswith("tiny-")])
def test_tiny_presets_take_the_tokenizer_vocabulary(name):
    config = build_preset_config(name, {}, vocab_size=1234)
    assert config.vocab_size == 1234
    assert config.hidden_size <= 128 and config.num_hidden_layers <= 4


def test_tiny_presets_cover_distinct_architectures():
    model_types = {build_preset_config(n, {}, 100).model_type for n in PRESETS if n.startswith("tiny-")}
    assert model_types == {"llama", "qwen3", "mistral", "gemma3_text", "qwen3_moe", "gpt_oss"}


@pytest.mark.parametrize(
    "name, expected",
    [
        (
            "llama3-8b",
            dict(
                vocab_size=128256,
                hidden_size=4096,
                intermediate_size=14336,
                num_hidden_layers=32,
                num_attention_heads=32,
                num_key_value_heads=8,
                tie_word_embeddings=False,
            ),
        ),
        (
            "llama3.2-3b",
            dict(
                vocab_size=128256,
                hidden_size=3072,
                intermediate_size=8192,
                num_hidden_layers=28,
                num_attention_heads=24,
                num_key_value_heads=8,
                head_dim=128,
                tie_word_embeddings=True,
            ),
        ),
        (
            "qwen3-8b",
            dict(
                vocab_size=151936,
                hidden_size=4096,
                intermediate_size=12288,
                num_hidden_layers=36,
                num_attention_heads=32,
                num_key_value_heads=8,
                head_dim=128,
                tie_word_embeddings=False,
            ),
        ),
        (
            "qwen3-30b-a3b",
            dict(
                vocab_size=151936,
                hidden_size=2048,
                moe_intermediate_size=768,
                num_hidden_layers=48,
                num_attention_heads=32,
                num_key_value_heads=4,
                head_dim=128,
                num_experts=128,
                num_experts_per_tok=8,
                norm_topk_prob=True,
                tie_word_embeddings=False,
            ),
        ),
        (
            "gpt-oss-20b",
            dict(
                vocab_size=201088,
                hidden_size=2880,
                intermediate_size=2880,
                num_hidden_layers=24,
                num_attention_heads=64,
                num_key_value_heads=8,
                head_dim=64,
                num_local_experts=32,
                num_experts_per_tok=4,
                sliding_window=128,
                attention_bias=True,
                swiglu_limit=7.0,
                max_position_embeddings=131072,
                tie_word_embeddings=False,
                layer_types=["sliding_attention", "full_attention"] * 12,
            ),
        ),
        (
            "gpt-oss-120b",
            dict(
                vocab_size=201088,
                hidden_size=2880,
                intermediate_size=2880,
                num_hidden_layers=36,
                num_attention_heads=64,
                num_key_value_heads=8,
                head_dim=64,
                num_local_experts=128,
                num_experts_per_tok=4,
                sliding_window=128,
                attention_bias=True,
                swiglu_limit=7.0,
                max_position_embeddings=131072,
                tie_word_embeddings=False,
                layer_types=["sliding_attention", "full_attention"] * 18,
            ),
        ),
    ],
)
def test_real_presets_have_published_shapes(name, expected):
    config = build_preset_config(name, {}, vocab_size=2048)
    for key, value in expected.items():
        assert getattr(config, key) == value, key
    theta = {"llama3-8b": 500_000.0, "llama3.2-3b": 500_000.0}.get(name, 150_000.0 if "gpt-oss" in name else 1_000_000.0)
    assert config.rope_parameters["rope_theta"] == theta
    if "gpt-oss" in name:  # the same YaRN as gpt-oss-20b
        assert config.rope_parameters == build_preset_config("gpt-oss-20b", {}, 2048).rope_parameters


def test_real_presets_count_their_published_parameters():
    from transformers import AutoModelForCausalLM

    expected = {"llama3-8b": 8.03e9, "llama3.2-3b": 3.21e9, "qwen3-8b": 8.19e9, "qwen3-30b-a3b": 30.53e9, "gpt-oss-20b": 20.91e9}
    expected["gpt-oss-120b"] = 116.83e9
    for name, count in expected.items():
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(build_preset_config(name, {}, 2048))
        assert abs(sum(p.numel() for p in model.parameters()) - count) / count < 0.005, name


def test_moe_presets_are_the_presets_with_experts():
    from hone.config.model import MOE_PRESETS

    with_experts = set()
    for name in PRESET_NAMES:
        config = build_preset_config(name, {}, 2048)
        if (getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or 0) > 0:
            with_experts.add(name)
    assert with_experts == set(MOE_PRESETS)


def test_gpt_oss_20b_rope_is_its_yarn_and_depth_overrides_keep_alternating_layers():
    config = build_preset_config("gpt-oss-20b", {}, vocab_size=2048)
    assert config.rope_parameters == {
        "rope_type": "yarn",
        "rope_theta": 150_000.0,
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
    }
    assert (
        build_preset_config("gpt-oss-20b", {"num_hidden_layers": 6}, 2048).layer_types
        == ["sliding_attention", "full_attention"] * 3
    )


def test_real_preset_keeps_its_vocab_but_refuses_a_larger_tokenizer():
    assert build_preset_config("qwen3-8b", {}, vocab_size=2048).vocab_size == 151936
    with pytest.raises(HoneError, match="151936 entries but the tokenizer has 200000 tokens"):
        build_preset_config("qwen3-8b", {}, vocab_size=200_000)


def test_overrides_set_config_fields():
    config = build_preset_config("tiny-llama", {"num_hidden_layers": 3, "rope_theta": 10_000.0}, 100)
    assert config.num_hidden_layers == 3
    assert config.rope_parameters["rope_theta"] == 10_000.0
    assert build_preset_config("tiny-qwen3-moe", {"num_experts": 4}, 100).num_experts == 4


def test_unknown_override_lists_the_valid_keys():
    with pytest.raises(HoneError) as info:
        build_preset_config("tiny-llama", {"num_hiden_layers": 3}, 100)
    text = str(info.value)
    assert "model.preset_overrides" in text and "'num_hiden_layers'" in text
    assert "num_hidden_layers" in text and "intermediate_size" in text
    assert "LlamaConfig" in text


def test_badly_typed_or_inconsistent_override_is_a_clear_error():
    with pytest.raises(HoneError, match="num_hidden_layers.*expected int"):
        build_preset_config("tiny-llama", {"num_hidden_layers": "eight"}, 100)
    with pytest.raises(HoneError, match="not a multiple of the number of attention heads"):
        build_preset_config("tiny-llama", {"num_attention_heads": 5}, 100)
    with pytest.raises(HoneError, match=r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)"):
        build_preset_config("tiny-qwen3", {"num_key_value_heads": 3}, 100)
    with pytest.raises(HoneError, match=r"num_experts_per_tok \(9\) must be between 1 and num_experts \(8\)"):
        build_preset_config("tiny-qwen3-moe", {"num_experts_per_tok": 9}, 100)


def _weights(model):
    return {name: p.detach().clone() for name, p in model.state_dict().items()}


def test_preset_init_is_deterministic_by_seed_and_leaves_the_global_rng_alone(tokenizer):
    cfg = ModelConfig(preset="tiny-qwen3")
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    a = _weights(build_preset_model(cfg, tokenizer, torch.device("cpu"), torch.float32, seed=5))
    assert torch.equal(torch.rand(3), expected_next)
    b = _weights(build_preset_model(cfg, tokenizer, torch.device("cpu"), torch.float32, seed=5))
    c = _weights(build_preset_model(cfg, tokenizer, torch.device("cpu"), torch.float32, seed=6))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a if a[k].is_floating_point() and a[k].std() > 0)


def test_tiny_preset_in_bf16_is_the_fp32_init_rounded(tokenizer):
    cfg = ModelConfig(preset="tiny-llama")
    full = build_preset_model(cfg, tokenizer, torch.device("cpu"), torch.float32, seed=1)
    half = build_preset_model(cfg, tokenizer, torch.device("cpu"), torch.bfloat16, seed=1)
    for (name, p32), (_, p16) in zip(full.named_parameters(), half.named_parameters()):
        assert p16.dtype == torch.bfloat16
        assert torch.equal(p32.to(torch.bfloat16), p16), name
    # RoPE frequencies stay float32 (rounding them to bf16 would shift every position)
    assert {b.dtype for b in half.buffers() if b.is_floating_point()} == {torch.float32}


def test_big_preset_is_built_in_the_target_dtype_with_tokenizer_special_tokens(tokenizer):
    overrides = {
        "num_hidden_layers": 1,
        "hidden_size": 64,
        "intermediate_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 4096,
    }
    cfg = ModelConfig(preset="llama3-8b", preset_overrides=overrides)
    model = build_preset_model(cfg, tokenizer, torch.device("cpu"), torch.bfloat16, seed=0)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.config.vocab_size == 4096
    assert model.config.eos_token_id == tokenizer.eos_token_id != 128001
    assert model.config.pad_token_id == tokenizer.pad_token_id


def test_gpt_oss_preset_is_built_in_the_target_dtype_with_the_sink_attention(tokenizer):
    from hone.models.attention.sinks import SINK_ATTENTION

    overrides = {
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "intermediate_size": 32,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_local_experts": 4,
        "vocab_size": 4096,
    }
    model = build_preset_model(
        ModelConfig(preset="gpt-oss-20b", preset_overrides=overrides), tokenizer, torch.device("cpu"), torch.bfloat16, seed=0
    )
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}  # sinks and expert biases too
    assert model.config._attn_implementation == SINK_ATTENTION
    assert model.config.layer_types == ["sliding_attention", "full_attention"]


def test_the_written_out_config_fields_match_transformers():
    """hone validate checks overrides against hone.models.preset_fields (no torch import): the
    names must be the installed transformers' own."""
    import transformers

    from hone.models.preset_fields import CONFIG_FIELDS, config_fields

    assert set(CONFIG_FIELDS) == {preset.config_name for preset in PRESETS.values()}
    for name, names in CONFIG_FIELDS.items():
        assert names == config_fields(getattr(transformers, name)), name
