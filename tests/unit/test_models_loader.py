"""Loading models: directory checks, dtype convention, checkpointing, counts, description."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from hone.config import HoneConfig, parse_config
from hone.errors import HoneError
from hone.models.loader import load_model
from hone.models.precision import precision_for
from hone.testing import save_tiny_model, tiny_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory, tokenizer) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("models") / "llama", "tiny-llama", tokenizer, seed=3)


def make_cfg(model: dict, adapter="lora", **sections) -> HoneConfig:
    raw = {"model": model, "data": {"datasets": [{"path": "d.jsonl", "type": "completion"}]}, "adapter": adapter}
    raw.update(sections)
    return parse_config(raw)


def load_error(path: Path, tokenizer, **model) -> str:
    with pytest.raises(HoneError) as info:
        load_model(make_cfg({"path": str(path), "dtype": "float32", **model}), tokenizer, "cpu")
    return str(info.value)


# ----------------------------------------------------------------- bad directories


def test_missing_directory(tmp_path, tokenizer):
    text = load_error(tmp_path / "nope", tokenizer)
    assert "model.path" in text and "does not exist" in text and "never downloads" in text


def test_file_instead_of_directory(tmp_path, tokenizer):
    (tmp_path / "weights.safetensors").write_bytes(b"x")
    assert "is a file" in load_error(tmp_path / "weights.safetensors", tokenizer)


def test_directory_without_config(tmp_path, tokenizer):
    text = load_error(tmp_path, tokenizer)
    assert "has no config.json" in text and str(tmp_path) in text


def test_adapter_directory_is_recognised(tmp_path, tokenizer):
    (tmp_path / "adapter_config.json").write_text("{}")
    text = load_error(tmp_path, tokenizer)
    assert "PEFT adapter" in text and "hone merge" in text


def test_pickle_only_weights_are_refused_before_loading(tmp_path, llama_dir, tokenizer):
    (tmp_path / "config.json").write_text((llama_dir / "config.json").read_text())
    (tmp_path / "pytorch_model.bin").write_bytes(b"not even a pickle")
    text = load_error(tmp_path, tokenizer)
    assert "pytorch_model.bin" in text and "safetensors only" in text
    assert "arbitrary code" in text and "save_pretrained" in text


def test_config_without_weights(tmp_path, llama_dir, tokenizer):
    (tmp_path / "config.json").write_text((llama_dir / "config.json").read_text())
    assert "no weights" in load_error(tmp_path, tokenizer)


def test_non_causal_model_type(tmp_path, tokenizer):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5", "d_model": 32}))
    save_file({"w": torch.randn(2, 2)}, str(tmp_path / "model.safetensors"))
    text = load_error(tmp_path, tokenizer)
    assert "model_type 't5'" in text and "not a causal language model" in text


def test_remote_code_needs_trust(tmp_path, llama_dir, tokenizer):
    config = json.loads((llama_dir / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file({"w": torch.randn(2, 2)}, str(tmp_path / "model.safetensors"))
    assert "trust_remote_code" in load_error(tmp_path, tokenizer)


def test_incomplete_weights_are_refused(tmp_path, llama_dir, tokenizer):
    from safetensors.torch import load_file

    (tmp_path / "config.json").write_text((llama_dir / "config.json").read_text())
    weights = load_file(str(llama_dir / "model.safetensors"))
    dropped = "model.layers.1.mlp.down_proj.weight"
    del weights[dropped]
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    text = load_error(tmp_path, tokenizer)
    assert dropped in text and "random" in text


def test_tokenizer_larger_than_embedding(tmp_path, tokenizer):
    small = save_tiny_model(tmp_path / "small", "tiny-llama", tiny_tokenizer(vocab_size=300))
    text = load_error(small, tokenizer)
    assert f"{len(tokenizer)} tokens" in text and "300 rows" in text


# ----------------------------------------------------------------- what comes out


def test_lora_load_counts_describes_and_trains(llama_dir, tokenizer):
    loaded = load_model(make_cfg({"path": str(llama_dir), "dtype": "float32"}), tokenizer, "cpu")
    model = loaded.model
    assert model.training
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert loaded.trainable_params == trainable > 0
    assert loaded.total_params == sum(p.numel() for p in model.parameters()) > trainable
    assert all(("lora_" in n) == p.requires_grad for n, p in model.named_parameters())
    assert "\n" not in loaded.description
    for part in ("LlamaForCausalLM", str(llama_dir), "LoRA r=16", "trainable", "float32"):
        assert part in loaded.description
    assert loaded.autocast_dtype is None


def test_path_model_loads_the_saved_weights(llama_dir, tokenizer):
    from safetensors.torch import load_file

    saved = load_file(str(llama_dir / "model.safetensors"))
    loaded = load_model(make_cfg({"path": str(llama_dir), "dtype": "float32"}, adapter="none"), tokenizer, "cpu")
    state = loaded.model.state_dict()
    for name, tensor in saved.items():
        assert torch.equal(state[name], tensor), name


def test_attn_implementation_reaches_the_model(llama_dir, tokenizer):
    loaded = load_model(make_cfg({"path": str(llama_dir), "dtype": "float32", "attn_implementation": "eager"}), tokenizer, "cpu")
    assert loaded.model.config._attn_implementation == "eager"


@pytest.mark.parametrize(
    "dtype, adapter, weights, trainable, autocast",
    [
        ("float32", "lora", torch.float32, torch.float32, None),
        ("bfloat16", "lora", torch.bfloat16, torch.float32, torch.bfloat16),
        ("float16", "lora", torch.float16, torch.float32, torch.float16),
        ("bfloat16", "none", torch.bfloat16, torch.bfloat16, None),
        ("float16", "none", torch.float32, torch.float32, torch.float16),
    ],
)
def test_precision_convention(dtype, adapter, weights, trainable, autocast, tokenizer):
    precision = precision_for(dtype, full_finetune=adapter == "none")
    assert (precision.weights, precision.trainable, precision.autocast_dtype) == (weights, trainable, autocast)
    cfg = make_cfg({"preset": "tiny-llama", "dtype": dtype}, adapter=adapter)
    loaded = load_model(cfg, tokenizer, "cpu")
    assert loaded.autocast_dtype == autocast
    for name, param in loaded.model.named_parameters():
        assert param.dtype == (trainable if param.requires_grad else weights), name


def test_bf16_lora_with_a_saved_head_trains_under_autocast(tokenizer):
    cfg = make_cfg({"preset": "tiny-llama", "dtype": "bfloat16"}, adapter={"lora_modules_to_save": ["lm_head"]})
    loaded = load_model(cfg, tokenizer, "cpu")
    head = [p for n, p in loaded.model.named_parameters() if "lm_head.modules_to_save" in n]
    assert head and head[0].dtype == torch.float32 and head[0].requires_grad
    ids = torch.randint(0, len(tokenizer), (1, 8))
    with torch.autocast("cpu", dtype=loaded.autocast_dtype):
        loss = loaded.model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss) and head[0].grad is not None and head[0].grad.abs().sum() > 0


def test_adapter_init_is_deterministic_by_seed(tokenizer):
    def lora_weights(seed):
        cfg = make_cfg({"preset": "tiny-llama", "dtype": "float32"}, training={"seed": seed})
        model = load_model(cfg, tokenizer, "cpu").model
        return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_A" in n}

    a, b, c = lora_weights(1), lora_weights(1), lora_weights(2)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert all(not torch.equal(a[n], c[n]) for n in a)


@pytest.mark.parametrize("adapter", ["lora", "none"])
def test_the_loader_applies_no_optimization(adapter, tokenizer):
    """Checkpointing and the attention kernel are transforms of the plan (their parity tests are
    in test_checkpointing.py and test_varlen_attention.py); the loader leaves the model plain."""
    cfg = make_cfg({"preset": "tiny-qwen3", "dtype": "float32"}, adapter=adapter, memory={"activation_checkpointing": "full"})
    seen = []
    loaded = load_model(cfg, tokenizer, "cpu", before_adapter=seen.append)
    base = loaded.model.get_base_model() if adapter == "lora" else loaded.model
    assert seen == [base]  # the plan's base-stage transforms get the base model, before the adapter
    assert not any(getattr(m, "gradient_checkpointing", False) for m in base.modules())
    assert base.config._attn_implementation == "sdpa"
