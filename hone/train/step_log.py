"""What the run says about each optimizer step, and when.

A metrics row (console, ``metrics.jsonl``, TensorBoard, W&B/MLflow) is written every
``logging.logging_steps``, after the last step and for every skipped step; the other steps
only advance the progress display. A skipped step is also said in words, with why.

**One step late.** The loop hands each step's metrics over right after the step's sync
(:meth:`StepLog.hold`) and the row is written while the next step's forward and backward run on
the device (:meth:`StepLog.flush`, called by the loop before that step's sync), so writing files
and the console never keeps the device waiting. The row holds the values measured at its own
step (its time, peak memory; the console's ETA as of its end; its window's means, below), and
the loop flushes it before anything that reads the rows or ends the run: an eval (its row follows the step's),
a checkpoint, a stop, the last step, an error. So ``metrics.jsonl`` has the same rows in the
same order as when each row was written at once.

**A row speaks for its logging window** (the steps since the previous train row), as HF
Trainer and Axolotl log: ``loss`` is the mean of the window's finite step losses, and
``tokens_per_s`` the window's real input tokens over its steps' time (one step's rate jumps
with its batch); the row's own step keeps ``loss_step`` and ``step_time_s``, and ``tokens``,
``trained_tokens``, ``grad_norm`` and ``lr`` are its step's. With ``logging.logging_steps: 1``
both losses are the same. A preference objective's metrics (TRL's ``rewards/*``, ``logps/*``)
are its step's, as ``grad_norm``. The loss window is part of the run's state
(:class:`~hone.train.state.TrainState`, saved with every checkpoint), so a resumed run logs the
same means; the tokens/s window starts again in a new process.
"""

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from torch.profiler import record_function

from hone.track.tracker import Tracker
from hone.train.state import TrainState
from hone.train.train_step import StepResult


@dataclass
class StepMetrics:
    """What one optimizer step did; passed to ``step_callback`` and logged as a metrics row."""

    step: int
    epoch: float
    loss: float  # this step's: mean per trained token over its window of micro-batches; nan when non-finite
    lr: float  # learning rate this step used
    grad_norm: float | None  # before clipping; None when the loss was already non-finite
    trained_tokens: int  # tokens with a loss in this step
    trained_tokens_total: int
    tokens: int  # real (non-padding) input tokens in this step
    tokens_per_s: float  # real input tokens per second of this step's time
    step_time_s: float
    peak_mem_gib: float | None  # CUDA: peak allocated so far; CPU: the process's peak RSS
    skipped: bool
    peak_reserved_gib: float | None = None  # CUDA: peak reserved by the caching allocator; None on CPU
    alloc_retries: int | None = None  # CUDA: times so far the allocator freed its cache to retry; None on CPU
    metrics: dict[str, float] = field(default_factory=dict)
    """Preference objectives: TRL's metrics (``rewards/margins``, ...) of this step, means over its pairs."""

    def as_row(self) -> dict[str, Any]:
        row = asdict(self)
        row["epoch"] = round(self.epoch, 4)
        row.update(row.pop("metrics"))
        return row


class StepLog:
    """Logs the steps on its own cadence through the run's :class:`~hone.track.tracker.Tracker`,
    each row one step late and for its logging window (see the module's docstring)."""

    def __init__(self, tracker: Tracker, logging_steps: int, state: TrainState | None = None):
        """``state``: the run's, which carries the loss window across a resume."""
        self.tracker = tracker
        self.logging_steps = logging_steps
        self.state = state if state is not None else TrainState()
        self._held: tuple[StepMetrics, bool, float] | None = None
        self._window_tokens = 0
        self._window_time_s = 0.0

    def due(self, step: int, last: bool, skipped: bool) -> bool:
        return step % self.logging_steps == 0 or last or skipped

    def log(self, metrics: StepMetrics, last: bool, at: float | None = None) -> None:
        """The step's metrics row when one is due, else one tick of the progress display;
        ``at``: when the step ended (``time.perf_counter()``), if that was earlier."""
        with record_function("hone: log"):
            self._add(metrics)
            if self.due(metrics.step, last, metrics.skipped):
                self.tracker.log_train(self._row(metrics), at)
            else:
                self.tracker.display.advance(metrics.step)

    def _add(self, metrics: StepMetrics) -> None:
        if math.isfinite(metrics.loss):
            self.state.window_loss_sum += metrics.loss
            self.state.window_losses += 1
        self._window_tokens += metrics.tokens
        self._window_time_s += metrics.step_time_s

    def _row(self, metrics: StepMetrics) -> dict[str, Any]:
        """The step's row for its window (the window then starts again)."""
        state = self.state
        mean = state.window_loss_sum / state.window_losses if state.window_losses else math.nan
        rate = self._window_tokens / self._window_time_s if self._window_time_s > 0 else math.nan
        state.window_loss_sum, state.window_losses = 0.0, 0
        self._window_tokens, self._window_time_s = 0, 0.0
        row: dict[str, Any] = {}
        for key, value in metrics.as_row().items():
            if key == "loss":
                row["loss"], row["loss_step"] = mean, value
            else:
                row[key] = rate if key == "tokens_per_s" else value
        return row

    def hold(self, metrics: StepMetrics, last: bool) -> None:
        """Keep the step's metrics to write at the next :meth:`flush` (a row still held is
        written first: at most one step waits)."""
        self.flush()
        self._held = (metrics, last, time.perf_counter())

    def flush(self) -> None:
        """Write the held step's row (or progress tick) now, if any."""
        held, self._held = self._held, None
        if held is not None:
            self.log(*held)

    def skipped(self, step: int, result: StepResult, consecutive_nonfinite: int) -> None:
        """Why step ``step`` changed nothing (and the streak, when it counts towards the limit)."""
        streak = f", {consecutive_nonfinite} in a row" if result.outcome.counts_toward_limit else ""
        self.tracker.print(f"step {step}: {result.problem()}; step skipped (weights, optimizer and schedule unchanged){streak}")
