"""Builders for tests of the training loop: a tiny Llama, random token rows, a config.

Nothing is downloaded; everything is made from seeds in well under a second. Kept in the
package (like :mod:`hone.models.testing`) so unit and integration tests share them.
"""

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import LlamaForCausalLM

from hone.config.root import HoneConfig
from hone.models.presets import build_preset_config

if TYPE_CHECKING:
    from datasets import Dataset

VOCAB = 97


def tiny_llama(seed: int = 0, *, vocab: int = VOCAB, dropout: float = 0.0, freeze_embeddings: bool = True) -> LlamaForCausalLM:
    """A 2-layer float32 Llama with random weights drawn from ``seed``.

    ``freeze_embeddings`` leaves the input embedding frozen, so the trainable set is a strict
    subset of the weights (as with adapters) and checkpoints must restore only that subset.
    """
    # the tiny-llama preset, narrower still: loop tests build hundreds of these
    overrides = dict(hidden_size=32, intermediate_size=64, head_dim=8, max_position_embeddings=128, attention_dropout=dropout)
    config = build_preset_config("tiny-llama", overrides, vocab)
    config.pad_token_id = 0
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


def random_documents(lengths: Sequence[int], seed: int) -> list[dict[str, list[int]]]:
    """Documents of random token ids with ``lengths``, labelled as prepared rows are (a
    document's first token has nothing before it to be predicted from)."""
    gen = torch.Generator().manual_seed(seed)
    docs = []
    for length in lengths:
        ids = torch.randint(7, 300, (length,), generator=gen).tolist()
        docs.append({"input_ids": ids, "labels": [-100] + ids[1:]})
    return docs


def packed_document_logits(
    model: torch.nn.Module,
    docs: Sequence[dict[str, list[int]]],
    bins: Sequence[Sequence[int]],
    width: int,
    autocast_dtype: torch.dtype | None = None,
) -> dict[int, torch.Tensor]:
    """Each document's logits from one packed forward (``bins[r]``: the documents of row ``r``)
    through the loop's own forward, so the mask or boundaries training hands the model are
    what a parity test checks."""
    from hone.train.collate import collate_packed
    from hone.train.loss import forward_logits

    device = next(model.parameters()).device
    batch = collate_packed([[docs[i] for i in b] for b in bins], width, pad_id=0).to(device)
    out = forward_logits(model, batch, autocast_dtype)
    pieces = {}
    for row, b in enumerate(bins):
        at = 0
        for i in b:
            n = len(docs[i]["input_ids"])
            pieces[i] = out[row, at : at + n]
            at += n
    return pieces


def document_logits_alone(model: torch.nn.Module, doc: dict[str, list[int]]) -> torch.Tensor:
    """One document's logits on its own. The explicit all-ones mask sends hone's varlen sdpa
    down transformers' sdpa path, so a parity test's reference is never the code under test."""
    ids = torch.tensor([doc["input_ids"]], device=next(model.parameters()).device)
    return model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits[0]


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


def run_hooks(model: torch.nn.Module, loss: str = "standard", device: str = "cpu"):
    """The hooks the plan gives the loop for ``model`` (loss function, attention layout), drawn
    up through the planner as a run would, with ``performance.loss: loss``."""
    from hone.transforms.base import RunFacts
    from hone.transforms.planner import plan_optimizations

    cfg = tiny_config(Path("unused"), performance={"loss": loss})
    facts = RunFacts(torch.device(device))
    return plan_optimizations(cfg, facts).hooks(model, cfg, facts)
