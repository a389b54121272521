"""``metrics.jsonl``: one JSON object per logged step, the run's durable record.

Rows are appended and flushed one at a time, so a killed run keeps every row it logged. A
resumed run first drops the rows after the step it resumes from (they belong to the
abandoned continuation and would otherwise appear twice), rewriting the file atomically.

Train rows hold ``step, epoch, loss, loss_step, lr, grad_norm, trained_tokens,
trained_tokens_total, tokens, tokens_per_s, step_time_s, peak_mem_gib, skipped,
peak_reserved_gib``; eval rows hold ``step, epoch, eval_loss, eval_ppl, eval_tokens``. A
preference objective (DPO, IPO, ORPO) adds TRL's metrics to train rows (``rewards/chosen``,
``rewards/rejected``, ``rewards/accuracies``, ``rewards/margins``, ``logps/chosen``,
``logps/rejected``; ORPO also ``nll_loss``, ``log_odds_ratio``, ``log_odds_chosen``: the step's
means over its pairs) and, prefixed ``eval_``, to eval rows, which count ``eval_pairs`` and have
no ``eval_ppl``.
Non-finite numbers are written as ``null`` (JSON has no NaN), so the file parses with any JSON
reader. With ``logging.logging_steps`` N a row is written every N steps (and for the last and
every skipped step). Its ``loss`` is the mean of the finite step losses since the previous train
row, as HF Trainer and Axolotl log it, and ``tokens_per_s`` that window's tokens over its time;
``loss_step`` is the row's own step's loss (see :mod:`hone.train.step_log`). The loss window is
saved with each checkpoint, so a resumed run writes the same rows.
"""

import json
import math
from pathlib import Path
from typing import Any

from hone.atomic import atomic_write_text


def clean_row(row: dict[str, Any]) -> dict[str, Any]:
    """Replace NaN/inf floats by None so the row is valid JSON."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """All rows of a metrics file; a torn last line (killed mid-write) is ignored."""
    path = Path(path)
    if not path.exists():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def is_eval_row(row: dict[str, Any]) -> bool:
    return "eval_loss" in row


class RowsInMemory:
    """The run's metrics rows, in memory (for the plot and the report). On its own it writes
    nothing: the log of ranks other than 0 of a multi-process run; :class:`MetricsLog` adds the
    file."""

    def __init__(self, path: Path, *, resume_step: int | None = None, history: list[dict[str, Any]] | None = None):
        """``resume_step``: keep only rows up to that step (a resumed run); ``history``: the rows
        of the run resumed from, used when the file itself is missing (a checkpoint resumed into
        a new output directory; see :func:`hone.train.checkpoint.resume_history`)."""
        self.path = Path(path)
        self.rows: list[dict[str, Any]] = []
        if resume_step is not None:
            existing = read_metrics(self.path) if self.path.exists() else list(history or [])
            self.rows = [r for r in existing if r.get("step", 0) <= resume_step]

    def append(self, row: dict[str, Any]) -> dict[str, Any]:
        row = clean_row(row)
        self.rows.append(row)
        return row

    @property
    def train_rows(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if not is_eval_row(r)]

    @property
    def eval_rows(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if is_eval_row(r)]

    def close(self) -> None:
        pass


class MetricsLog(RowsInMemory):
    """Appends rows to ``metrics.jsonl`` and keeps them in memory for the plot and report."""

    def __init__(self, path: Path, *, resume_step: int | None = None, history: list[dict[str, Any]] | None = None):
        """Open the log (rewritten to the rows kept, see :class:`RowsInMemory`)."""
        super().__init__(path, resume_step=resume_step, history=history)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in self.rows))
        self._handle = open(self.path, "a", encoding="utf-8")

    def append(self, row: dict[str, Any]) -> dict[str, Any]:
        row = super().append(row)
        self._handle.write(json.dumps(row) + "\n")
        self._handle.flush()
        return row

    def close(self) -> None:
        if not self._handle.closed:
            self._handle.close()
