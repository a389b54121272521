"""``model.rope_scaling``: set on the transformers config of a preset or a model directory before
the model is built, read by ``hone validate``'s sequence-length check and by ``hone plan``."""

import pytest
import torch
import yaml

from hone.cli import main
from hone.config import ConfigError, parse_config
from hone.config.model import ModelConfig
from hone.models.loader import build_base_model
from hone.models.presets import build_preset_config
from hone.models.rope_scaling import with_rope_scaling
from hone.preflight import run_preflight
from hone.testing import save_tiny_model

YARN4 = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}


def _build(tokenizer, **model):
    cfg = ModelConfig(dtype="float32", **model)
    return build_base_model(cfg, tokenizer, torch.device("cpu"), torch.float32, seed=0)


def test_preset_model_is_built_with_the_scaling(tokenizer):
    plain = _build(tokenizer, preset="tiny-qwen3")
    scaled = _build(tokenizer, preset="tiny-qwen3", rope_scaling=YARN4)
    params = scaled.config.rope_parameters
    assert (params["rope_type"], params["factor"], params["original_max_position_embeddings"]) == ("yarn", 4.0, 2048)
    assert params["rope_theta"] == plain.config.rope_parameters["rope_theta"] == 1_000_000.0
    assert scaled.config.max_position_embeddings == 8192 == 2048 * 4
    # the rotary embedding computes YaRN's frequencies and logit scale; the weights are the same draws
    assert scaled.model.rotary_emb.rope_type == "yarn" and scaled.model.rotary_emb.attention_scaling > 1.0
    assert not torch.equal(scaled.model.rotary_emb.inv_freq, plain.model.rotary_emb.inv_freq)
    for (name, a), (_, b) in zip(plain.named_parameters(), scaled.named_parameters(), strict=True):
        assert torch.equal(a, b), name


def test_model_directory_is_loaded_with_the_scaling(tokenizer, tmp_path):
    path = save_tiny_model(tmp_path / "m", "tiny-llama", tokenizer)
    plain = _build(tokenizer, path=path)
    scaled = _build(tokenizer, path=path, rope_scaling={"type": "linear", "factor": 2.0})
    assert scaled.config.rope_parameters["rope_type"] == "linear" and scaled.config.max_position_embeddings == 2 * 8192
    assert plain.config.rope_parameters["rope_type"] == "default"
    ids = torch.arange(1, 33).unsqueeze(0)
    with torch.no_grad():
        # position 0 rotates by nothing either way; later positions rotate by half the angle
        a, b = plain(ids).logits, scaled(ids).logits
    torch.testing.assert_close(a[0, 0], b[0, 0])
    assert not torch.allclose(a[0, 1:], b[0, 1:])


def test_scaling_replaces_the_configs_own_and_keeps_its_pretraining_length():
    config = build_preset_config("gpt-oss-20b", {}, None)  # YaRN x32 over 4096
    scaling = ModelConfig(preset="gpt-oss-20b", rope_scaling={"type": "yarn", "factor": 64}).rope_scaling
    params = with_rope_scaling(config, scaling).rope_parameters
    assert (params["factor"], params["original_max_position_embeddings"], params["rope_theta"]) == (64.0, 4096, 150_000.0)
    assert config.max_position_embeddings == 64 * 4096


def test_llama3_defaults_and_an_explicit_length():
    scaling = ModelConfig(
        preset="llama3-8b", rope_scaling={"type": "llama3", "factor": 8, "max_position_embeddings": 100_000}
    ).rope_scaling
    config = with_rope_scaling(build_preset_config("llama3-8b", {}, None), scaling)
    assert config.rope_parameters["low_freq_factor"] == 1.0 and config.rope_parameters["high_freq_factor"] == 4.0
    assert config.rope_parameters["original_max_position_embeddings"] == 8192
    assert config.max_position_embeddings == 100_000


