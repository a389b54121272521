"""Resumable checkpoints under ``<output_dir>/checkpoints/step-<N>/``.

A checkpoint holds everything the next optimizer step depends on:

    trainable.safetensors  trainable weights (frozen base weights come from the model source)
    optimizer.pt           AdamW state (moments, step counts, param groups)
    scheduler.pt           LambdaLR state, including the schedule's shape
    scaler.pt              fp16 loss-scaler state (fp16 runs only)
    rng.pt                 python, numpy, torch CPU and CUDA generator states
    trainer_state.json     step, data position, counters and the eval rows so far
    COMPLETE               written last: only directories holding it count as checkpoints

Saving is atomic: files go into a hidden temp directory, each is fsync'd, the ``COMPLETE``
marker is written last, and only then is the directory renamed to ``step-<N>``. A crash
mid-save leaves a ``.tmp-*`` directory that resume never looks at (and the next save removes);
a save that fails with an error (disk full) removes its temp directory itself and raises
:class:`CheckpointSaveError`, saying which earlier checkpoint is intact.

Resume: ``training.resume: latest`` takes the newest complete checkpoint in ``output_dir``; if
there is none, the run **starts from scratch with a warning**, so a config can say ``latest``
once and be re-run after every preemption, including the first time. ``training.resume:
PATH`` (a ``step-<N>`` directory, or a run directory meaning its latest) must exist and be
complete, else the run stops with an error: an explicit path that is wrong is a mistake.

The metrics history of a resumed run (the report's eval losses, ``metrics.jsonl``, the loss
plot) comes from the ``metrics.jsonl`` of the run the checkpoint belongs to, truncated to the
checkpoint's step (:func:`resume_history`); ``trainer_state.json`` keeps only the eval rows
(one per eval, not one per logged step), for a checkpoint moved away from its run.
Every ``.pt`` file is read with ``torch.load(weights_only=True)``: a checkpoint cannot run code.

A model sharded by FSDP2 saves and loads through :mod:`hone.train.sharded_checkpoint` (same
layout and marker, weights and optimizer as a DCP directory); :func:`save_checkpoint` and
:func:`load_checkpoint` pick the right one, so the loop calls them the same way. A one-process
checkpoint resumes on several ranks, a sharded one on any number.
"""

import json
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file, save_file

from hone.atomic import fsync_path, normal_file_mode
from hone.config.training import TrainingConfig
from hone.errors import HoneError
from hone.models.save import load_trainable_state_dict, trainable_state_dict
from hone.models.structure import is_sharded
from hone.run_files import CHECKPOINTS_DIR, METRICS_FILE
from hone.track.metrics import is_eval_row, read_metrics
from hone.train.checkpoint_layout import (  # noqa: F401  (re-exported: the layout is part of this module's API)
    COMPLETE,
    OPTIMIZER_FILE,
    RNG_FILE,
    SCALER_FILE,
    SCHEDULER_FILE,
    STATE_FILE,
    WEIGHTS_FILE,
    CheckpointError,
    CheckpointSaveError,
    capture_rng,
    checkpoints_root,
    is_complete,
    latest_checkpoint,
    list_checkpoints,
    prune_checkpoints,
    read_trainer_state,
    remove_checkpoints_after,
    remove_temp_dirs,
    restore_rng,
)

if TYPE_CHECKING:
    from hone.runtime.checkpoints import StateDictHooks


# ---------------------------------------------------------------- which checkpoint to resume


def resolve_resume(training: TrainingConfig, warn: Callable[[str], None] = print) -> Path | None:
    """The checkpoint directory ``training.resume`` points at, or None to start fresh."""
    if training.resume is None:
        return None
    if training.resume == "latest":
        found = latest_checkpoint(training.output_dir)
        if found is None:
            warn(f"training.resume is 'latest' but {training.output_dir} has no complete checkpoint yet: starting from scratch")
        return found
    path = Path(training.resume)
    if not path.exists():
        raise CheckpointError(f"training.resume: checkpoint '{path}' does not exist")
    if not is_complete(path) and checkpoints_root(path).is_dir():  # a run directory: take its latest
        found = latest_checkpoint(path)
        if found is None:
            raise CheckpointError(f"training.resume: run directory '{path}' holds no complete checkpoint")
        return found
    if not is_complete(path):
        raise CheckpointError(
            f"training.resume: '{path}' is not a complete checkpoint (no {COMPLETE} marker: it was "
            f"interrupted while saving, or is not a hone checkpoint); pick a step-<N> directory under "
            f"{CHECKPOINTS_DIR}/"
        )
    return path


