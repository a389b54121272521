"""The whole tensors of an expert-parallel model: what its files hold, whatever ``N`` trained it.

Under expert parallelism each experts module holds only its rank's contiguous block of the
``E`` experts and says so through the attribute ``hone_expert_shard`` (an
:class:`~hone.parallel.expert_parallel.ExpertShard`). Its 3-D weights and biases are the rows
``[rank * E / N, (rank + 1) * E / N)`` of the whole ones, and PEFT's expert LoRA factors on it are
per-rank too: ``lora_A [r * E / N, in]`` (expert-major: its ``[E / N, r, in]`` view) and
``lora_B [out, r * E / N]`` (expert-minor: its ``[out, r, E / N]`` view; see
:func:`hone.models.experts.lora.expert_lora_factors`).

A saved adapter or model must not depend on ``N``: a PEFT adapter for all ``E`` experts (loads
on the unsharded base with ``PeftModel.from_pretrained``; ``hone merge`` folds it) or a
``save_pretrained`` model. :func:`gather_whole` all-gathers every such block from the ranks of
the group into the whole tensor (A's blocks concatenated along the experts, B's along its
expert-minor dimension); :meth:`ShardedTensor.block` is the inverse, a rank's block of a whole
tensor, for a checkpoint read back on any ``N``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from hone.models.experts.parallel import expert_parallel_shards, expert_shard, join_blocks, local_block
from hone.parallel.expert_parallel import ExpertShard


@dataclass(frozen=True)
class ShardedTensor:
    """How one rank's tensor ``name`` sits in the whole one (the layouts of
    :mod:`hone.models.experts.parallel`: :func:`~hone.models.experts.parallel.local_block` and
    :func:`~hone.models.experts.parallel.join_blocks`)."""

    shard: ExpertShard
    name: str

    @property
    def is_lora_b(self) -> bool:
        return ".lora_B." in f".{self.name}"

    def whole(self, blocks: list[torch.Tensor]) -> torch.Tensor:
        """The whole tensor from every rank's block, in rank order."""
        return join_blocks(self.name, blocks, self.shard.local_count)

    def block(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's block of the whole tensor (a contiguous copy)."""
        experts = self.shard.num_experts
        if (whole.shape[1] if self.is_lora_b else whole.shape[0]) % experts:
            raise ValueError(f"a tensor of shape {tuple(whole.shape)} does not run over {experts} experts")
        return local_block(self.name, whole, self.shard).contiguous()

    def whole_shape(self, block: torch.Size) -> tuple[int, ...]:
        """The whole tensor's shape, from a block's."""
        if self.is_lora_b:
            return (block[0], block[1] * self.shard.size)
        return (block[0] * self.shard.size, *block[1:])


def sharded_tensors(model: nn.Module) -> dict[str, ShardedTensor]:
    """Every expert-sharded parameter of ``model`` by its ``named_parameters`` name (empty when
    no experts module is sharded over more than one rank)."""
    return {name: ShardedTensor(shard, name) for name, shard in expert_parallel_shards(model).items()}


def is_expert_sharded(model: nn.Module) -> bool:
    """Whether any experts module of ``model`` holds only its rank's block of the experts: its
    files then need every rank (:func:`gather_whole`)."""
    return any(expert_shard(module) is not None for module in model.modules())


def gathers(shard: ExpertShard) -> bool:
    """Whether this rank's expert-parallel group gathers the whole tensors: the group holding
    rank 0, which writes (every group where it is all the ranks). With replicas (a group smaller
    than the job) the other groups hold the same blocks again and gather nothing: every expert is
    moved and saved once."""
    return shard.group is None or 0 in dist.get_process_group_ranks(shard.group)


def gather_one(block: torch.Tensor, spec: ShardedTensor, keep: bool) -> torch.Tensor | None:
    """The whole tensor of one block (every rank of ``spec.shard.group`` must call this, in the
    same order), on the CPU where ``keep``, else None. One all-gather on the block's device, in
    the group that :func:`gathers` only (elsewhere None)."""
    if not gathers(spec.shard):
        return None
    block = block.detach().contiguous()
    blocks = [torch.empty_like(block) for _ in range(spec.shard.size)]
    dist.all_gather(blocks, block, group=spec.shard.group)
    return spec.whole([b.cpu() for b in blocks]) if keep else None


def gather_whole(tensors: dict[str, torch.Tensor], specs: dict[str, ShardedTensor], keep: bool) -> dict[str, torch.Tensor]:
    """``tensors`` with every sharded one (named in ``specs``) replaced by the whole tensor; on
    the CPU and returned where ``keep`` (the writing rank), else an empty dict so the other
    ranks hold no copy. Every rank calls it with the same names, in sorted order."""
    whole: dict[str, torch.Tensor] = {}
    for name in sorted(tensors):
        spec = specs.get(name)
        if spec is None:
            if keep:
                whole[name] = tensors[name].detach().cpu()
            continue
        gathered = gather_one(tensors[name], spec, keep)
        if keep:
            whole[name] = gathered
    return whole


def blocks_of(tensors: dict[str, torch.Tensor], specs: dict[str, ShardedTensor]) -> dict[str, torch.Tensor]:
    """``tensors`` (whole, e.g. read from a checkpoint) with every sharded one replaced by this
    rank's block; the others as they are."""
    return {name: specs[name].block(value) if name in specs else value for name, value in tensors.items()}
