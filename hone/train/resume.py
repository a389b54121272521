"""Continuing a run from a checkpoint: its state restored, and what differs from the
interrupted run said in notes.

The schedule's length follows this run's config (extending ``max_steps`` on resume is the
common case): when it differs from the checkpoint's, the restored scheduler is switched to this
config's schedule (:func:`follow_schedule`); everything else (optimizer moments, learning
rates) is the checkpoint's.
"""

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from hone.config.root import HoneConfig
from hone.runtime.world import World
from hone.train.batches import StepPlan
from hone.train.checkpoint import remove_checkpoints_after, resume_history
from hone.train.checkpointer import Checkpointer
from hone.train.optim import LRSchedule, make_schedule, set_lr
from hone.train.state import TrainState


@dataclass
class Resumed:
    """A run restored from a checkpoint."""

    state: TrainState
    history: list[dict[str, Any]]  # the metrics rows up to the checkpoint's step
    notes: list[str]  # what differs from the interrupted run, for the console


def resume(
    checkpointer: Checkpointer,
    path: Path,
    plan: StepPlan,
    cfg: HoneConfig,
    scheduler: torch.optim.lr_scheduler.LambdaLR,
    world: World,
) -> Resumed:
    """Restore the checkpoint at ``path`` into the run's objects (weights, optimizer, schedule,
    scaler, RNG: call it before anything draws from the RNG) and return its state.

    Rank 0 removes the checkpoints newer than ``path`` (their steps are trained again)."""
    saved = checkpointer.load(path)
    state = TrainState.from_state_dict(saved)
    history = resume_history(path, saved)  # from the run's metrics.jsonl, not the checkpoint
    wanted = make_schedule(cfg.optimizer, plan.total_steps)
    changed = schedule_differs(scheduler, wanted)
    notes = resume_notes(saved, plan, cfg.training.seed, schedule_changed=changed)
    if changed:
        follow_schedule(scheduler, wanted)
    if world.is_main:
        dropped = remove_checkpoints_after(checkpointer.output_dir, state.step)
        notes += [f"removed checkpoint {p.name} (newer than the one resumed from)" for p in dropped]
    return Resumed(state, history, notes)


def schedule_differs(scheduler: torch.optim.lr_scheduler.LambdaLR, wanted: LRSchedule) -> bool:
    """Whether the restored schedule is another than ``wanted`` (this config's)."""
    return asdict(scheduler.lr_lambdas[0]) != asdict(wanted)


def follow_schedule(scheduler: torch.optim.lr_scheduler.LambdaLR, wanted: LRSchedule) -> None:
    """Continue on ``wanted`` from the restored scheduler's step: its shape, and each group's
    learning rate at that step."""
    scheduler.lr_lambdas[0].__dict__.update(asdict(wanted))
    for group, base_lr in zip(scheduler.optimizer.param_groups, scheduler.base_lrs):
        set_lr(group, float(base_lr) * wanted(scheduler.last_epoch))


def resume_notes(saved: dict[str, Any], plan: StepPlan, seed: int, *, schedule_changed: bool) -> list[str]:
    """Differences between the checkpoint's run (``saved``: its trainer state) and this one that
    change what follows."""
    notes = []
    before = saved.get("plan", {})
    if before.get("rows") not in (None, plan.rows) or before.get("rows_per_step") not in (None, plan.rows_per_step):
        notes.append(
            f"the data or batch shape changed since the checkpoint ({before.get('rows')} rows, "
            f"{before.get('rows_per_step')} per step; now {plan.rows}, {plan.rows_per_step}): the data order "
            "after resuming differs from the interrupted run's"
        )
    saved_world = before.get("world_size", 1)
    if saved_world != plan.world_size and before.get("rows_per_step") in (None, plan.rows_per_step):
        notes.append(
            f"resumed on {plan.world_size} process{'es' if plan.world_size != 1 else ''} from a checkpoint of "
            f"{saved_world}: the global batch ({plan.rows_per_step} rows per step) is the same, so the data "
            "sequence continues exactly (losses match up to the rounding of a different reduction order)"
        )
    if saved.get("seed") not in (None, seed):
        notes.append(f"training.seed changed ({saved.get('seed')} -> {seed}): the data order differs")
    if schedule_changed:
        notes.append(
            f"the learning-rate schedule changed (total {before.get('total_steps')} -> {plan.total_steps} steps): "
            "continuing on this config's schedule"
        )
    return notes
