"""Weights & Biases: one W&B run per hone run (``logging.trackers: [wandb]``).

The run gets the resolved config at start, each metrics row at its optimizer step (tags as in
TensorBoard: ``train/loss``, ``eval/loss``, ...), and at the end ``optimizations.json`` (in the
run's config and summary) and ``loss.png`` (as an image). ``logging.wandb.mode: offline``
(or ``WANDB_MODE=offline``) writes it under ``<WANDB_DIR or output_dir>/wandb`` for a later
``wandb sync``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hone.track.rows import run_name, scalars

if TYPE_CHECKING:
    from hone.config.root import HoneConfig


class WandbLog:
    name = "wandb"

    def __init__(self, cfg: HoneConfig, output_dir: Path, config: dict[str, Any]):
        import wandb

        settings = cfg.logging.wandb
        self._wandb = wandb
        self._finished = False
        self._run = wandb.init(
            project=settings.project,
            entity=settings.entity,
            name=run_name(cfg, settings.name),
            mode=settings.mode,
            dir=None if os.environ.get("WANDB_DIR") else str(output_dir),  # W&B's own variable wins
            config=config,
            reinit="create_new",  # a second run in one process (tests, hone bench) is its own run
        )

    def write(self, row: dict[str, Any]) -> None:
        values = scalars(row)
        if values:
            self._run.log(values, step=int(row["step"]))

    def finish(self, optimizations: dict[str, Any] | None, plot: Path | None, *, failed: bool = False) -> None:
        """Attach the outputs and close the run; a second call does nothing."""
        if self._finished:
            return
        self._finished = True
        if optimizations is not None:
            self._run.config.update({"optimizations": optimizations}, allow_val_change=True)
            self._run.summary["optimizations"] = optimizations
        if plot is not None and Path(plot).is_file():
            self._run.log({"loss_plot": self._wandb.Image(str(plot))})
        self._run.finish(exit_code=1 if failed else 0)
