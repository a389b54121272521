"""When the run saves its state, and what goes into a checkpoint.

A checkpoint is written every ``training.save_steps`` (or ``saves_per_epoch`` times an epoch),
after the last step, and when a signal stops the run (:meth:`Checkpointer.due`). What a
checkpoint holds is the optimizer step's whole state: weights, optimizer, schedule, loss
scaler, RNG (:mod:`hone.train.checkpoint`) and the :class:`~hone.train.state.TrainState` as
``trainer_state.json``. Who writes the files (rank 0, or every rank its shards) is the plan's
:class:`~hone.train.checkpoint_io.CheckpointIO`.
"""

from pathlib import Path
from typing import Any

import torch

from hone.config.training import TrainingConfig
from hone.train.batches import StepPlan
from hone.train.checkpoint import checkpoint_eval_rows
from hone.train.checkpoint_io import CheckpointIO
from hone.train.state import TrainState


class Checkpointer:
    """Saves (and on resume loads) the run's state through ``io``, on its own cadence."""

    def __init__(
        self,
        io: CheckpointIO,
        output_dir: Path,
        training: TrainingConfig,
        plan: StepPlan,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        scaler: torch.amp.GradScaler | None,
        enabled: bool = True,
    ):
        self.io = io
        self.enabled = enabled  # off: the run writes no checkpoint (``hone bench``: a 30B full fine-tune's is 180 GB)
        self.output_dir = output_dir
        self.save_steps = training.save_steps
        self.saves_per_epoch = training.saves_per_epoch
        self.keep = training.save_total_limit
        self.seed = training.seed
        self.plan = plan
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.scaler = scaler

    def due(self, step: int, last: bool, stopping: bool) -> bool:
        if not self.enabled:
            return False
        return self.plan.due(step, self.save_steps, self.saves_per_epoch) or last or stopping

    def save(self, state: TrainState, metrics_rows: list[dict[str, Any]]) -> Path:
        """Write ``checkpoints/step-<state.step>``; ``metrics_rows`` are the run's so far (the
        checkpoint keeps their eval rows, not every row: trainer_state.json stays small)."""
        return self.io.save(
            self.output_dir,
            state.step,
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            scaler=self.scaler,
            state=state.state_dict(self.plan, self.seed, checkpoint_eval_rows(metrics_rows)),
            keep=self.keep,
        )

    def load(self, path: Path) -> dict[str, Any]:
        """Restore the checkpoint at ``path`` into this run's objects; its ``trainer_state.json``."""
        return self.io.load(
            path,
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            scaler=self.scaler,
        )
