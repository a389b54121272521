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
FSDP2 combination (``distributed.strategy: fsdp``), whose DCP checkpoints each rank writes: the
blocks go in as shards of the whole experts (:func:`experts_as_dtensors`, at the end).
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


# ---------------------------------------------------------------- beside FSDP2: DCP shards


def _expert_placement(spec: ShardedTensor, local: torch.Tensor):
    """(the view DCP sees of a rank's block, its placement): the whole tensor sharded on the
    experts' dimension, this rank's chunk being its block (blocks are contiguous, in rank order).
    ``lora_B`` is expert-minor (``[out, r * E/N]``, the global ``[out, r, E]`` sliced on its last
    dim): it is seen as ``[out, r, E/N]``, a chunk of ``[out, r, E]`` on dim 2."""
    from torch.distributed.tensor import Shard

    if spec.is_lora_b:
        out, width = local.shape
        return local.view(out, width // spec.shard.local_count, spec.shard.local_count), Shard(2)
    return local, Shard(0)


def _as_dtensor(spec: ShardedTensor, local: torch.Tensor, mesh) -> torch.Tensor:
    from torch.distributed.tensor import DTensor, Replicate

    view, placement = _expert_placement(spec, local)
    placements = [placement] if mesh.ndim == 1 else [Replicate(), placement]  # (replicas, expert-parallel group)
    return DTensor.from_local(view, mesh, placements, run_check=False)


def _blocks_mesh(spec: ShardedTensor, device: torch.device):
    """Where the blocks' group is a part of the job: a 2-D mesh (replicas, expert-parallel group)
    of the run's own groups, ranks ``[replica, position] = replica * N + position``
    (:mod:`hone.parallel.groups`); DCP then writes each block once (replicas are deduplicated)."""
    from torch.distributed.device_mesh import DeviceMesh

    size, world = spec.shard.size, dist.get_world_size()
    ranks = torch.arange(world).view(world // size, size)
    return DeviceMesh.from_group(
        [spec.shard.replicas, spec.shard.group], device.type, mesh=ranks, mesh_dim_names=("replicas", "experts")
    )


def _mesh_of(state: dict[str, Any], device: torch.device):
    """The mesh of FSDP2's shards in ``state`` (any DTensor), else one over every rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    for value in state.values():
        if isinstance(value, DTensor):
            return value.device_mesh
    return init_device_mesh(device.type, (dist.get_world_size(),))


def experts_as_dtensors(model: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """``{"model": ..., "optim": ...}`` (DCP's state dicts of a model sharded by FSDP2 beside
    expert parallelism) with every expert block, and each optimizer tensor of a block's shape
    (Adam's moments), as a DTensor sharded over the ranks on the experts' dimension, viewing the
    same storage. Why: DCP takes a plain tensor for a copy every rank holds and writes one rank's;
    as shards of the whole experts, each rank writes its own block, the checkpoint holds every
    expert once, and DCP reshards them on load like FSDP2's (resume on another ``N``). In place
    of the plain entries; :func:`experts_as_blocks` turns them back after a load."""
    params = dict(unwrap_compiled(model).named_parameters())
    specs = {name: spec for name, spec in sharded_tensors(unwrap_compiled(model)).items() if params[name].requires_grad}
    if not specs:
        return state
    weights, optim = state["model"], state["optim"]
    absent = sorted(set(specs) - set(weights))
    if absent:  # DCP names the weights as named_parameters does; a wrapper renaming them would lose experts
        raise ExpertCheckpointError(f"expert-parallel blocks not found in the model's state dict by name: {absent[:3]}")
    first = next(iter(specs.values()))
    device = params[next(iter(specs))].device
    mesh = _mesh_of(weights, device) if first.shard.replicas is None else _blocks_mesh(first, device)
    for name, spec in specs.items():
        weights[name] = _as_dtensor(spec, weights[name], mesh)
        shape = params[name].shape
        if name not in optim.get("state", {}):
            continue
        optim["state"][name] = dict(optim["state"][name])  # the optimizer's own dict: replace in a copy
        for key, value in list(optim["state"][name].items()):
            if isinstance(value, torch.Tensor) and value.shape == shape and value.dim() > 0:
                optim["state"][name][key] = _as_dtensor(spec, value, mesh)
            elif isinstance(value, torch.Tensor) and value.dim() > 0:
                raise ExpertCheckpointError(
                    f"cannot checkpoint the optimizer state '{key}' of '{name}' under expert parallelism: its shape "
                    f"{tuple(value.shape)} is not the weight's {tuple(shape)} (a low-bit optimizer state); use "
                    "optimizer.name: adamw"
                )
    return state


def experts_as_blocks(model: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`experts_as_dtensors`: each wrapped entry back to the rank's plain
    block (the same storage, so what DCP loaded into the view is in it), in place."""
    from torch.distributed.tensor import DTensor

    specs = sharded_tensors(unwrap_compiled(model))
    weights, optim = state["model"], state["optim"]

    def block(spec: ShardedTensor, value: Any) -> Any:
        if not isinstance(value, DTensor):
            return value
        local = value.to_local()
        return local.reshape(local.shape[0], -1) if spec.is_lora_b else local

    for name, spec in specs.items():
        if name in weights:
            weights[name] = block(spec, weights[name])
        if name in optim.get("state", {}):
            optim["state"][name] = {key: block(spec, value) for key, value in optim["state"][name].items()}
    return state