def test_per_layer_type_rope_scales_the_full_attention_layers_only():
    config = build_preset_config("tiny-gemma", {}, 300)
    scaling = ModelConfig(preset="tiny-gemma", rope_scaling={"type": "linear", "factor": 8}).rope_scaling
    params = with_rope_scaling(config, scaling).rope_parameters
    assert params["full_attention"]["rope_type"] == "linear" and params["sliding_attention"]["rope_type"] == "default"


def test_raw_config_of_a_remote_code_model_gets_the_scaling_too():
    scaling = ModelConfig(preset="tiny-llama", rope_scaling=YARN4).rope_scaling
    raw = with_rope_scaling({"model_type": "custom", "max_position_embeddings": 2048}, scaling)
    assert raw["max_position_embeddings"] == 8192 and raw["rope_scaling"]["type"] == "yarn"


@pytest.mark.parametrize(
    ("scaling", "words"),
    [
        ({"type": "yarn", "factor": 1.0}, ["rope_scaling.factor", "greater than 1"]),
        ({"type": "ntk", "factor": 2.0}, ["rope_scaling.type", "yarn"]),
        ({"type": "dynamic", "factor": 2.0}, ["rope_scaling.type", "linear"]),  # reads the raised length as the original
        ({"factor": 2.0}, ["rope_scaling.type"]),
        ({"type": "linear", "factor": 2.0, "beta_fast": 8}, ["beta_fast applies to type: yarn", "'linear'"]),
        ({"type": "yarn", "factor": 2.0, "beta_fast": 1, "beta_slow": 2}, ["beta_fast (1.0) must be greater than beta_slow"]),
        ({"type": "llama3", "factor": 8, "low_freq_factor": 4}, ["high_freq_factor (4.0) must be greater"]),
        ({"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 0}, ["original_max_position_embeddings"]),
        ({"type": "yarn", "factor": 2.0, "scale": 3}, ["rope_scaling.scale"]),
    ],
)
def test_bad_scaling_is_refused_naming_the_key(scaling, words):
    with pytest.raises(ConfigError) as info:
        parse_config({"model": {"preset": "qwen3-8b", "rope_scaling": scaling}, "data": {"datasets": [{"path": "x.jsonl"}]}})
    for word in words:
        assert word in str(info.value)


def _long_config(tmp_path, write_jsonl, **model):
    data = write_jsonl(tmp_path, [{"text": "a b c"}])
    raw = {
        "model": {"preset": "qwen3-8b", **model},
        "data": {"datasets": [{"path": str(data), "type": "completion"}], "sequence_len": 131072},
        "training": {"output_dir": str(tmp_path / "run")},
    }
    path = tmp_path / "long.yml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_validate_accepts_the_extended_length_and_refuses_it_without_scaling(tmp_path, write_jsonl, capsys):
    without = _long_config(tmp_path, write_jsonl)
    assert main(["validate", str(without)]) == 2
    err = capsys.readouterr().err
    assert "131072 is longer than the 40960 positions" in err and "model.rope_scaling" in err
    scaled = _long_config(tmp_path, write_jsonl, rope_scaling={**YARN4, "original_max_position_embeddings": 32768})
    assert main(["validate", str(scaled)]) == 0
    assert "warning" not in capsys.readouterr().err


def test_a_length_beyond_the_scaled_positions_is_refused_naming_the_factor(tmp_path, write_jsonl):
    cfg = parse_config(
        yaml.safe_load(_long_config(tmp_path, write_jsonl, rope_scaling={"type": "yarn", "factor": 2.0}).read_text())
    )
    issues = run_preflight(cfg).issues
    assert [i.path for i in issues] == ["data.sequence_len"]
    assert "81920 positions model.rope_scaling gives (yarn, factor 2)" in issues[0].message
    assert "factor to at least 3.2" in issues[0].message


def test_plan_reads_the_scaled_positions(tmp_path, write_jsonl):
    from hone.transforms.memory.facts import model_facts

    cfg = parse_config(yaml.safe_load(_long_config(tmp_path, write_jsonl, rope_scaling=YARN4).read_text()))
    assert model_facts(cfg).max_positions == 8192
