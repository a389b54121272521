"""What a run reports while it trains and leaves behind."""

from typing import Literal

from pydantic import Field, model_validator

from hone.config.base import Section

TrackerName = Literal["tensorboard", "wandb", "mlflow"]


class WandbConfig(Section):
    """Weights & Biases settings (read only when ``logging.trackers`` lists ``wandb``)."""

    project: str = "hone"
    """W&B project the run is logged to."""

    entity: str | None = None
    """W&B team or user; defaults to the logged-in user's default entity."""

    name: str | None = None
    """Run name; defaults to the name of ``training.output_dir``."""

    mode: Literal["online", "offline"] | None = None
    """``offline`` writes the run under ``wandb/`` for a later ``wandb sync``; default: W&B's own
    (``WANDB_MODE``, else online)."""


class MlflowConfig(Section):
    """MLflow settings (read only when ``logging.trackers`` lists ``mlflow``)."""

    tracking_uri: str | None = None
    """Where runs are stored: ``file:./mlruns``, ``http://host:5000``, ...; default: MLflow's own
    (``MLFLOW_TRACKING_URI``, else ``./mlruns``)."""

    experiment: str = "hone"
    """Experiment the run is logged under (created if missing)."""

    run_name: str | None = None
    """Run name; defaults to the name of ``training.output_dir``."""


class LoggingConfig(Section):
    """Metrics, experiment trackers, the loss plot and the progress bar."""

    logging_steps: int = Field(1, ge=1)
    """Write a metrics row every N optimizer steps."""

    tensorboard: bool | None = None
    """Write TensorBoard event files under ``<output_dir>/tensorboard``; unset means yes unless
    ``trackers`` is set. The shorthand of configs without ``trackers``; with ``trackers`` (the
    whole list) it may only agree with it."""

    trackers: list[TrackerName] | None = None
    """Experiment trackers that receive the resolved config, every metrics row (train and
    eval), the applied optimizations and the loss plot: any of ``tensorboard``, ``wandb``
    (``pip install 'hone[wandb]'``), ``mlflow`` (``pip install 'hone[mlflow]'``). Unset:
    ``[tensorboard]`` if ``logging.tensorboard`` else none. Only rank 0 logs. See docs/tracking.md."""

    tracker_errors: Literal["error", "warn"] = "error"
    """A tracker that cannot start (package missing, bad settings, no login): ``error`` stops
    the run before the model loads; ``warn`` prints a warning and trains without it."""

    wandb: WandbConfig = Field(default_factory=WandbConfig)
    """Weights & Biases settings."""

    mlflow: MlflowConfig = Field(default_factory=MlflowConfig)
    """MLflow settings."""

    plot: bool = True
    """Draw ``loss.png`` (train and eval loss) at the end of the run."""

    progress_bar: bool = True
    """Live progress bar with step, loss, lr, tokens/s and ETA (off when not a terminal)."""

    @model_validator(mode="after")
    def _trackers_consistent(self) -> "LoggingConfig":
        if self.trackers is not None:
            twice = sorted({name for name in self.trackers if self.trackers.count(name) > 1})
            if twice:
                raise ValueError(f"logging.trackers lists {', '.join(twice)} more than once: list each tracker once")
            listed = "tensorboard" in self.trackers
            if self.tensorboard is not None and self.tensorboard != listed:
                raise ValueError(
                    f"logging.tensorboard: {str(self.tensorboard).lower()} contradicts logging.trackers "
                    f"{list(self.trackers)}, which {'lists' if listed else 'does not list'} tensorboard: "
                    "remove logging.tensorboard (logging.trackers is the whole list)"
                )
        for name, default in (("wandb", WandbConfig()), ("mlflow", MlflowConfig())):
            if getattr(self, name) != default and name not in self.active_trackers:
                raise ValueError(
                    f"logging.{name} is set but logging.trackers does not list {name}: add {name} to "
                    f"logging.trackers, or remove logging.{name}"
                )
        return self

    @property
    def active_trackers(self) -> list[TrackerName]:
        """The trackers this run starts: ``trackers``, else ``[tensorboard]`` per ``tensorboard``."""
        if self.trackers is not None:
            return list(self.trackers)
        return [] if self.tensorboard is False else ["tensorboard"]
