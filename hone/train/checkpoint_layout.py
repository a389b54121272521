"""What a checkpoint directory is, shared by the one-process and the sharded formats: its
files, how complete ones are found, listed and pruned, its trainer state and RNG state.

:mod:`hone.train.checkpoint` (one process, safetensors + torch files) and
:mod:`hone.train.sharded_checkpoint` (FSDP2, torch.distributed.checkpoint) both write this layout,
so ``latest_checkpoint``, ``training.resume`` and pruning treat them alike.
"""

import json
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hone.errors import HoneError, WriteError
from hone.run_files import CHECKPOINTS_DIR

COMPLETE = "COMPLETE"
WEIGHTS_FILE = "trainable.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
SCALER_FILE = "scaler.pt"
RNG_FILE = "rng.pt"
STATE_FILE = "trainer_state.json"

_STEP_DIR = re.compile(r"^step-(\d+)$")


class CheckpointError(HoneError):
    """A checkpoint to resume from is missing, incomplete or unreadable."""


class CheckpointSaveError(WriteError):
    """A checkpoint could not be written (disk full, read-only); earlier ones are untouched."""


# ---------------------------------------------------------------- finding checkpoints


def checkpoints_root(output_dir: Path) -> Path:
    return Path(output_dir) / CHECKPOINTS_DIR


def is_complete(path: Path) -> bool:
    return (Path(path) / COMPLETE).is_file()


def list_checkpoints(output_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints of a run, oldest first. Temp and unmarked directories are skipped."""
    root = checkpoints_root(output_dir)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and child.is_dir() and is_complete(child):
            found.append((int(match.group(1)), child))
    return sorted(found)


def latest_checkpoint(output_dir: Path) -> Path | None:
    found = list_checkpoints(output_dir)
    return found[-1][1] if found else None


def remove_temp_dirs(output_dir: Path) -> None:
    """Leftovers of saves that crashed half-way (never complete, never resumed from)."""
    root = checkpoints_root(output_dir)
    if root.is_dir():
        for child in root.iterdir():
            if child.name.startswith(".tmp-") or child.name.startswith(".old-"):
                shutil.rmtree(child, ignore_errors=True)


def prune_checkpoints(output_dir: Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints; returns what was deleted."""
    found = list_checkpoints(output_dir)
    doomed = [path for _, path in found[: max(0, len(found) - keep)]]
    for path in doomed:
        _remove_checkpoint(path)
    return doomed


def remove_checkpoints_after(output_dir: Path, step: int) -> list[Path]:
    """Drop checkpoints newer than ``step``: after resuming from ``step`` they belong to an
    abandoned continuation, and leaving them would make a later ``resume: latest`` jump back
    onto it (and pruning would keep them over the new ones)."""
    doomed = [path for s, path in list_checkpoints(output_dir) if s > step]
    for path in doomed:
        _remove_checkpoint(path)
    return doomed


def _remove_checkpoint(path: Path) -> None:
    # Unmark first: if the removal is interrupted, the remains are no longer a checkpoint.
    (path / COMPLETE).unlink(missing_ok=True)
    shutil.rmtree(path, ignore_errors=True)


def read_trainer_state(path: Path) -> dict[str, Any]:
    try:
        return json.loads((Path(path) / STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"cannot read {Path(path) / STATE_FILE}: {exc}") from None


# ---------------------------------------------------------------- RNG state


def capture_rng() -> dict[str, Any]:
    """Every generator a training step draws from (dropout, any python/numpy randomness)."""
    np_state = np.random.get_state(legacy=False)
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "bit_generator": np_state["bit_generator"],
            "key": [int(k) for k in np_state["state"]["key"]],
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np_state = state["numpy"]
    np.random.set_state(
        {
            "bit_generator": np_state["bit_generator"],
            "state": {"key": np.asarray(np_state["key"], dtype=np.uint32), "pos": np_state["pos"]},
            "has_gauss": np_state["has_gauss"],
            "gauss": np_state["gauss"],
        }
    )
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
