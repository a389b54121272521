"""TensorBoard event files under ``<output_dir>/tensorboard/``.

A resumed run opens its writer with ``purge_step``: TensorBoard then hides the events that the
interrupted run wrote after the checkpoint, as ``metrics.jsonl`` drops its rows.
"""

from pathlib import Path
from typing import Any

from hone.track.preference_metrics import PREFERENCE_METRICS

#: Metrics row key -> TensorBoard tag.
TRAIN_TAGS = {
    "loss": "train/loss",
    "loss_step": "train/loss_step",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "tokens_per_s": "train/tokens_per_s",
    "step_time_s": "train/step_time_s",
    "peak_mem_gib": "train/peak_mem_gib",
    "peak_reserved_gib": "train/peak_reserved_gib",
    **{name: f"train/{name}" for name in PREFERENCE_METRICS},
}
EVAL_TAGS = {"eval_loss": "eval/loss", "eval_ppl": "eval/ppl", **{f"eval_{name}": f"eval/{name}" for name in PREFERENCE_METRICS}}


class TensorBoardLog:
    """Scalars of each metrics row, keyed by optimizer step."""

    def __init__(self, log_dir: Path, *, purge_step: int | None = None):
        from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only when enabled

        self._writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)

    def write(self, row: dict[str, Any]) -> None:
        step = int(row["step"])
        for key, tag in (*TRAIN_TAGS.items(), *EVAL_TAGS.items()):
            value = row.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self._writer.add_scalar(tag, value, step)

    def text(self, tag: str, text: str) -> None:
        """Text for TensorBoard's text tab, shown as code (the config, the optimizations)."""
        body = "\n".join("    " + line for line in text.splitlines())  # markdown code block
        self._writer.add_text(tag, body, 0)

    def finish(self, optimizations: dict[str, Any] | None, plot: Path | None) -> None:
        """The applied optimizations (text tab) and ``loss.png`` (images tab) at the end."""
        if optimizations is not None:
            import json

            self.text("optimizations", json.dumps(optimizations, indent=2))
        if plot is not None and Path(plot).is_file():
            try:
                from matplotlib.image import imread

                self._writer.add_image("loss_plot", imread(str(plot)), 0, dataformats="HWC")
            except (ImportError, OSError, ValueError):
                pass  # the plot is still in the run directory

    def close(self) -> None:
        self._writer.flush()
        self._writer.close()
