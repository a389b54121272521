"""Where a run stands, as one object: what goes into every checkpoint's ``trainer_state.json``
and comes back from it on resume.

The step and the data position are all a resumed run needs to continue the exact data order
(:mod:`hone.train.batches`); the counters carry on the run's totals and its streak of
non-finite steps (a run that resumes in the middle of a streak stops where the straight run
would). The dict's keys, their order and values are the checkpoint format: a checkpoint written
by an earlier hone resumes in this one.
"""

from dataclasses import dataclass, field
from typing import Any

from hone.train.batches import DataPosition, StepPlan
from hone.train.train_step import StepResult


@dataclass
class TrainState:
    """The loop's progress; every field is saved with each checkpoint."""

    step: int = 0
    """Optimizer steps done (skipped ones included)."""
    position: DataPosition = field(default_factory=DataPosition)
    """Where the next step's rows start in the seeded data order (global: any number of ranks)."""
    skipped_steps: int = 0
    consecutive_nonfinite: int = 0
    """Steps in a row whose loss or gradient was not finite (the run stops at the configured limit)."""
    trained_tokens_total: int = 0
    tokens_total: int = 0
    window_loss_sum: float = 0.0
    """Sum of the finite step losses since the last train row (its ``loss`` is their mean): kept
    with the checkpoint, so a resumed run logs the same means (:mod:`hone.train.step_log`)."""
    window_losses: int = 0

    def advance(self, result: StepResult) -> None:
        """Count one optimizer step: its tokens when it updated, else a skip (and one more of a
        non-finite streak when its outcome counts towards the limit)."""
        self.step += 1
        if result.updated:
            self.consecutive_nonfinite = 0
            self.trained_tokens_total += result.trained_tokens
            self.tokens_total += result.tokens
            return
        self.skipped_steps += 1
        if result.outcome.counts_toward_limit:
            self.consecutive_nonfinite += 1

    def state_dict(self, plan: StepPlan, seed: int, eval_rows: list[dict[str, Any]]) -> dict[str, Any]:
        """``trainer_state.json``'s contents: this state, with what the resume notes compare
        (the step plan, the seed) and the eval rows so far (a checkpoint moved away from its run
        still knows its evals)."""
        return {
            "step": self.step,
            "position": self.position.as_dict(),
            "skipped_steps": self.skipped_steps,
            "consecutive_nonfinite": self.consecutive_nonfinite,
            "trained_tokens_total": self.trained_tokens_total,
            "tokens_total": self.tokens_total,
            "plan": {
                "rows": plan.rows,
                "rows_per_step": plan.rows_per_step,
                "total_steps": plan.total_steps,
                "world_size": plan.world_size,
            },
            "seed": seed,
            "eval_rows": eval_rows,
            "log_window": {"loss_sum": self.window_loss_sum, "losses": self.window_losses},
        }

    @classmethod
    def from_state_dict(cls, saved: dict[str, Any]) -> "TrainState":
        """The state a checkpoint's ``trainer_state.json`` was written from."""
        return cls(
            step=saved["step"],
            position=DataPosition(**saved["position"]),
            skipped_steps=saved["skipped_steps"],
            consecutive_nonfinite=saved["consecutive_nonfinite"],
            trained_tokens_total=saved["trained_tokens_total"],
            tokens_total=saved["tokens_total"],
            window_loss_sum=float(saved.get("log_window", {}).get("loss_sum", 0.0)),  # absent before hone logged means
            window_losses=int(saved.get("log_window", {}).get("losses", 0)),
        )
