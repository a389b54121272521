"""Sharded checkpoints: every rank writes its own shards with torch.distributed.checkpoint (DCP).

The layout is that of :mod:`hone.train.checkpoint` (``checkpoints/step-<N>/`` with a
``COMPLETE`` marker, found by ``latest_checkpoint``/``is_complete``), with the weights and the
optimizer as a DCP directory instead of ``trainable.safetensors`` + ``optimizer.pt``:

    dcp/                   model (trainable weights only) and optimizer state, one file per rank
                           plus DCP's metadata; keys are parameter names (FQNs), never indices
    scheduler.pt           LambdaLR state (the same on every rank; rank 0 writes it)
    rng-rank<R>.pt         each rank's generators (dropout streams differ per rank)
    trainer_state.json     step, data position, counters (rank 0), with ``world_size``
    COMPLETE               written by rank 0 once every rank has finished writing

Atomic as the single-process save: everything goes into ``.tmp-step-<N>-sharded``; a barrier
waits for every rank's shards; only then does rank 0 write the marker and rename the directory.
A run killed mid-save leaves a temp directory that resume never looks at.

Resume on the same world size is exact (weights, moments, RNG, data position). Resume on
another world size (2 -> 1, 1 -> 2) works because DCP reshards on load: the weights and the
optimizer moments are exact; what cannot be exact is the random state (a rank's dropout stream
has no counterpart when the ranks change: each rank takes the saved stream of its own rank
number, or rank 0's) and anything whose rounding depends on how the gradients are summed
(reduction order differs, so later steps agree to fp32 rounding, not bitwise). The data
position is global (the loop's stream), so the same rows follow.

Works on one process too (no process group: DCP writes a single shard), which is how a
1-process run's checkpoint resumes on 2.

Beside expert parallelism, each rank's block of the experts (a plain tensor FSDP2 leaves alone)
and its optimizer moments go into DCP as shards of the whole experts
(:func:`hone.train.expert_checkpoint.experts_as_dtensors`): every expert is written once, by the
rank that holds it. The run resumes exactly on the same ``N`` and on another layout (one process,
FSDP2 alone, expert parallelism beside DDP; tested from 2 ranks), and a checkpoint of one process
or of FSDP2 alone resumes under it: DCP reshards the experts like FSDP2's weights; the
optimizer's parameter groups, which that run splits into DTensors and plain blocks
(:func:`hone.train.optim.param_groups`), and an expert-minor ``lora_B`` stored as ``[out, r, E]``
are matched by :mod:`hone.train.checkpoint_layout_change`.
"""

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hone.atomic import fsync_path
from hone.models.adapters import unwrap_compiled
from hone.train.checkpoint_layout import (
    COMPLETE,
    SCHEDULER_FILE,
    STATE_FILE,
    CheckpointError,
    CheckpointSaveError,
    capture_rng,
    checkpoints_root,
    is_complete,
    prune_checkpoints,
    read_trainer_state,
    remove_temp_dirs,
    restore_rng,
)
from hone.train.checkpoint_layout_change import (
    as_saved_shapes,
    check_shapes,
    one_process_order,
    put_back,
    regroup,
    regroup_schedule,
    saved_group_template,
)
from hone.train.expert_checkpoint import experts_as_blocks, experts_as_dtensors
from hone.train.plain_shards import plain_shards

DCP_DIR = "dcp"


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _barrier() -> None:
    if _world_size() > 1:
        dist.barrier()


def _options(**extra: Any):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # frozen base weights come from the model source, as in the single-process checkpoint
    return StateDictOptions(ignore_frozen_params=True, **extra)


