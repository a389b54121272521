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
from typing import Literal

import torch
import torch.distributed as dist
from peft.tuners.lora.layer import ParamWrapper as PeftParamWrapper
from torch import nn

from hone.parallel.expert_parallel import ExpertShard

#: The attribute the expert-parallel transform sets on every experts module it slices.
SHARD_ATTRIBUTE = "hone_expert_shard"

#: An experts module's parameters whose first dimension runs over its experts.
EXPERT_PARAMETERS = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")


def expert_shard_of(module: nn.Module) -> ExpertShard | None:
    """The shard an experts module holds (None: all of its experts)."""
    shard = getattr(module, SHARD_ATTRIBUTE, None)
    return shard if isinstance(shard, ExpertShard) and shard.size > 1 else None


@dataclass(frozen=True)
class ShardedTensor:
    """How one rank's tensor sits in the whole one. ``experts``: its first dimension is the
    experts' (weights and biases ``[E / N, ...]``, LoRA A ``[r * E / N, in]``, expert-major), so
    the whole is the ranks' blocks concatenated along dim 0. ``lora_b``: LoRA B ``[out, r * E / N]``
    with the experts as the minor index of its second dimension."""

    shard: ExpertShard
    kind: Literal["experts", "lora_b"]

    def whole(self, blocks: list[torch.Tensor]) -> torch.Tensor:
        """The whole tensor from every rank's block, in rank order."""
        if self.kind == "experts":
            return torch.cat(blocks, dim=0)
        out, width = blocks[0].shape
        local = self.shard.local_count
        views = [b.reshape(out, width // local, local) for b in blocks]
        return torch.cat(views, dim=2).reshape(out, width * self.shard.size)

    def block(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's block of the whole tensor (a contiguous copy)."""
        shard = self.shard
        if self.kind == "experts":
            if whole.shape[0] % shard.num_experts:
                raise ValueError(f"a tensor of shape {tuple(whole.shape)} does not run over {shard.num_experts} experts")
            return whole.chunk(shard.size, dim=0)[shard.rank].contiguous()
        out, width = whole.shape
        if width % shard.num_experts:
            raise ValueError(f"a LoRA B of shape {tuple(whole.shape)} does not run over {shard.num_experts} experts")
        view = whole.reshape(out, width // shard.num_experts, shard.num_experts)
        return view[:, :, shard.first : shard.first + shard.local_count].reshape(out, -1).contiguous()

    def whole_shape(self, block: torch.Size) -> tuple[int, ...]:
        """The whole tensor's shape, from a block's."""
        if self.kind == "experts":
            return (block[0] * self.shard.size, *block[1:])
        return (block[0], block[1] * self.shard.size)


def sharded_tensors(model: nn.Module) -> dict[str, ShardedTensor]:
    """Every expert-sharded parameter of ``model`` by its ``named_parameters`` name: the experts
    modules' weights and biases, and the LoRA factors of the PEFT wrappers around them. Empty
    when no experts module is sharded over more than one rank."""
    found: dict[str, ShardedTensor] = {}
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        shard = expert_shard_of(module)
        if shard is not None:
            own = dict(module.named_parameters(recurse=False))
            for param in EXPERT_PARAMETERS:
                if param in own:
                    found[prefix + param] = ShardedTensor(shard, "experts")
        if isinstance(module, PeftParamWrapper):
            wrapped = expert_shard_of(module.get_base_layer())
            if wrapped is None:
                continue
            for adapter in module.lora_A:
                found[f"{prefix}lora_A.{adapter}.weight"] = ShardedTensor(wrapped, "experts")
                found[f"{prefix}lora_B.{adapter}.weight"] = ShardedTensor(wrapped, "lora_b")
    return found


def is_expert_sharded(model: nn.Module) -> bool:
    """Whether any experts module of ``model`` holds only its rank's block of the experts: its
    files then need every rank (:func:`gather_whole`)."""
    return any(expert_shard_of(module) is not None for module in model.modules())


def gather_one(block: torch.Tensor, spec: ShardedTensor, keep: bool) -> torch.Tensor | None:
    """The whole tensor of one block (every rank of ``spec.shard.group`` must call this, in the
    same order), on the CPU where ``keep``, else None. One all-gather on the block's device."""
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
