"""``training.saves_per_epoch`` / ``evals_per_epoch``: N evenly spaced saves or evals per epoch."""

import pytest
import torch
from pydantic import ValidationError
from rich.console import Console

from hone.testing import plan_hooks, random_rows, tiny_config, tiny_llama
from hone.track.metrics import read_metrics
from hone.train.batches import StepPlan
from hone.train.checkpoint_layout import list_checkpoints
from hone.train.loop import train_loop


def _plan(steps_per_epoch: int) -> StepPlan:
    return StepPlan(rows=steps_per_epoch, micro_batch_size=1, accumulation=1, steps_per_epoch=steps_per_epoch, total_steps=99)


def _due(plan: StepPlan, every: int | None, per_epoch: int | None, last: int) -> list[int]:
    return [s for s in range(1, last + 1) if plan.due(s, every, per_epoch)]


def test_per_epoch_points_are_evenly_spaced_and_close_each_epoch():
    assert _due(_plan(10), None, 3, 20) == [4, 7, 10, 14, 17, 20]
    assert _due(_plan(8), None, 2, 16) == [4, 8, 12, 16]
    assert _due(_plan(3), None, 5, 6) == [1, 2, 3, 4, 5, 6]  # more than the steps: every step
    assert _due(_plan(10), 4, None, 12) == [4, 8, 12]
    assert _due(_plan(10), None, None, 12) == []


@pytest.mark.parametrize(("steps", "per_epoch"), [("save_steps", "saves_per_epoch"), ("eval_steps", "evals_per_epoch")])
def test_steps_and_per_epoch_are_exclusive(tmp_path, steps, per_epoch):
    with pytest.raises(ValidationError, match=f"set either training.{steps} or training.{per_epoch}, not both"):
        tiny_config(tmp_path, training={steps: 2, per_epoch: 2}, data={"val_set_size": 0.1})


def test_evals_per_epoch_needs_eval_data(tmp_path):
    with pytest.raises(ValidationError, match="training.evals_per_epoch is set but there is no eval data"):
        tiny_config(tmp_path, training={"evals_per_epoch": 2})


def test_a_two_epoch_run_saves_and_evaluates_twice_per_epoch(tmp_path):
    # 16 rows, 2 per step: 8 steps per epoch; 2 epochs = 16 steps; halves at 4, 8, 12, 16
    cfg = tiny_config(
        tmp_path,
        training={"num_epochs": 2, "saves_per_epoch": 2, "evals_per_epoch": 2, "save_total_limit": 10},
        data={"val_set_size": 0.1},
    )
    model = tiny_llama(0)
    train_loop(
        model,
        random_rows(16, seed=1),
        random_rows(4, seed=2),
        cfg,
        device=torch.device("cpu"),
        pad_id=0,
        console=Console(quiet=True),
        hooks=plan_hooks(model, cfg),
    )
    assert [step for step, _ in list_checkpoints(tmp_path)] == [4, 8, 12, 16]
    evals = [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl") if "eval_loss" in r]
    assert evals == [0, 4, 8, 12, 16]