def _set_trainable_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    path: Path,
    model_state_dict: dict[str, Any],
    optim_state_dict: dict[str, Any],
    full_state_dict: bool = False,
) -> None:
    """``set_state_dict`` for a state that holds the trainable weights only: loading is not
    strict (the frozen base weights are absent by design, and a strict load refuses a LoRA model
    for them), so the check that every trainable weight was restored, and nothing else, is here."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    result = set_state_dict(
        model,
        optimizer,
        model_state_dict=model_state_dict,
        optim_state_dict=optim_state_dict,
        options=_options(strict=False, full_state_dict=full_state_dict),
    )
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    missing = sorted(k for k in getattr(result, "missing_keys", []) if k in trainable)
    unexpected = sorted(getattr(result, "unexpected_keys", []))
    if missing or unexpected:
        raise CheckpointError(
            f"cannot resume from {path}: it does not fit this run's trainable weights "
            f"(missing: {missing[:5] or 'none'}; not in this model: {unexpected[:5] or 'none'})"
        )


def training_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``{"model": trainable weights, "optim": optimizer state}`` keyed by parameter names, each
    rank's shards as DTensors (what DCP saves and loads in place), plain tensors inside: a float8
    weight's wrapper is not written (:mod:`hone.train.plain_shards`)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer, options=_options())
    return experts_as_dtensors(model, plain_shards({"model": model_sd, "optim": optim_sd}))


def is_sharded_checkpoint(path: Path) -> bool:
    return (Path(path) / DCP_DIR).is_dir()


def save_sharded_checkpoint(
    output_dir: Path,
    step: int,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    state: dict[str, Any],
    keep: int | None = None,
) -> Path:
    """Write ``checkpoints/step-<step>`` from every rank (all ranks call it); returns its path.

    Rank 0 owns the directory: it clears leftovers, writes the scheduler, trainer state and the
    marker, renames and prunes; every rank writes its DCP shard and its RNG state."""
    import torch.distributed.checkpoint as dcp

    root = checkpoints_root(output_dir)
    final = root / f"step-{step}"
    tmp = root / f".tmp-step-{step}-sharded"
    rank = _rank()
    try:
        if rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            remove_temp_dirs(output_dir)
            tmp.mkdir()
        _barrier()
        dcp.save(training_state_dict(model, optimizer), checkpoint_id=str(tmp / DCP_DIR))
        torch.save(capture_rng(), tmp / f"rng-rank{rank}.pt")
        if rank == 0:
            torch.save(scheduler.state_dict(), tmp / SCHEDULER_FILE)
            (tmp / STATE_FILE).write_text(json.dumps({**state, "world_size": _world_size()}, indent=1), encoding="utf-8")
        _barrier()  # every rank's shards are on disk
        if rank == 0:
            (tmp / COMPLETE).write_text(json.dumps({"step": step, "world_size": _world_size()}) + "\n", encoding="utf-8")
            fsync_path(tmp)
            if final.exists():  # the same step saved before (a re-run after resume): replace it
                old = root / f".old-step-{step}-{os.getpid()}"
                os.replace(final, old)
                os.replace(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, final)
            fsync_path(root)
            if keep is not None:
                prune_checkpoints(output_dir, keep)
        _barrier()
    except OSError as exc:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointSaveError(
            f"cannot save sharded checkpoint step-{step} in '{root}' ({exc.strerror or exc}); earlier checkpoints are "
            "intact. Free some space, then continue with training.resume: latest",
            getattr(exc, "errno", None),
        ) from exc
    return final


def load_sharded_checkpoint(
    path: Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> dict[str, Any]:
    """Restore trainable weights, optimizer, scheduler and RNG from a sharded checkpoint, on any
    world size (DCP reshards); returns its trainer state (with ``world_size`` it was saved on).

    All ranks call it, after the model is sharded and the optimizer built, before the first step."""
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    if not is_complete(path):
        raise CheckpointError(f"'{path}' is not a complete checkpoint (no {COMPLETE} marker)")
    if not is_sharded_checkpoint(path):
        raise CheckpointError(f"'{path}' is not a sharded checkpoint (no {DCP_DIR}/ directory)")
    state = read_trainer_state(path)
    schedule = torch.load(path / SCHEDULER_FILE, map_location="cpu", weights_only=True)
    reader = dcp.FileSystemReader(str(path / DCP_DIR))
    metadata = reader.read_metadata()
    wanted = training_state_dict(model, optimizer)
    current = wanted["optim"]["param_groups"]  # this optimizer's groups, weights named
    wanted["optim"]["param_groups"] = saved_group_template(metadata)  # the saved groups, whatever the layout
    undo = as_saved_shapes(wanted, metadata)  # an expert lora_B saved as [out, r, E]
    check_shapes(wanted, metadata, path)
    try:
        dcp.load(wanted, storage_reader=reader)
    except Exception as exc:  # DCP reports missing keys and bad shapes as CheckpointException
        raise CheckpointError(f"cannot resume from {path}: it does not fit this run's model or optimizer ({exc})") from None
    put_back(undo)
    saved_groups = wanted["optim"]["param_groups"]
    wanted["optim"]["param_groups"], mapping = regroup(current, saved_groups, path)
    wanted = experts_as_blocks(model, wanted)  # loaded into the views: each rank's block again
    _set_trainable_state(model, optimizer, path, model_state_dict=wanted["model"], optim_state_dict=wanted["optim"])
    schedule = regroup_schedule(schedule, mapping, len(saved_groups))
    scheduler.load_state_dict(schedule)
    rng = path / f"rng-rank{_rank()}.pt"
    if not rng.is_file():  # more ranks than the run that saved it: no stream of its own
        rng = path / "rng-rank0.pt"
    restore_rng(torch.load(rng, map_location="cpu", weights_only=True))
    return state


def _is_subclass(value: Any) -> bool:
    """A tensor subclass (torchao's quantized optimizer state), not a plain tensor."""
    return isinstance(value, torch.Tensor) and type(value) is not torch.Tensor and not isinstance(value, nn.Parameter)


def _expert_blocks(
    model: nn.Module, weights: dict[str, torch.Tensor], moments: dict[str, dict[str, Any]], path: Path
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
    """The whole experts' weights and moments of a one-process checkpoint as this rank's blocks
    (expert parallelism beside FSDP2 keeps them as plain tensors FSDP2 leaves alone)."""
    from hone.models.experts.sharded_state import sharded_tensors

    specs = sharded_tensors(unwrap_compiled(model))
    if not specs:
        return weights, moments

    def block(name: str, value: Any) -> Any:
        if name not in specs or not isinstance(value, torch.Tensor) or value.dim() == 0:
            return value
        try:
            return specs[name].block(value)
        except (RuntimeError, ValueError) as exc:
            raise CheckpointError(f"cannot resume from {path}: '{name}' does not split over this run's experts ({exc})") from None

    weights = {name: block(name, value) for name, value in weights.items()}
    moments = {name: {key: block(name, value) for key, value in values.items()} for name, values in moments.items()}
    return weights, moments


def load_full_checkpoint_sharded(
    path: Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> dict[str, Any]:
    """Resume a sharded model from a one-process checkpoint (``trainable.safetensors`` +
    ``optimizer.pt``): every rank reads the whole files and keeps its shards.

    ``optimizer.pt`` numbers the parameters in the order the optimizer was built; hone builds
    it in the same order on every world size, so the numbers map to this optimizer's parameter
    names, which is how torch's full optimizer state dict is keyed."""
    from safetensors.torch import load_file

    from hone.train.checkpoint_layout import OPTIMIZER_FILE, RNG_FILE, WEIGHTS_FILE

    state = read_trainer_state(path)
    weights = load_file(str(path / WEIGHTS_FILE))
    saved = torch.load(path / OPTIMIZER_FILE, map_location="cpu", weights_only=True)
    quantized = {type(v).__name__ for st in saved["state"].values() for v in st.values() if _is_subclass(v)}
    if quantized:
        # torchao's low-bit moments (optimizer.name: adamw_8bit / adamw_4bit) cannot be split into
        # shards; loading them dequantized would continue with full-precision moments, unasked
        raise CheckpointError(
            f"cannot resume from {path} on several FSDP ranks: it is a one-process checkpoint whose optimizer "
            f"state is quantized ({', '.join(sorted(quantized))}, optimizer.name: adamw_8bit / adamw_4bit), which "
            "hone cannot split into shards: resume it on one process (a sharded checkpoint of an FSDP run resumes "
            "on any number of ranks)"
        )
    order = one_process_order(model)  # the indices of optimizer.pt, whatever this run's groups
    if len(order) != sum(len(g["params"]) for g in saved["param_groups"]):
        raise CheckpointError(f"checkpoint {path} does not fit this run's optimizer (another model or adapter?)")
    by_index = dict(enumerate(order))
    optim_sd = {
        "state": {by_index[i]: value for i, value in saved["state"].items()},
        "param_groups": [{**g, "params": [by_index[i] for i in g["params"]]} for g in saved["param_groups"]],
    }
    weights, optim_sd["state"] = _expert_blocks(model, weights, optim_sd["state"], path)
    names = {id(p): n for n, p in model.named_parameters()}
    current = [{"params": [names[id(p)] for p in g["params"]]} for g in optimizer.param_groups]
    optim_sd["param_groups"], mapping = regroup(current, optim_sd["param_groups"], path)
    try:
        _set_trainable_state(model, optimizer, path, model_state_dict=weights, optim_state_dict=optim_sd, full_state_dict=True)
    except (KeyError, RuntimeError, ValueError) as exc:
        raise CheckpointError(f"cannot resume from {path}: {exc}") from None
    schedule = torch.load(path / SCHEDULER_FILE, map_location="cpu", weights_only=True)
    scheduler.load_state_dict(regroup_schedule(schedule, mapping, len(saved["param_groups"])))
    restore_rng(torch.load(path / RNG_FILE, map_location="cpu", weights_only=True))
    return state
