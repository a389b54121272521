"""One object the training loop reports to; it fans rows out to every enabled sink.

Sinks: ``metrics.jsonl`` (always), TensorBoard (``tensorboard`` in
``logging.active_trackers``), W&B and MLflow (started before the model loads by
:func:`hone.track.trackers.start_trackers` and handed in), the console (bar or lines,
``logging.progress_bar``), and ``loss.png`` at the end (``logging.plot``). At the end every
tracker also receives ``optimizations.json`` and ``loss.png``.

With several processes only rank 0's tracker is ``enabled``; the others keep the rows in memory
(the loop reads its eval losses from them) and write and print nothing.
"""

from pathlib import Path
from typing import Any

from rich.console import Console

from hone.config.logging import LoggingConfig
from hone.run_files import METRICS_FILE, PLOT_FILE, TENSORBOARD_DIR
from hone.track.metrics import MetricsLog, RowsInMemory
from hone.track.plot import plot_losses
from hone.track.progress import ProgressDisplay
from hone.track.tensorboard import TensorBoardLog
from hone.track.trackers import ExternalTracker, read_optimizations


class Tracker:
    def __init__(
        self,
        cfg: LoggingConfig,
        output_dir: Path,
        console: Console,
        *,
        total_steps: int,
        resume_step: int | None = None,
        history: list[dict[str, Any]] | None = None,
        enabled: bool = True,
        external: list[ExternalTracker] | None = None,
        run_config: str | None = None,
    ):
        """``enabled=False`` (ranks other than 0): rows kept in memory only, nothing written or shown.
        ``external``: started W&B / MLflow trackers (closed by :meth:`close`); ``run_config``: the
        resolved config as YAML, for TensorBoard's text tab."""
        self.cfg = cfg
        self.enabled = enabled
        self.output_dir = Path(output_dir)
        path = self.output_dir / METRICS_FILE
        self.metrics: MetricsLog | RowsInMemory = (
            MetricsLog(path, resume_step=resume_step, history=history)
            if enabled
            else RowsInMemory(path, resume_step=resume_step, history=history)
        )
        self.tensorboard = (
            TensorBoardLog(
                self.output_dir / TENSORBOARD_DIR,
                purge_step=None if resume_step is None else resume_step + 1,
            )
            if "tensorboard" in cfg.active_trackers and enabled
            else None
        )
        if self.tensorboard is not None and run_config is not None:
            self.tensorboard.text("config", run_config)
        self.external: list[ExternalTracker] = list(external or []) if enabled else []
        self.failed = False
        """Set by the loop when it stops with an error: trackers then mark their run failed."""
        self.display = ProgressDisplay(
            console if enabled else Console(quiet=True),
            total_steps=total_steps,
            start_step=resume_step or 0,
            bar=cfg.progress_bar and enabled,
        )

    @property
    def metrics_path(self) -> Path:
        return self.metrics.path

    @property
    def rows(self) -> list[dict[str, Any]]:
        return self.metrics.rows

    def log_train(self, row: dict[str, Any], at: float | None = None) -> None:
        """A train row to every sink; ``at``: the ``time.perf_counter()`` reading when its step
        ended, for the console's ETA when the row is written later (default: now)."""
        self.metrics.append(row)
        if self.tensorboard:
            self.tensorboard.write(row)
        self._to_external(row)
        self.display.step(row, at)

    def log_eval(self, row: dict[str, Any]) -> None:
        self.metrics.append(row)
        if self.tensorboard:
            self.tensorboard.write(row)
        self._to_external(row)
        loss, ppl = row.get("eval_loss"), row.get("eval_ppl")
        shown = "nan" if loss is None else f"{loss:.4f} (ppl {ppl:.2f})" if ppl is not None else f"{loss:.4f}"
        if "eval_rewards/margins" in row:  # a preference objective: over pairs, with its margin and accuracy
            self.display.print(
                f"eval at step {row['step']}: loss {shown} over {row.get('eval_pairs', '?')} pairs, reward margin "
                f"{row['eval_rewards/margins']:.4f}, accuracy {row['eval_rewards/accuracies']:.2f}"
            )
            return
        self.display.print(f"eval at step {row['step']}: loss {shown} over {row.get('eval_tokens', '?')} tokens")

    def _to_external(self, row: dict[str, Any]) -> None:
        """A tracker that fails mid-run is dropped with a warning: the run goes on."""
        for tracker in list(self.external):
            try:
                tracker.write(row)
            except Exception as exc:
                self.external.remove(tracker)
                self.display.print(f"warning: {tracker.name} stopped logging ({type(exc).__name__}: {exc}); training goes on")

    def print(self, message: str) -> None:
        self.display.print(message)

    def close(self, *, plot: bool = True) -> Path | None:
        """Stop the display, close the files, (if enabled) draw ``loss.png``, and hand it and
        ``optimizations.json`` to every tracker before closing them; returns the plot's path."""
        self.display.close()
        self.metrics.close()
        plot_path = None
        if plot and self.cfg.plot and self.enabled:
            plot_path = plot_losses(self.metrics.rows, self.output_dir / PLOT_FILE)
        optimizations = read_optimizations(self.output_dir) if self.enabled else None
        if self.tensorboard:
            self.tensorboard.finish(optimizations, plot_path)
            self.tensorboard.close()
        for tracker in self.external:
            try:
                tracker.finish(optimizations, plot_path, failed=self.failed)
            except Exception as exc:  # closing a tracker must not hide how the run ended
                self.display.print(f"warning: {tracker.name} did not close cleanly ({type(exc).__name__}: {exc})")
        self.external = []
        return plot_path
