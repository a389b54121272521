"""What the run says about each optimizer step, and when.

A metrics row (console, ``metrics.jsonl``, TensorBoard, W&B/MLflow) is written every
``logging.logging_steps``, after the last step and for every skipped step; the other steps
only advance the progress display. A skipped step is also said in words, with why.

**One step late.** The loop hands each step's metrics over right after the step's sync
(:meth:`StepLog.hold`) and the row is written while the next step's forward and backward run on
the device (:meth:`StepLog.flush`, called by the loop before that step's sync), so writing files
and the console never keeps the device waiting. The row holds the values measured at its own
step (its time, tokens/s, peak memory; the console's ETA as of its end), and the loop flushes
it before anything that reads the rows or ends the run: an eval (its row follows the step's),
a checkpoint, a stop, the last step, an error. So ``metrics.jsonl`` has the same rows in the
same order as when each row was written at once.
"""

import time
from dataclasses import asdict, dataclass
from typing import Any

from torch.profiler import record_function

from hone.track.tracker import Tracker
from hone.train.train_step import StepResult


@dataclass
class StepMetrics:
    """What one optimizer step did; passed to ``step_callback`` and logged as a metrics row."""

    step: int
    epoch: float
    loss: float  # mean per trained token over the window; nan when non-finite
    lr: float  # learning rate this step used
    grad_norm: float | None  # before clipping; None when the loss was already non-finite
    trained_tokens: int  # tokens with a loss in this step
    trained_tokens_total: int
    tokens: int  # real (non-padding) input tokens in this step
    tokens_per_s: float  # real input tokens per second of step time
    step_time_s: float
    peak_mem_gib: float | None
    skipped: bool

    def as_row(self) -> dict[str, Any]:
        row = asdict(self)
        row["epoch"] = round(self.epoch, 4)
        return row


class StepLog:
    """Logs the steps on its own cadence through the run's :class:`~hone.track.tracker.Tracker`,
    each row one step late (see the module's docstring)."""

    def __init__(self, tracker: Tracker, logging_steps: int):
        self.tracker = tracker
        self.logging_steps = logging_steps
        self._held: tuple[StepMetrics, bool, float] | None = None

    def due(self, step: int, last: bool, skipped: bool) -> bool:
        return step % self.logging_steps == 0 or last or skipped

    def log(self, metrics: StepMetrics, last: bool, at: float | None = None) -> None:
        """The step's metrics row when one is due, else one tick of the progress display;
        ``at``: when the step ended (``time.perf_counter()``), if that was earlier."""
        with record_function("hone: log"):
            if self.due(metrics.step, last, metrics.skipped):
                self.tracker.log_train(metrics.as_row(), at)
            else:
                self.tracker.display.advance(metrics.step)

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