# ---------------------------------------------------------------- saving


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as handle:
        os.fsync(handle.fileno())


def _write_weights(directory: Path, model: torch.nn.Module, state_dict_hooks: Sequence["StateDictHooks"] = ()) -> None:
    weights = trainable_state_dict(model)
    for hooks in state_dict_hooks:  # the plan's transforms, in plan order (e.g. quantized weights)
        if hooks.save is not None:
            weights = hooks.save(weights)
    save_file(weights, str(directory / WEIGHTS_FILE))
    normal_file_mode(directory / WEIGHTS_FILE)  # safetensors writes 0600; the other files follow the umask
    _fsync_file(directory / WEIGHTS_FILE)


def _write_torch(directory: Path, name: str, obj: Any) -> None:
    torch.save(obj, directory / name)
    _fsync_file(directory / name)


def _write_state(directory: Path, state: dict[str, Any]) -> None:
    (directory / STATE_FILE).write_text(json.dumps(state, indent=1), encoding="utf-8")
    _fsync_file(directory / STATE_FILE)


def _write_marker(directory: Path, step: int) -> None:
    (directory / COMPLETE).write_text(json.dumps({"step": step}) + "\n", encoding="utf-8")
    _fsync_file(directory / COMPLETE)


def save_checkpoint(
    output_dir: Path,
    step: int,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    state: dict[str, Any],
    scaler: torch.amp.GradScaler | None = None,
    keep: int | None = None,
    state_dict_hooks: Sequence["StateDictHooks"] = (),
) -> Path:
    """Write ``checkpoints/step-<step>`` atomically, then keep only the newest ``keep``.
    ``state_dict_hooks`` (the plan's) map the trainable weights on their way to the file."""
    if is_sharded(model):  # FSDP2: every rank writes its shards (hone.train.sharded_checkpoint)
        from hone.train.sharded_checkpoint import save_sharded_checkpoint

        if any(h.save is not None for h in state_dict_hooks):
            raise CheckpointSaveError(
                f"cannot save checkpoint step-{step}: "
                "a sharded model's weights cannot go through a transform's state-dict hooks yet"
            )
        return save_sharded_checkpoint(
            output_dir, step, model=model, optimizer=optimizer, scheduler=scheduler, state=state, keep=keep
        )
    root = checkpoints_root(output_dir)
    final = root / f"step-{step}"
    tmp = root / f".tmp-step-{step}-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        remove_temp_dirs(output_dir)
        tmp.mkdir()
        _write_weights(tmp, model, state_dict_hooks)
        _write_torch(tmp, OPTIMIZER_FILE, optimizer.state_dict())
        _write_torch(tmp, SCHEDULER_FILE, scheduler.state_dict())
        if scaler is not None and scaler.is_enabled():
            _write_torch(tmp, SCALER_FILE, scaler.state_dict())
        _write_torch(tmp, RNG_FILE, capture_rng())
        _write_state(tmp, state)
        _write_marker(tmp, step)
        fsync_path(tmp)
        _publish(tmp, final, root, step)
    except (OSError, RuntimeError) as exc:  # torch.save reports a full disk as RuntimeError
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, RuntimeError) and not _looks_like_write_failure(exc):
            raise
        raise CheckpointSaveError(_save_failure(output_dir, step, exc), getattr(exc, "errno", None)) from exc
    fsync_path(root)
    if keep is not None:
        prune_checkpoints(output_dir, keep)
    return final


def _publish(tmp: Path, final: Path, root: Path, step: int) -> None:
    if final.exists():  # the same step saved before (e.g. re-run after a resume): replace it
        old = root / f".old-step-{step}-{os.getpid()}"
        os.replace(final, old)
        try:
            os.replace(tmp, final)
        except OSError:
            os.replace(old, final)  # put the earlier save of this step back
            raise
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)


