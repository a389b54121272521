"""Which of a model's parameters hold one rank's block of experts (expert parallelism).

Under ``distributed.expert_parallel: N`` every experts module keeps only its rank's contiguous
block of ``E / N`` experts (:func:`shard_experts`, applied to the base model before the
adapter) and carries its :class:`~hone.parallel.expert_parallel.ExpertShard` as
:data:`~hone.models.experts.backend.EXPERT_SHARD_ATTR`. The contract every reader relies on
(the forward, DDP, the gradient norm, saving):

- ``gate_up_proj``, ``down_proj`` (and ``gate_up_proj_bias``, ``down_proj_bias`` when
  ``has_bias``) are the global tensors' rows ``[first, first + E / N)`` along dim 0
  (``ExpertShard.local``), the global shape otherwise;
- PEFT's expert LoRA, created after the split, sees ``num_experts = E / N``: its ``lora_A``
  ``[r * E/N, in]`` is the global ``[r * E, in]`` viewed ``[E, r, in]`` sliced on dim 0, and its
  ``lora_B`` ``[out, r * E/N]`` is the global ``[out, r * E]`` viewed ``[out, r, E]`` sliced on
  its last dim (PEFT lays B out expert-minor);
- their gradients already sum every rank's tokens of the expert-parallel group (the exchange's
  backward brings them), so no reduction over the group may touch them; where the group is a
  part of the job they are summed over the block's replicas (:mod:`hone.parallel.groups`), and
  the gradient norm adds their squares over the group (each block once).
- MXFP4 experts (:mod:`hone.models.experts.mxfp4`) split the same way: their ``{proj}_blocks`` /
  ``{proj}_scales`` buffers keep rows ``[first, first + E / N)`` (non-persistent, frozen), and the
  placeholders become placeholders of the block's shape (PEFT sizes the LoRA factors from them).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from peft.tuners.lora.layer import ParamWrapper
from torch import nn

from hone.models.experts.backend import (
    EXPERT_CAPACITY_ATTR,
    EXPERT_CHUNKS_ATTR,
    EXPERT_OVERFLOW_BUFFER,
    EXPERT_RECOMPUTE_ATTR,
    EXPERT_SHARD_ATTR,
    EXPERT_TOKENS_ATTR,
    experts_modules,
)
from hone.models.experts.mxfp4 import BLOCKS_SUFFIX, SCALES_SUFFIX, is_placeholder, mxfp4_weights, placeholder
from hone.parallel.expert_parallel import ExpertShard
from hone.parallel.groups import ExpertGroups

#: The experts' own tensors split along their first (expert) dimension.
SHARDED_TENSORS = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")


def expert_shard(module: nn.Module) -> ExpertShard | None:
    """The block of experts ``module`` holds (None: all of them, or not an experts module)."""
    shard = getattr(module, EXPERT_SHARD_ATTR, None)
    return shard if isinstance(shard, ExpertShard) and shard.size > 1 else None


def shard_module(
    module: nn.Module,
    size: int,
    rank: int,
    max_tokens: int | None = None,
    capacity: int | None = None,
    groups: ExpertGroups | None = None,
    chunks: int = 1,
    recompute: bool = False,
) -> bool:
    """Keep, in the experts module ``module``, this ``rank``'s block of experts out of ``size``
    ranks (new Parameters, cloned, with the same ``requires_grad``), and mark it with its shard
    (over every rank: the default process group, and the model stays picklable; ``groups``: an
    expert-parallel group smaller than the job, and the replicas of the block), the most tokens a
    forward routes per rank and the expert pair rows (None: the worst case; else a buffer
    counts the pairs over capacity), the token chunks its exchanges run in and whether its local
    experts are recomputed in the backward. False where it was split already (idempotent)."""
    if expert_shard(module) is not None:
        return False
    names = [n for n in SHARDED_TENSORS if isinstance(getattr(module, n, None), nn.Parameter)]
    group, replicas = (groups.group, groups.replicas) if groups is not None else (None, None)
    shard = ExpertShard(size, rank, getattr(module, names[0]).shape[0], group, replicas)
    for projection, (blocks, scales) in mxfp4_weights(module).items():
        module.register_buffer(projection + BLOCKS_SUFFIX, shard.local(blocks).clone(), persistent=False)
        module.register_buffer(projection + SCALES_SUFFIX, shard.local(scales).clone(), persistent=False)
    for name in names:
        param = getattr(module, name)
        if is_placeholder(param):  # an MXFP4 weight's stand-in: a placeholder of the block's shape, never materialized
            block = placeholder((shard.local_count, *param.shape[1:]), param.dtype, param.device)
            setattr(module, name, block)
            continue
        setattr(module, name, nn.Parameter(shard.local(param.detach()).clone(), requires_grad=param.requires_grad))
    setattr(module, EXPERT_SHARD_ATTR, shard)
    setattr(module, EXPERT_TOKENS_ATTR, max_tokens)
    setattr(module, EXPERT_CAPACITY_ATTR, capacity)
    setattr(module, EXPERT_CHUNKS_ATTR, chunks)
    setattr(module, EXPERT_RECOMPUTE_ATTR, recompute)
    if capacity is not None:
        device = getattr(module, names[0]).device
        # split on the meta device (an MXFP4 checkpoint's loader): a real counter, moved to the device with the buffers
        device = torch.device("cpu") if device.type == "meta" else device
        counter = torch.zeros((), dtype=torch.int64, device=device)
        module.register_buffer(EXPERT_OVERFLOW_BUFFER, counter, persistent=False)
    return True


def shard_experts(
    model: nn.Module,
    size: int,
    rank: int,
    max_tokens: int | None = None,
    capacity: int | None = None,
    groups: ExpertGroups | None = None,
    chunks: int = 1,
    recompute: bool = False,
) -> int:
    """:func:`shard_module` on every experts module of ``model``; returns how many it holds."""
    modules = experts_modules(model)
    for _, module in modules:
        shard_module(module, size, rank, max_tokens, capacity, groups, chunks, recompute)
    return len(modules)


def take_overflow(model: nn.Module) -> torch.Tensor | None:
    """The most pairs over capacity one layer's forward left uncomputed since the last call (a
    device tensor: no sync), and the counters cleared; None where no module counts (the
    worst-case capacity). The largest rather than the sum says how much capacity was missing."""
    counters = [b for n, b in model.named_buffers() if n.rsplit(".", 1)[-1] == EXPERT_OVERFLOW_BUFFER]
    if not counters:
        return None
    total = torch.stack(counters).max()
    for counter in counters:
        counter.zero_()
    return total


def expert_parallel_shards(model: nn.Module) -> dict[str, ExpertShard]:
    """Qualified name (in ``model``) -> shard of every parameter that holds this rank's experts
    only: the split experts' tensors and the LoRA factors PEFT made for them."""
    found: dict[str, ExpertShard] = {}
    for owner, module in model.named_modules():
        prefix = f"{owner}." if owner else ""
        if isinstance(module, ParamWrapper) and (shard := expert_shard(module.get_base_layer())) is not None:
            for part in ("lora_A", "lora_B"):
                found.update({f"{prefix}{part}.{n}": shard for n, _ in getattr(module, part).named_parameters()})
        elif (shard := expert_shard(module)) is not None:
            found.update({f"{prefix}{n}": shard for n, _ in module.named_parameters(recurse=False) if n in SHARDED_TENSORS})
    return found


