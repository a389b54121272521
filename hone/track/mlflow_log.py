"""MLflow: one MLflow run per hone run (``logging.trackers: [mlflow]``).

Uses MLflow's client API (``MlflowClient``) rather than the module-level active run, so hone
never changes the process's global MLflow state. The run gets the resolved config as
``config.yml`` and as flattened parameters, each metrics row as metrics at its optimizer step,
and at the end ``optimizations.json`` and ``loss.png`` as artifacts.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hone.track.rows import run_name, scalars

if TYPE_CHECKING:
    from hone.config.root import HoneConfig

#: MLflow refuses longer parameter values on some stores; the whole config is in config.yml.
MAX_PARAM_CHARS = 500


def flatten(value: Any, prefix: str = "") -> dict[str, str]:
    """``{"training.max_steps": "4", ...}`` from a nested config dict."""
    if isinstance(value, dict):
        out: dict[str, str] = {}
        for key, item in value.items():
            out.update(flatten(item, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): str(value)[:MAX_PARAM_CHARS]}


class MlflowLog:
    name = "mlflow"

    def __init__(self, cfg: HoneConfig, output_dir: Path, config: dict[str, Any], config_yaml: str):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        settings = cfg.logging.mlflow
        self._finished = False
        self._client = MlflowClient(tracking_uri=settings.tracking_uri)
        experiment = self._client.get_experiment_by_name(settings.experiment)
        experiment_id = (
            experiment.experiment_id if experiment is not None else self._client.create_experiment(settings.experiment)
        )
        self._run_id = self._client.create_run(experiment_id, run_name=run_name(cfg, settings.run_name)).info.run_id
        self._client.log_text(self._run_id, config_yaml, "config.yml")
        params = [Param(key, value) for key, value in flatten(config).items()]
        for start in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self._client.log_batch(self._run_id, params=params[start : start + 100])

    @property
    def run_id(self) -> str:
        return self._run_id

    def write(self, row: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        now, step = int(time.time() * 1000), int(row["step"])
        metrics = [Metric(key, value, now, step) for key, value in scalars(row).items()]
        if metrics:
            self._client.log_batch(self._run_id, metrics=metrics)

    def finish(self, optimizations: dict[str, Any] | None, plot: Path | None, *, failed: bool = False) -> None:
        """Attach the outputs and end the run (FINISHED or FAILED); a second call does nothing."""
        if self._finished:
            return
        self._finished = True
        if optimizations is not None:
            self._client.log_dict(self._run_id, optimizations, "optimizations.json")
        if plot is not None and Path(plot).is_file():
            self._client.log_artifact(self._run_id, str(plot))
        self._client.set_terminated(self._run_id, status="FAILED" if failed else "FINISHED")
