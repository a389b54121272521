"""Every tiny architecture, saved as a real model directory, loads and trains through hone.

One forward/backward per (architecture, adapter) in float32: the loss is finite, every
trainable weight gets a non-zero gradient, and no frozen weight gets one. Plus one tiny bf16
LoRA step under the autocast the loader asks for.
"""

from pathlib import Path

import pytest
import torch

from hone.config import parse_config
from hone.models.loader import load_model
from hone.testing import save_tiny_model, tiny_tokenizer

ARCHITECTURES = ["tiny-llama", "tiny-qwen3", "tiny-mistral", "tiny-gemma", "tiny-qwen3-moe"]
MODEL_CLASSES = {
    "tiny-llama": "LlamaForCausalLM",
    "tiny-qwen3": "Qwen3ForCausalLM",
    "tiny-mistral": "MistralForCausalLM",
    "tiny-gemma": "Gemma3ForCausalLM",
    "tiny-qwen3-moe": "Qwen3MoeForCausalLM",
}


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, tokenizer) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("architectures")
    return {name: save_tiny_model(root / name, name, tokenizer, seed=i) for i, name in enumerate(ARCHITECTURES)}


def cfg_for(path: Path, adapter, dtype: str = "float32", **memory):
    return parse_config(
        {
            "model": {"path": str(path), "dtype": dtype},
            "data": {"datasets": [{"path": "d.jsonl", "type": "completion"}]},
            "adapter": adapter,
            "memory": memory,
        }
    )


def randomize_lora_b(model) -> None:
    """LoRA B starts at zero, which zeroes A's gradient; give it a value so both must get one."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn_like(param) * 0.02)


def assert_gradients_only_on_trainable(model) -> None:
    for name, param in model.named_parameters():
        if param.requires_grad:
            assert param.grad is not None, f"{name}: trainable but no gradient"
            assert torch.isfinite(param.grad).all(), name
            assert param.grad.abs().sum() > 0, f"{name}: zero gradient"
        else:
            assert param.grad is None, f"{name}: frozen but has a gradient"


@pytest.mark.parametrize("adapter", ["lora", "none"])
@pytest.mark.parametrize("name", ARCHITECTURES)
def test_forward_backward(name, adapter, model_dirs, tokenizer):
    loaded = load_model(cfg_for(model_dirs[name], adapter), tokenizer, "cpu")
    model = loaded.model
    base = model.get_base_model() if adapter == "lora" else model
    assert type(base).__name__ == MODEL_CLASSES[name]
    assert model.training
    randomize_lora_b(model)
    generator = torch.Generator().manual_seed(hash(name) % 2**31)
    ids = torch.randint(0, len(tokenizer), (2, 24), generator=generator)
    loss = model(input_ids=ids, labels=ids).loss
    assert torch.isfinite(loss)
    loss.backward()
    assert_gradients_only_on_trainable(model)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert loaded.trainable_params == trainable
    if adapter == "none":
        assert trainable == loaded.total_params
    else:
        assert 0 < trainable < loaded.total_params


@pytest.mark.parametrize("name", ["tiny-gemma", "tiny-qwen3-moe"])
def test_lora_with_checkpointing_trains_the_adapters(name, model_dirs, tokenizer):
    loaded = load_model(cfg_for(model_dirs[name], "lora", gradient_checkpointing=True), tokenizer, "cpu")
    randomize_lora_b(loaded.model)
    ids = torch.randint(0, len(tokenizer), (2, 16))
    loaded.model(input_ids=ids, labels=ids).loss.backward()
    assert_gradients_only_on_trainable(loaded.model)


def test_bf16_lora_step_under_autocast(model_dirs, tokenizer):
    loaded = load_model(cfg_for(model_dirs["tiny-qwen3"], "lora", dtype="bfloat16"), tokenizer, "cpu")
    assert loaded.autocast_dtype == torch.bfloat16
    randomize_lora_b(loaded.model)
    ids = torch.randint(0, len(tokenizer), (1, 8))
    with torch.autocast("cpu", dtype=loaded.autocast_dtype):
        logits = loaded.model(input_ids=ids).logits
    loss = torch.nn.functional.cross_entropy(logits.float()[0, :-1], ids[0, 1:])
    assert torch.isfinite(loss)
    loss.backward()
    assert_gradients_only_on_trainable(loaded.model)
    assert all(p.grad.dtype == torch.float32 for p in loaded.model.parameters() if p.requires_grad)
