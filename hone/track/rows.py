"""What every experiment tracker sends, in one place: a metrics row's numbers under the shared
tag names (``train/loss``, ``eval/loss``, ...) and the run's name."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from hone.track.tensorboard import EVAL_TAGS, TRAIN_TAGS

if TYPE_CHECKING:
    from hone.config.root import HoneConfig


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """The row's numbers under their tracker tags (``train/loss``, ``eval/loss``, ...)."""
    out = {}
    for key, tag in (*TRAIN_TAGS.items(), *EVAL_TAGS.items()):
        value = row.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[tag] = float(value)
    return out


def run_name(cfg: HoneConfig, configured: str | None) -> str:
    """The configured run name, else the name of ``training.output_dir``."""
    return configured or Path(cfg.training.output_dir).resolve().name
