"""Small builders for tests of model code: a tokenizer trained in memory, tiny saved models.

Tests never download; these give them real (if small) tokenizers and model directories in a
second. Kept in the package so unit and integration tests (and benchmarks' smoke tests) share
them without a conftest.
"""

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

from hone.config.model import PresetName
from hone.models.presets import build_preset_config

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A lemon is yellow and a lime is green.",
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.",
    "### Instruction:\n### Input:\n### Response:\n",
    "Fine-tuning adapts a pretrained language model to a new task with a little data.",
    "0 1 2 3 4 5 6 7 8 9 10 100 1000, red green blue; what? why! (yes) [no] {maybe}",
]


def tiny_tokenizer(vocab_size: int = 384) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with pad/bos/eos tokens and a chat template."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        chat_template=CHAT_TEMPLATE,
    )


def tiny_model(preset: PresetName, tokenizer, seed: int = 0, **overrides) -> PreTrainedModel:
    """A float32 model of a tiny preset with random weights drawn from ``seed``."""
    config = build_preset_config(preset, overrides, len(tokenizer))
    config.pad_token_id, config.bos_token_id, config.eos_token_id = (
        tokenizer.pad_token_id,
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def save_tiny_model(path: Path, preset: PresetName, tokenizer, seed: int = 0, **overrides) -> Path:
    """Write a tiny model and its tokenizer as a save_pretrained directory (safetensors)."""
    model = tiny_model(preset, tokenizer, seed, **overrides)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return Path(path)


def with_random_lora(model: PreTrainedModel, seed: int, rank: int = 4):
    """``model`` with LoRA on every linear layer, its B matrices random instead of PEFT's zeros
    (zero B makes every A gradient zero, and a gradient test of zeros cannot fail)."""
    from hone.config.adapter import AdapterConfig
    from hone.models.adapters import apply_adapter

    model = apply_adapter(model, AdapterConfig(type="lora", lora_r=rank, lora_target_modules="all-linear"))
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data = torch.randn(param.shape, generator=gen) * 0.1
    return model
