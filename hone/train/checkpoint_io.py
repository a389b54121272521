"""Who writes and reads checkpoints and the final outputs when a run has several processes.

The loop talks to a :class:`CheckpointIO`, chosen by :func:`checkpoint_io_for` from the plan:
when a transform shards the weights (FSDP2), :class:`ShardedCheckpoints` has every rank write its
shards through Distributed Checkpoint; otherwise :class:`RankZeroCheckpoints` does what replicas
need: every rank holds the same weights and optimizer state (DDP), so rank 0
writes the ordinary checkpoint (:mod:`hone.train.checkpoint`) while the others wait at the
agreement after it (none runs ahead into the next step, a failed save stops all of them with its
message), and on resume every rank reads the same files. Under expert parallelism the experts
are the exception: every rank first gathers its blocks into the whole tensors, which rank 0
writes in the same format, and on resume each rank keeps its block
(:mod:`hone.train.expert_checkpoint`; the final adapter or model likewise, :mod:`hone.models.save`).
A DCP checkpoint (written beside FSDP2) is read by every rank, its own blocks resharded
(:func:`hone.train.sharded_checkpoint.load_sharded_checkpoint`).

The data position in ``trainer_state.json`` is global (see :mod:`hone.train.batches`), so a
checkpoint resumes on any number of processes.
"""

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from hone.models.adapters import unwrap_compiled
from hone.runtime.world import SINGLE, World
from hone.train.checkpoint import checkpoints_root, load_checkpoint, save_checkpoint
from hone.train.distributed import together
from hone.train.expert_checkpoint import whole_experts
from hone.train.sharded_checkpoint import is_sharded_checkpoint

if TYPE_CHECKING:
    from hone.config.adapter import AdapterConfig
    from hone.transforms.base import RunHooks


class CheckpointIO(Protocol):
    """Saving and loading a run's state; every rank calls each method at the same point."""

    def save(
        self,
        output_dir: Path,
        step: int,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        state: dict[str, Any],
        scaler: torch.amp.GradScaler | None,
        keep: int | None,
    ) -> Path:
        """Write ``checkpoints/step-<step>`` (complete or not at all); return its path on every rank."""
        ...

    def load(
        self,
        path: Path,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        scaler: torch.amp.GradScaler | None,
    ) -> dict[str, Any]:
        """Restore the state into this rank's objects; return ``trainer_state.json``'s contents."""
        ...

    def save_final(self, model: torch.nn.Module, tokenizer: Any, final_dir: Path, adapter: "AdapterConfig") -> Path:
        """Write the final adapter or ``save_pretrained`` model (gathered, by one rank); its path on every rank."""
        ...


class RankZeroCheckpoints:
    """Replicated weights: rank 0 writes, every rank reads (a world of one: just the files)."""

    def __init__(self, world: World = SINGLE):
        self.world = world

    def save(self, output_dir, step, *, model, optimizer, scheduler, state, scaler, keep) -> Path:
        with together(self.world):
            whole = whole_experts(model, optimizer)  # expert parallel: every rank gathers its blocks first
            if whole is not None:
                whole.gather()
            if self.world.is_main:
                save_checkpoint(
                    output_dir,
                    step,
                    model=model,
                    optimizer=optimizer if whole is None else whole,
                    scheduler=scheduler,
                    scaler=scaler,
                    state=state,
                    keep=keep,
                    state_dict_hooks=() if whole is None else whole.hooks,
                )
        return checkpoints_root(output_dir) / f"step-{step}"

    def load(self, path, *, model, optimizer, scheduler, scaler) -> dict[str, Any]:
        saved: dict[str, Any] = {}
        with together(self.world):  # a rank that cannot read it stops them all
            # expert parallel: each rank keeps its blocks of the whole files; a DCP checkpoint (of
            # expert parallelism beside FSDP2) is read by every rank, its own blocks resharded
            whole = None if is_sharded_checkpoint(path) else whole_experts(model, optimizer)
            saved = load_checkpoint(
                path,
                model=model,
                optimizer=optimizer if whole is None else whole,
                scheduler=scheduler,
                scaler=scaler,
                state_dict_hooks=() if whole is None else whole.hooks,
            )
        return saved

    def save_final(self, model, tokenizer, final_dir, adapter) -> Path:
        from hone.models.experts.sharded_state import is_expert_sharded
        from hone.models.save import save_final

        with together(self.world):
            if self.world.is_main or is_expert_sharded(unwrap_compiled(model)):  # expert parallel: all ranks gather
                save_final(model, tokenizer, final_dir, adapter)
        return Path(final_dir)


class ShardedCheckpoints:
    """Checkpoint writer for sharded weights: every rank writes its shards (Distributed
    Checkpoint, :mod:`hone.train.sharded_checkpoint`; :func:`hone.train.checkpoint.save_checkpoint`
    picks the format from the model) and every rank takes part in gathering the final outputs,
    which rank 0 writes."""

    def save(self, output_dir, step, *, model, optimizer, scheduler, state, scaler, keep) -> Path:
        return save_checkpoint(
            output_dir, step, model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler, state=state, keep=keep
        )

    def load(self, path, *, model, optimizer, scheduler, scaler) -> dict[str, Any]:
        return load_checkpoint(path, model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler)

    def save_final(self, model, tokenizer, final_dir, adapter) -> Path:
        from hone.models.save import save_final

        save_final(model, tokenizer, final_dir, adapter)
        return Path(final_dir)


def checkpoint_io_for(hooks: "RunHooks", world: World) -> CheckpointIO:
    """Who writes this run's checkpoints and final outputs: every rank its shards when the plan
    shards the weights, else rank 0 the ordinary files."""
    return ShardedCheckpoints() if hooks.sharded_checkpoints else RankZeroCheckpoints(world)