def _looks_like_write_failure(exc: RuntimeError) -> bool:
    text = str(exc).lower()
    return any(word in text for word in ("no space", "write", "file", "disk", "errno"))


def _save_failure(output_dir: Path, step: int, exc: BaseException) -> str:
    reason = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
    previous = latest_checkpoint(output_dir)
    kept = (
        f"the previous checkpoint {previous} is intact"
        if previous is not None
        else "no earlier checkpoint exists, and nothing half-written was left"
    )
    return (
        f"cannot save checkpoint step-{step} in '{checkpoints_root(output_dir)}' ({reason}); {kept}. "
        "Free some space (or lower training.save_total_limit), then continue with training.resume: latest"
    )


# ---------------------------------------------------------------- loading


def _load_torch(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file missing: {path}") from None
    except Exception as exc:  # corrupt or foreign file
        raise CheckpointError(f"cannot read checkpoint file {path}: {exc}") from None


def load_checkpoint(
    path: Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    scaler: torch.amp.GradScaler | None = None,
    state_dict_hooks: Sequence["StateDictHooks"] = (),
) -> dict[str, Any]:
    """Restore weights, optimizer, scheduler, scaler and RNG from ``path``; return its trainer state.
    ``state_dict_hooks`` (the plan's) map the weights read back, in reverse plan order.

    Call it after the model, optimizer and scheduler are built for the new process and before
    the first step; the RNG restore must come last so nothing draws from it in between.
    """
    path = Path(path)
    if not is_complete(path):
        raise CheckpointError(f"'{path}' is not a complete checkpoint (no {COMPLETE} marker)")
    from hone.train.sharded_checkpoint import is_sharded_checkpoint, load_sharded_checkpoint

    if is_sharded_checkpoint(path):  # written by sharded ranks; DCP reshards for this world
        return load_sharded_checkpoint(path, model=model, optimizer=optimizer, scheduler=scheduler)
    if is_sharded(model):  # a one-process checkpoint resumed on several ranks
        from hone.train.sharded_checkpoint import load_full_checkpoint_sharded

        return load_full_checkpoint_sharded(path, model=model, optimizer=optimizer, scheduler=scheduler)
    state = read_trainer_state(path)
    try:
        weights = load_file(str(path / WEIGHTS_FILE))
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file missing: {path / WEIGHTS_FILE}") from None
    for hooks in reversed(list(state_dict_hooks)):
        if hooks.load is not None:
            weights = hooks.load(weights)
    try:
        load_trainable_state_dict(model, weights)
    except HoneError as exc:
        raise CheckpointError(f"cannot resume from {path}: {exc}") from None
    try:
        optimizer.load_state_dict(_load_torch(path / OPTIMIZER_FILE))
        scheduler.load_state_dict(_load_torch(path / SCHEDULER_FILE))
    except (ValueError, KeyError) as exc:
        raise CheckpointError(f"checkpoint {path} does not fit this run's optimizer: {exc}") from None
    if scaler is not None and scaler.is_enabled() and (path / SCALER_FILE).exists():
        scaler.load_state_dict(_load_torch(path / SCALER_FILE))
    restore_rng(_load_torch(path / RNG_FILE))
    return state


def resume_history(checkpoint: Path, state: dict[str, Any]) -> list[dict[str, Any]]:
    """The metrics rows a run resumed from ``checkpoint`` continues, up to its step.

    They are read from the ``metrics.jsonl`` of the checkpoint's run
    (``<run>/checkpoints/step-<N>/`` -> ``<run>/metrics.jsonl``). Without that file (a
    checkpoint copied on its own) the eval rows saved in the checkpoint are what is left, which
    is all the report needs; a checkpoint from before hone stopped saving every row brings them
    (``metrics``)."""
    step = int(state.get("step", 0))
    run_metrics = Path(checkpoint).parent.parent / METRICS_FILE
    rows = read_metrics(run_metrics) if run_metrics.is_file() else []
    if not rows:
        rows = list(state.get("metrics") or state.get("eval_rows") or [])
    return [r for r in rows if r.get("step", 0) <= step]


def checkpoint_eval_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What ``trainer_state.json`` keeps of the metrics: the eval rows (one per eval)."""
    return [r for r in rows if is_eval_row(r)]
