"""One object the training loop reports to; it fans rows out to every enabled sink.

Sinks: ``metrics.jsonl`` (always), TensorBoard (``logging.tensorboard``), the console
(bar or lines, ``logging.progress_bar``), and ``loss.png`` at the end (``logging.plot``).

With several processes only rank 0's tracker is ``enabled``; the others keep the rows in memory
(the loop reads its eval losses from them) and write and print nothing.
"""

from pathlib import Path
from typing import Any

from rich.console import Console

from hone.config.logging import LoggingConfig
from hone.track.metrics import METRICS_FILE, MetricsLog, RowsInMemory
from hone.track.plot import PLOT_FILE, plot_losses
from hone.track.progress import ProgressDisplay
from hone.track.tensorboard import TensorBoardLog

TENSORBOARD_DIR = "tensorboard"


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
    ):
        """``enabled=False`` (ranks other than 0): rows kept in memory only, nothing written or shown."""
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
            if cfg.tensorboard and enabled
            else None
        )
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

    def log_train(self, row: dict[str, Any]) -> None:
        self.metrics.append(row)
        if self.tensorboard:
            self.tensorboard.write(row)
        self.display.step(row)

    def log_eval(self, row: dict[str, Any]) -> None:
        self.metrics.append(row)
        if self.tensorboard:
            self.tensorboard.write(row)
        loss, ppl = row.get("eval_loss"), row.get("eval_ppl")
        shown = "nan" if loss is None else f"{loss:.4f} (ppl {ppl:.2f})" if ppl is not None else f"{loss:.4f}"
        self.display.print(f"eval at step {row['step']}: loss {shown} over {row.get('eval_tokens', '?')} tokens")

    def print(self, message: str) -> None:
        self.display.print(message)

    def close(self, *, plot: bool = True) -> Path | None:
        """Stop the display, close the files and (if enabled) draw ``loss.png``; returns its path."""
        self.display.close()
        self.metrics.close()
        if self.tensorboard:
            self.tensorboard.close()
        if plot and self.cfg.plot and self.enabled:
            return plot_losses(self.metrics.rows, self.output_dir / PLOT_FILE)
        return None
