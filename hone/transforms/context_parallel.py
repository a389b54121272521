"""Context parallelism as a transform: each sequence split along its length over ``N`` ranks.

``distributed.context_parallel: N`` (N > 1, on W processes, N dividing W) forms ``W / N`` groups
of ``N`` consecutive ranks (:func:`hone.parallel.groups.context_group`). The ranks of a group read
the same micro-batches (data parallelism runs over the ``W / N`` groups:
:meth:`hone.runtime.world.World.data_parallel`), and each keeps its contiguous ``1/N`` of every
row (:func:`hone.parallel.context_parallel.shard_micro_batch`, applied by this transform's
``micro_batch`` hook after the batch got its whole-sequence attention inputs, so packed documents
keep their isolation, and before the window's tokens are counted, so the global trained-token
count sums the shards). Projections, MLP, norms, RoPE (global positions) and the loss run on the
shard; each attention exchanges heads for tokens around the run's kernel (DeepSpeed-Ulysses:
:func:`hone.models.attention.ulysses.enable_context_parallel`), so it sees the whole sequence for
``H / N`` heads. Why Ulysses rather than ring attention: any kernel keeps working unchanged (sdpa,
hone's packed mask, varlen, flash) and the causal load is balanced by construction; the price is
that ``N`` must divide the key/value heads (8 on qwen3-8b: up to 8 GPUs).

The math is one process's: the loss of a group is the sum of its ranks' shard losses, each
rank's backward sends the exchanged gradients back to their owners, and DDP or FSDP2 sums every
rank's gradients (SUM, over all ``W`` ranks: :mod:`hone.transforms.data_parallel`), each divided
by the global trained-token count. Unpacked micro-batches are padded at the end of each row to a
multiple of ``N`` (:func:`pad_rows`): the padding is masked from the loss and, attention being
causal, no real token sees it, so nothing changes but the width. Packed rows are
``data.sequence_len`` wide, which the config requires to be a multiple of ``N``.

Refused (besides the config's validators: expert parallelism, explicit tiled layers): a model
whose heads ``N`` does not divide or whose attention the exchange cannot wrap
(:func:`hone.models.attention.ulysses.context_parallel_problems`), and tiled layers chosen by
``auto`` (a chunk of a rank's shard is not a contiguous piece of the sequence).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hone.config.root import HoneConfig
from hone.data.collate import MicroBatch
from hone.models.attention.ulysses import context_parallel_problems, enable_context_parallel
from hone.parallel.context_parallel import ContextShard, shard_micro_batch
from hone.parallel.groups import context_group
from hone.transforms.base import PlanContext, RunFacts, Transform
from hone.transforms.card import host_memory
from hone.transforms.memory.facts import transformers_config


def per_rank_config(cfg: HoneConfig) -> HoneConfig:
    """``cfg`` as the ``auto`` memory decisions (checkpointing, tiled MLP shards, the offload
    split) see it under context parallelism: tiled layers off (``auto`` never picks what context
    parallelism refuses). The config keeps ``N``: each decision counts one rank's shard of the
    tokens (:meth:`~hone.config.root.HoneConfig.micro_batch_tokens_per_rank`, and the estimate's
    :class:`~hone.transforms.memory.knobs.Knobs`), and the estimate adds what the exchanges
    around attention keep (a compiled layer saves every collective's output whatever its memory
    budget: :class:`~hone.transforms.memory.step.Step`)."""
    if cfg.distributed.context_parallel <= 1:
        return cfg
    return cfg.model_copy(update={"memory": cfg.memory.model_copy(update={"tiled_layers": "off"})})


def per_rank_facts(cfg: HoneConfig, facts: RunFacts) -> RunFacts:
    """``facts`` as one rank sees them: the job's processes are counted as on one host and share
    its memory (each rank's offloaded layer inputs are pinned there), so each rank's ``auto``
    decisions (the offload split, layer runs) are made on its share: ``1/W`` of the host for
    ``W`` processes, or ``1/N`` for a context-parallel group of ``N`` planned alone, as ``hone
    plan``'s estimates are (:func:`hone.transforms.context_plan.rank_share`). On several hosts
    that is less than each rank could use, never more."""
    sharing = max(cfg.distributed.context_parallel, facts.world.world_size)
    if sharing <= 1:
        return facts
    host = facts.host_memory_bytes if facts.host_memory_bytes is not None else host_memory(None)[0]
    return replace(facts, host_memory_bytes=host // sharing)


def pad_rows(batch: MicroBatch, multiple: int) -> MicroBatch:
    """``batch`` (unpacked rows) padded at the end of each row to a width that is a multiple of
    ``multiple``: the padding is masked out of attention and the loss (targets -100), so the
    losses and gradients do not change. Its input id is 0 (no real token sees a later position,
    and a padded position's output gets no gradient). Packed rows are returned as they are."""
    width = batch.input_ids.shape[1]
    extra = -width % multiple
    if extra == 0 or batch.packed:
        return batch
    mask = batch.attention_mask if batch.attention_mask is not None else torch.ones_like(batch.input_ids)
    return replace(
        batch,
        input_ids=F.pad(batch.input_ids, (0, extra), value=0),
        attention_mask=F.pad(mask, (0, extra), value=0),
        targets=F.pad(batch.targets, (0, extra), value=-100),
        position_ids=None if batch.position_ids is None else F.pad(batch.position_ids, (0, extra), value=0),
    )


def _size(ctx: PlanContext) -> int:
    return ctx.decided.context_parallel


def _shard(ctx: PlanContext) -> ContextShard:
    """This rank's place in its group of ``N`` consecutive ranks (the groups made once, collectively)."""
    n = _size(ctx)
    if n == ctx.facts.world.world_size:
        return ContextShard(n, ctx.facts.world.rank, None)
    rank, group = context_group(n)
    return ContextShard(n, rank, group)


def _check(ctx: PlanContext) -> list[str]:
    """The model's heads and attention (read from its config, nothing loaded) and the tiling."""
    n = _size(ctx)
    asked = ctx.cfg.model.attn_implementation  # auto: the kernel the attention transform picks, checked as it is applied
    problems = list(context_parallel_problems(transformers_config(ctx.cfg.model), n, None if asked == "auto" else asked))
    d = ctx.decided
    if d.tiled_layers_chunks >= 2:
        problems.append(
            f"distributed.context_parallel: {n} does not run with tiled decoder layers yet ({d.tiled_layers_why}): "
            "a chunk of a rank's shard is not a contiguous piece of the sequence; set memory.tiled_layers: off"
        )
    return problems


def _apply(model: nn.Module, ctx: PlanContext) -> dict[str, Any]:
    shard = _shard(ctx)
    details = dict(enable_context_parallel(model, shard))
    details.update(ranks=shard.size, data_parallel_groups=ctx.facts.world.world_size // shard.size)
    return details


def _micro_batch(ctx: PlanContext) -> Callable[[MicroBatch, MicroBatch | None], MicroBatch]:
    shard = _shard(ctx)

    def local(batch: MicroBatch, host: MicroBatch | None = None) -> MicroBatch:
        counted = None if host is None else pad_rows(host, shard.size)
        return shard_micro_batch(pad_rows(batch, shard.size), shard, counted)

    return local


def _why(ctx: PlanContext) -> str:
    n, world = _size(ctx), ctx.facts.world.world_size
    groups = f"; {world // n} groups of {n} consecutive ranks train different micro-batches" if world > n else ""
    return (
        f"distributed.context_parallel: {n}: each sequence split into {n} contiguous shards, one per rank; attention "
        f"exchanges heads for tokens (two all-to-all each way per layer){groups}; gradients summed over all {world} ranks"
    )


CONTEXT_PARALLEL = Transform(
    name="context_parallel",
    switch="distributed.context_parallel",
    wanted=lambda ctx: _size(ctx) > 1 and ctx.facts.world.distributed,
    why=_why,
    check=_check,
    model=_apply,
    micro_batch=_micro_batch,
    label=lambda d: f"context parallel ({d['ranks']} ranks per sequence)" if d else "context parallel",
)
