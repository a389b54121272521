"""What a person watching the run sees: a live bar on a terminal, plain lines elsewhere.

On a terminal (and with ``logging.progress_bar``) a rich progress bar shows step/total, loss,
lr, tokens/s, memory and the ETA. Redirected to a file or CI log, a bar would be an unreadable
stream of carriage returns, so every logged step prints one plain line instead.

Loss and tokens/s are the logging window's (:mod:`hone.train.step_log`). Memory is the peak so
far: on CUDA ``mem A/R GiB``, the peak allocated by tensors over the peak reserved by the caching
allocator (what the GPU gives the run; the gap is fragmentation and cache); on the CPU ``rss N
GiB``, the process's peak resident memory (Python and the libraries included), since a CPU run
has no allocator cache to report.
"""

import time
from datetime import timedelta
from typing import Any

from rich.console import Console


def format_eta(seconds: float | None) -> str:
    if seconds is None or seconds != seconds or seconds == float("inf"):
        return "?"
    return str(timedelta(seconds=int(round(seconds))))


def _fmt(value: Any, spec: str) -> str:
    return "nan" if value is None else format(value, spec)


def format_memory(row: dict[str, Any]) -> str:
    """``mem 12.3/14.0 GiB`` (CUDA: peak allocated / peak reserved), ``rss 0.45 GiB`` (CPU), or ``-``."""
    allocated, reserved = row.get("peak_mem_gib"), row.get("peak_reserved_gib")
    if allocated is None:
        return "-"
    if reserved is None:
        return f"rss {allocated:.2f} GiB"
    return f"mem {allocated:.1f}/{reserved:.1f} GiB"


class ProgressDisplay:
    """Live bar or plain lines, chosen once at construction."""

    def __init__(self, console: Console, *, total_steps: int, start_step: int = 0, bar: bool = True):
        self.console = console
        self.total = total_steps
        self.start_step = start_step
        self._t0 = time.perf_counter()
        self._progress = None
        self._task = None
        if bar and console.is_terminal:
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(
                TextColumn("step {task.completed}/{task.total}"),
                BarColumn(),
                TextColumn("loss {task.fields[loss]}  lr {task.fields[lr]}  {task.fields[tps]} tok/s  {task.fields[mem]}  eta"),
                TimeRemainingColumn(),
                console=console,
                transient=False,
            )
            self._task = self._progress.add_task(
                "train", total=total_steps, completed=start_step, loss="-", lr="-", tps="-", mem="-"
            )
            self._progress.start()

    @property
    def live(self) -> bool:
        return self._progress is not None

    def eta_s(self, step: int, at: float | None = None) -> float | None:
        """Time left after ``step``, at the ``time.perf_counter()`` reading ``at`` (default: now)."""
        done = step - self.start_step
        if done <= 0:
            return None
        return ((time.perf_counter() if at is None else at) - self._t0) / done * (self.total - step)

    def step(self, row: dict[str, Any], at: float | None = None) -> None:
        """Show a train metrics row (called for every logged step); ``at``: when the step ended,
        if the row is shown later (the loop writes it while the next step computes)."""
        step = row["step"]
        loss = _fmt(row.get("loss"), ".4f")
        lr = _fmt(row.get("lr"), ".2e")
        tps = _fmt(row.get("tokens_per_s"), ",.0f")
        mem = format_memory(row)
        if self._progress is not None:
            self._progress.update(self._task, completed=step, loss=loss, lr=lr, tps=tps, mem=mem)
            return
        skipped = "  (skipped: non-finite)" if row.get("skipped") else ""
        grad = _fmt(row.get("grad_norm"), ".3f")
        pairs = ""
        if "rewards/margins" in row:  # a preference objective: its reward margin and accuracy
            pairs = f" | margin {_fmt(row.get('rewards/margins'), '.4f')} | acc {_fmt(row.get('rewards/accuracies'), '.2f')}"
        self.console.print(
            f"step {step}/{self.total} | loss {loss}{pairs} | lr {lr} | grad {grad} | {tps} tok/s | {mem}"
            f" | eta {format_eta(self.eta_s(step, at))}{skipped}",
            highlight=False,
            markup=False,
            soft_wrap=True,
        )

    def advance(self, step: int) -> None:
        """Move the bar on a step that was not logged (``logging_steps`` > 1)."""
        if self._progress is not None:
            self._progress.update(self._task, completed=step)

    def print(self, message: str) -> None:
        """A message above the bar (or a plain line)."""
        self.console.print(message, highlight=False, markup=False, soft_wrap=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
