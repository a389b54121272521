"""What a run reports while it trains and leaves behind."""

from pydantic import Field

from hone.config.base import Section


class LoggingConfig(Section):
    """Metrics, TensorBoard, the loss plot and the progress bar."""

    logging_steps: int = Field(1, ge=1)
    """Write a metrics row every N optimizer steps."""

    tensorboard: bool = True
    """Write TensorBoard event files under ``<output_dir>/tensorboard``."""

    plot: bool = True
    """Draw ``loss.png`` (train and eval loss) at the end of the run."""

    progress_bar: bool = True
    """Live progress bar with step, loss, lr, tokens/s and ETA (off when not a terminal)."""