def expert_parallel_groups(model: nn.Module) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """(the expert-parallel group, the replica group) of ``model``'s blocks: (None, None) where
    they span every rank (the default group, no replicas) or nothing is split."""
    shard = next(iter(expert_parallel_shards(model).values()), None)
    return (shard.group, shard.replicas) if shard is not None else (None, None)


def expert_parallel_names(model: nn.Module) -> list[str]:
    """The names of :func:`expert_parallel_shards`, in module order."""
    return list(expert_parallel_shards(model))


def expert_parallel_params(model: nn.Module) -> list[torch.nn.Parameter]:
    """The parameters of :func:`expert_parallel_names`, in the same order."""
    by_name = dict(model.named_parameters())
    return [by_name[n] for n in expert_parallel_names(model)]


def local_block(name: str, full: torch.Tensor, shard: ExpertShard) -> torch.Tensor:
    """This rank's block of the global tensor ``full`` of the sharded parameter ``name`` (see the
    module docstring for the layouts): what :func:`shard_experts` and PEFT hold on the rank."""
    if ".lora_B." in f".{name}":
        out, ranks = full.shape[0], full.shape[1] // shard.num_experts
        block = full.view(out, ranks, shard.num_experts)[..., shard.first : shard.first + shard.local_count]
        return block.reshape(out, ranks * shard.local_count)
    if ".lora_A." in f".{name}":
        blocks = full.view(shard.num_experts, -1, full.shape[-1])
        return shard.local(blocks).reshape(-1, full.shape[-1])
    return shard.local(full)


def join_blocks(name: str, blocks: list[torch.Tensor], local_count: int) -> torch.Tensor:
    """The global tensor of the sharded parameter ``name`` from every rank's block (rank order;
    ``local_count`` experts each): the inverse of :func:`local_block`."""
    if ".lora_B." in f".{name}":
        out = blocks[0].shape[0]
        joined = torch.cat([b.reshape(out, -1, local_count) for b in blocks], dim=-1)
        return joined.reshape(out, -1)
    return torch.cat(blocks, dim=0)
