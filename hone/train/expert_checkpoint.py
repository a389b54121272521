"""Step checkpoints of an expert-parallel run: the one-process format, every expert once.

Each rank holds its block of every layer's experts (and of their LoRA factors and optimizer
moments); the rest is replicated. A checkpoint is written as one process writes it
(:mod:`hone.train.checkpoint`, by rank 0): every sharded weight and every optimizer tensor of
the same shape (Adam's moments) is all-gathered into the whole tensor first, so
``trainable.safetensors`` and ``optimizer.pt`` hold all ``E`` experts, exactly as a run without
expert parallelism saves them. On load every rank reads the same files and keeps its block.

Why this and not per-rank files or Distributed Checkpoint: the format does not depend on ``N``,
so a run resumes on another expert-parallel size (2 -> 1, 1 -> 2, 2 -> 4) and a one-process
checkpoint resumes under expert parallelism, with the rank-0 writer's atomic save unchanged.
The expert-sharded parameters are plain tensors (not DTensors), which DCP would take for
replicated copies. The price is that rank 0 holds the whole trainable state on its CPU while it
writes, as one process would: nothing for LoRA, but a full fine-tune of a large MoE wants the
FSDP2 combination and its DCP checkpoints (not yet supported with expert parallelism).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hone.errors import HoneError
from hone.models.adapters import unwrap_compiled
from hone.models.experts.sharded_state import ShardedTensor, gather_one, gather_whole, sharded_tensors
from hone.runtime.checkpoints import StateDictHooks


class ExpertCheckpointError(HoneError):
    """An expert-parallel checkpoint cannot be gathered or restored."""


def _optimizer_specs(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[int, tuple[str, ShardedTensor, torch.Size]]:
    """The optimizer state dict's parameter indices of the sharded parameters (its indices number
    the parameters of every group in order): name, layout, and the block's shape."""
    specs = sharded_tensors(model)
    names = {id(p): name for name, p in model.named_parameters()}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    found = {}
    for index, param in enumerate(params):
        name = names.get(id(param))
        if name in specs:
            found[index] = (name, specs[name], param.shape)
    return found


class WholeExperts:
    """A run's model and optimizer as :func:`~hone.train.checkpoint.save_checkpoint` and
    :func:`~hone.train.checkpoint.load_checkpoint` should see them under expert parallelism:
    :attr:`hooks` put the whole expert tensors into the weights written (and take this rank's
    block of those read back); :meth:`state_dict` / :meth:`load_state_dict` stand in for the
    optimizer's, with every expert's moments."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model = unwrap_compiled(model)
        self.optimizer = optimizer
        self.specs = sharded_tensors(self.model)
        self.optimizer_specs = _optimizer_specs(self.model, optimizer)
        self.shapes = {name: p.shape for name, p in self.model.named_parameters() if name in self.specs}
        self.weights: dict[str, torch.Tensor] = {}
        self.optimizer_state: dict[str, Any] = {}
        self.hooks = (StateDictHooks(save=self._whole_weights, load=self._weight_blocks),)

    @property
    def rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    def gather(self) -> WholeExperts:
        """All-gather the sharded weights and optimizer moments (every rank calls this, before
        rank 0 writes); rank 0 keeps them on its CPU."""
        keep = self.rank == 0
        trainable = {name: p for name, p in self.model.named_parameters() if p.requires_grad and name in self.specs}
        self.weights = gather_whole(trainable, self.specs, keep)
        self.optimizer_state = self._gather_optimizer(keep)
        return self

    def _gather_optimizer(self, keep: bool) -> dict[str, Any]:
        live = self.optimizer.state_dict()  # its per-parameter dicts are the optimizer's own: copy before replacing
        saved = {**live, "state": {index: dict(values) for index, values in live["state"].items()}}
        for index in sorted(self.optimizer_specs):
            name, spec, shape = self.optimizer_specs[index]
            values = saved["state"].get(index, {})
            for key in sorted(values):
                value = values[key]
                if not isinstance(value, torch.Tensor) or value.dim() == 0:
                    continue  # Adam's step count: the same on every rank
                if value.shape != shape:
                    raise ExpertCheckpointError(
                        f"cannot checkpoint the optimizer state '{key}' of '{name}' under expert parallelism: its "
                        f"shape {tuple(value.shape)} is not the weight's {tuple(shape)} (a low-bit optimizer state); "
                        "use an optimizer whose moments have the weights' shapes"
                    )
                values[key] = gather_one(value, spec, keep)
        return saved if keep else {}

    def _whole_weights(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {**weights, **self.weights}

    def _weight_blocks(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {name: self._block(name, self.specs.get(name), value, self.shapes.get(name)) for name, value in weights.items()}

    @staticmethod
    def _block(name: str, spec: ShardedTensor | None, value: torch.Tensor, shape: torch.Size | None = None) -> torch.Tensor:
        if spec is None:
            return value
        want = spec.whole_shape(shape) if shape is not None else None
        if want is not None and tuple(value.shape) != tuple(want):
            raise ExpertCheckpointError(
                f"checkpoint tensor '{name}' has shape {tuple(value.shape)}; the whole tensor over "
                f"{spec.shard.num_experts} experts has {want} (another model or lora_r?)"
            )
        try:
            return spec.block(value)
        except ValueError as exc:
            raise ExpertCheckpointError(f"checkpoint tensor '{name}': {exc}") from None

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state dict with every expert's moments (what :meth:`gather` kept)."""
        return self.optimizer_state

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Restore the optimizer from a state dict with every expert's moments: this rank's blocks."""
        saved = {**saved, "state": {index: dict(values) for index, values in saved.get("state", {}).items()}}
        for index, (name, spec, shape) in self.optimizer_specs.items():
            values = saved["state"].get(index, {})
            for key, value in values.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    values[key] = self._block(f"{name} ({key})", spec, value, shape)
        self.optimizer.load_state_dict(saved)


def whole_experts(model: nn.Module, optimizer: torch.optim.Optimizer) -> WholeExperts | None:
    """The stand-in for a model whose experts are split over the ranks, else None."""
    view = WholeExperts(model, optimizer)
    return view if view.specs else None
