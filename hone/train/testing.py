"""Builders for tests of the training loop: a tiny Llama, random token rows, a config.

Nothing is downloaded; everything is made from seeds in well under a second. Kept in the
package (like :mod:`hone.models.testing`) so unit and integration tests share them.
"""

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hone.config.root import HoneConfig

if TYPE_CHECKING:
    from datasets import Dataset

VOCAB = 97


def tiny_llama(seed: int = 0, *, vocab: int = VOCAB, dropout: float = 0.0, freeze_embeddings: bool = True) -> LlamaForCausalLM:
    """A 2-layer float32 Llama with random weights drawn from ``seed``.

    ``freeze_embeddings`` leaves the input embedding frozen, so the trainable set is a strict
    subset of the weights (as with adapters) and checkpoints must restore only that subset.
    """
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        attention_dropout=dropout,
        tie_word_embeddings=False,
        pad_token_id=0,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.config._attn_implementation = "eager"
    if freeze_embeddings:
        model.get_input_embeddings().weight.requires_grad_(False)
    return model


def random_rows(
    n: int,
    *,
    seed: int,
    vocab: int = VOCAB,
    min_len: int = 5,
    max_len: int = 24,
    prompt_frac: float = 0.3,
    as_list: bool = False,
) -> "Dataset | list[dict[str, list[int]]]":
    """``n`` rows of random tokens with unequal lengths; a random-length prompt prefix is
    masked (-100) as an instruction dataset's would be. A ``datasets.Dataset``, or a plain
    list of row dicts with ``as_list`` (the loop accepts both)."""
    gen = torch.Generator().manual_seed(seed)
    ids, labels = [], []
    for _ in range(n):
        length = int(torch.randint(min_len, max_len + 1, (1,), generator=gen))
        row = torch.randint(1, vocab, (length,), generator=gen).tolist()
        prompt = int(torch.randint(0, max(1, int(length * prompt_frac)) + 1, (1,), generator=gen))
        ids.append(row)
        labels.append([-100] * prompt + row[prompt:])
    if as_list:
        return [{"input_ids": i, "labels": l} for i, l in zip(ids, labels)]  # noqa: E741
    from datasets import Dataset

    return Dataset.from_dict({"input_ids": ids, "labels": labels})


def tiny_config(output_dir: Path, **sections: dict[str, Any]) -> HoneConfig:
    """A valid config for loop tests: fp32, no adapter, plain console output, tiny intervals.

    ``sections`` override keys per section, e.g. ``training={"max_steps": 3}``.
    """
    raw: dict[str, Any] = {
        "model": {"preset": "tiny-llama", "dtype": "float32"},
        "data": {"datasets": [{"path": "unused.jsonl", "type": "pretokenized"}], "sequence_len": 64},
        "adapter": {"type": "none"},
        "training": {"output_dir": str(output_dir), "max_steps": 4, "micro_batch_size": 2, "seed": 7},
        "optimizer": {"learning_rate": 1e-2, "lr_scheduler": "constant", "fused": False},
        "logging": {"tensorboard": False, "plot": False, "progress_bar": False},
    }
    for section, values in sections.items():
        raw[section] = {**raw.get(section, {}), **values}
        if section == "training" and "num_epochs" in values:
            raw["training"].pop("max_steps", None)
    return HoneConfig.model_validate(raw)
