"""Experiment trackers (``logging.trackers``): start them before the model loads, fan rows out.

Each tracker is a small class with the same three steps: its constructor starts the run and
hands it the resolved config; ``write(row)`` takes every metrics row (train and eval, keyed
by optimizer step, with the TensorBoard tag names so every tracker shows the same charts);
``finish(optimizations, plot)`` attaches ``optimizations.json`` and ``loss.png`` and closes.

Starting is where trackers fail (package missing, no login, a tracking URI that cannot be
written), so :func:`start_trackers` runs in ``hone train``'s first start-up phase, before the
data and the model, and :func:`tracker_problems` lets ``hone validate`` report the same
problems without starting anything. ``logging.tracker_errors: warn`` turns both into warnings.
A tracker that fails later, mid-run, is dropped with a warning: an unreachable server must not
end hours of training.

TensorBoard stays with :class:`~hone.track.tracker.Tracker` (it needs the resumed step to hide
the interrupted run's events); the external trackers live here.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from hone.errors import HoneError

if TYPE_CHECKING:
    from hone.config.root import HoneConfig

#: Tracker name -> (module to import, package to install, extra of hone that installs it).
PACKAGES = {
    "tensorboard": ("tensorboard", "tensorboard", None),
    "wandb": ("wandb", "wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow-skinny", "mlflow"),
}


class TrackerStartError(HoneError):
    """A tracker of ``logging.trackers`` cannot start (and ``logging.tracker_errors`` is ``error``)."""


class ExternalTracker(Protocol):
    name: str

    def write(self, row: dict[str, Any]) -> None: ...

    def finish(self, optimizations: dict[str, Any] | None, plot: Path | None, *, failed: bool = False) -> None:
        """Attach the outputs and close; idempotent (a run that fails closes what is open)."""
        ...


# ---------------------------------------------------------------- checks without starting


def tracker_problems(cfg: HoneConfig) -> list[tuple[str, str]]:
    """``(key, problem)`` for every tracker of ``cfg`` that could not start, found without
    starting it: its package is missing, W&B has no login for an online run, MLflow's file
    store is not a directory. Reads the environment and the file system only."""
    found = (tracker_problem(cfg, name) for name in cfg.logging.active_trackers)
    return [problem for problem in found if problem is not None]


def tracker_problem(cfg: HoneConfig, name: str) -> tuple[str, str] | None:
    """Why tracker ``name`` could not start, as ``(key, problem)``, or None."""
    module, package, extra = PACKAGES[name]
    if importlib.util.find_spec(module) is None:
        how = f"pip install 'hone[{extra}]'" if extra else f"pip install {package}"
        return (
            "logging.trackers",
            f"{name} needs the Python package '{package}', which is not installed: {how}, or remove {name} from logging.trackers",
        )
    if name == "wandb" and (problem := _wandb_login_problem(cfg)):
        return "logging.wandb", problem
    if name == "mlflow" and (problem := _mlflow_uri_problem(cfg.logging.mlflow.tracking_uri)):
        return "logging.mlflow.tracking_uri", problem
    return None


def _wandb_mode(cfg: HoneConfig) -> str:
    return cfg.logging.wandb.mode or os.environ.get("WANDB_MODE", "online")


def _wandb_login_problem(cfg: HoneConfig) -> str | None:
    """An online W&B run needs an API key (``WANDB_API_KEY`` or ``wandb login``'s netrc entry)."""
    if _wandb_mode(cfg) in ("offline", "dryrun", "disabled") or os.environ.get("WANDB_API_KEY"):
        return None
    import netrc
    from urllib.parse import urlparse

    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    try:
        if netrc.netrc(os.environ.get("NETRC")).authenticators(host):
            return None
    except (OSError, netrc.NetrcParseError):
        pass
    return (
        f"an online W&B run needs a login, and none was found (no WANDB_API_KEY, no {host} entry in ~/.netrc): "
        "run `wandb login`, set WANDB_API_KEY, or set logging.wandb.mode: offline (sync later with `wandb sync`)"
    )


def _mlflow_uri_problem(uri: str | None) -> str | None:
    """A ``file:`` store must be a directory (or creatable); other schemes are MLflow's to judge."""
    uri = uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri or not uri.startswith("file:"):
        return None
    from urllib.parse import unquote, urlparse

    path = Path(unquote(urlparse(uri).path) or uri.removeprefix("file:"))
    if path.exists() and not path.is_dir():
        return f"'{uri}' points at a file; an MLflow file store is a directory"
    return None


# ---------------------------------------------------------------- starting


def start_trackers(cfg: HoneConfig, warn: Callable[[str], None], *, output_dir: Path | None = None) -> list[ExternalTracker]:
    """Start the external trackers of ``cfg`` (rank 0 only), each given the resolved config.
    A tracker that cannot start raises :class:`TrackerStartError`, or is skipped with a
    warning under ``logging.tracker_errors: warn``."""
    from hone.config.loader import dump_config

    output_dir = Path(output_dir or cfg.training.output_dir)
    config = cfg.model_dump(mode="json")
    started: list[ExternalTracker] = []
    for name in cfg.logging.active_trackers:
        if name == "tensorboard":
            continue
        problem = tracker_problem(cfg, name)
        try:
            if problem is not None:
                raise TrackerStartError(f"{problem[0]}: {problem[1]}")
            if name == "wandb":
                from hone.track.wandb_log import WandbLog

                started.append(WandbLog(cfg, output_dir, config))
            else:
                from hone.track.mlflow_log import MlflowLog

                started.append(MlflowLog(cfg, output_dir, config, dump_config(cfg)))
        except Exception as exc:
            message = (
                str(exc)
                if isinstance(exc, TrackerStartError)
                else f"logging.trackers: {name} cannot start: {type(exc).__name__}: {exc}"
            )
            if cfg.logging.tracker_errors == "warn":
                warn(f"{message}; training without it (logging.tracker_errors: warn)")
                continue
            abandon_trackers(started)  # do not leave the others' runs open
            raise TrackerStartError(f"{message} (set logging.tracker_errors: warn to train without it)") from None
    return started


def read_optimizations(output_dir: Path) -> dict[str, Any] | None:
    """``optimizations.json`` of the run, if written."""
    from hone.run_files import OPTIMIZATIONS_FILE

    path = Path(output_dir) / OPTIMIZATIONS_FILE
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def abandon_trackers(trackers: list[ExternalTracker]) -> None:
    """Close trackers of a run that stopped with an error (marked failed; closed ones stay closed)."""
    for tracker in trackers:
        _quietly(lambda t=tracker: t.finish(None, None, failed=True))


def _quietly(action: Callable[[], object]) -> str | None:
    try:
        action()
    except Exception as exc:  # a tracker's own failure while closing must not hide the run's
        return f"{type(exc).__name__}: {exc}"
    return None
