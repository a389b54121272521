"""The context-parallel parity cases (tests/distributed/test_context_parallel.py): a tiny fp32
model and one micro-batch, the same in every process (seeded); the one-process loss sum and
gradients on the whole micro-batch; and one rank's loss sum and gradients on its shard
(:func:`hone.parallel.context_parallel.shard_micro_batch`) through the wrapped attention
(:func:`hone.models.attention.ulysses.enable_context_parallel`), summed over the ranks."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from hone.data.collate import MicroBatch, collate, collate_packed
from hone.models.attention.causal import register_causal_sdpa
from hone.models.attention.layout import layout_for
from hone.models.attention.ulysses import enable_context_parallel
from hone.models.attention.varlen import register_varlen_sdpa
from hone.models.presets import build_preset_config
from hone.parallel.context_parallel import ContextShard, shard_micro_batch
from hone.runtime.loss import standard_loss
from hone.runtime.step import micro_batch_loss
from hone.testing import with_random_lora

VOCAB = 64
WIDTH = 16  # the micro-batch's sequence length: a multiple of 2 and 4
#: Rows of different lengths, padded on the right to WIDTH.
PADDED_LENGTHS = (16, 11, 6)
#: Packed rows: the documents of each row (the first row ends in a padding tail of 2 tokens).
PACKED_BINS = ((5, 6, 3), (9, 7))


@dataclass(frozen=True)
class Case:
    preset: str  # tiny-qwen3 / tiny-llama
    trained: str  # lora / full
    rows: str  # padded / packed
    attention: str  # the kernel the wrapper calls: sdpa, causal (hone's), varlen (hone's, its CPU reference)
    size: int = 2
    heads: int = 4
    kv_heads: int = 2
    checkpointed: bool = False  # activation checkpointing: the backward recomputes each layer, exchanges included

    @property
    def name(self) -> str:
        return f"{self.preset}-{self.trained}-{self.rows}-{self.attention}-cp{self.size}" + ("-ckpt" if self.checkpointed else "")


CASES_2 = [
    Case("tiny-qwen3", "lora", "padded", "sdpa"),
    Case("tiny-qwen3", "full", "packed", "sdpa"),  # hone's dense document mask over the whole sequence
    Case("tiny-qwen3", "lora", "packed", "causal"),  # the same mask through hone's causal sdpa
    Case("tiny-llama", "lora", "packed", "varlen"),  # whole-sequence boundaries
    Case("tiny-llama", "full", "padded", "causal"),
    Case("tiny-llama", "lora", "padded", "varlen"),  # no boundaries: causal sdpa
    Case("tiny-qwen3", "full", "packed", "varlen", checkpointed=True),
]
#: Four ranks need four key/value heads: 8 query heads in groups of 2 (grouped-query attention).
CASES_4 = [
    Case("tiny-qwen3", "lora", "packed", "sdpa", size=4, heads=8, kv_heads=4),
    Case("tiny-llama", "full", "padded", "causal", size=4, heads=8, kv_heads=4),
    Case("tiny-qwen3", "full", "padded", "sdpa", size=4, heads=4, kv_heads=4),
]
CASES = {case.name: case for case in CASES_2 + CASES_4}


def seed_of(case: Case) -> int:
    return sorted(CASES).index(case.name)


def build_model(case: Case) -> torch.nn.Module:
    """The case's model (fp32, eval mode: no dropout anywhere), the same in every process."""
    overrides = dict(num_attention_heads=case.heads, num_key_value_heads=case.kv_heads, head_dim=8, max_position_embeddings=64)
    config = build_preset_config(case.preset, overrides, VOCAB)
    config.pad_token_id = 0
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed_of(case))
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if case.attention == "causal":
        model.set_attn_implementation(register_causal_sdpa())
    elif case.attention == "varlen":
        model.set_attn_implementation(register_varlen_sdpa())
    else:
        model.set_attn_implementation("sdpa")
    if case.trained == "lora":
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed_of(case) + 100)  # PEFT draws the A factors from the global generator
            model = with_random_lora(model, seed=seed_of(case) + 100)
    else:
        for param in model.parameters():
            param.requires_grad_(True)
    if case.checkpointed:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.eval()


def _row(gen: torch.Generator, length: int, prompt: int) -> dict[str, list[int]]:
    ids = torch.randint(1, VOCAB, (length,), generator=gen).tolist()
    return {"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]}


def make_batch(case: Case) -> MicroBatch:
    """The case's micro-batch: fresh random tokens, prompts masked, the same in every process."""
    gen = torch.Generator().manual_seed(1000 + seed_of(case))
    if case.rows == "padded":
        rows = [_row(gen, n, prompt=int(torch.randint(0, 4, (1,), generator=gen))) for n in PADDED_LENGTHS]
        return collate(rows, pad_id=0)
    bins = [[_row(gen, n, prompt=int(torch.randint(0, 2, (1,), generator=gen))) for n in docs] for docs in PACKED_BINS]
    return collate_packed(bins, WIDTH, pad_id=0)


def trainable(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def loss_and_grads(model: torch.nn.Module, batch: MicroBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The batch's token-loss sum and the gradients of the trainable parameters (the loop's own loss)."""
    loss = micro_batch_loss(model, batch, standard_loss())
    loss.backward()
    return loss.detach(), {name: p.grad.detach().clone() for name, p in trainable(model).items()}


def reference(case: Case) -> dict:
    """One process on the whole micro-batch."""
    model = build_model(case)
    batch = make_batch(case).with_attention(layout_for(model))
    loss, grads = loss_and_grads(model, batch)
    return {"loss": loss, "grads": grads, "trained": batch.trained_tokens, "tokens": batch.tokens}


def rank_run(case: Case, wrapped: bool = True) -> dict:
    """This rank's shard through the context-parallel model, loss, gradients and counts summed
    over the ranks (as the run's all-reduces do). ``wrapped=False`` is the control: the same
    shards through the plain model, each rank attending over its own slice only."""
    shard = ContextShard.of_group()
    assert shard.size == case.size, (shard.size, case.size)
    model = build_model(case)
    record = enable_context_parallel(model, shard) if wrapped else {}
    batch = make_batch(case).with_attention(layout_for(model))
    mine = shard_micro_batch(batch, shard)
    loss, grads = loss_and_grads(model, mine)
    counts = torch.tensor([mine.trained_tokens, mine.tokens])
    for t in (loss, counts, *grads.values()):
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return {"loss": loss, "grads": grads, "trained": int(counts[0]), "tokens": int(counts[1]), "record": record}
