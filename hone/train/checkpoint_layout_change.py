"""Resuming a checkpoint on another layout of the same weights: what differs and how it is matched.

Two things depend on the layout a run trains on, not on its weights:

- the optimizer's parameter groups. :func:`hone.train.optim.param_groups` splits each
  weight-decay group into FSDP2's DTensors and plain tensors where a run mixes them (expert
  parallelism beside FSDP2: the experts' blocks stay plain), so such a run has 3 or 4 groups
  where one process, DDP or plain FSDP2 has 2. Groups are matched by parameter name
  (:func:`regroup`): each of this run's groups takes the hyperparameters (learning rate,
  weight decay, the scheduler's entries) of the saved group that held its weights, and refuses
  when its weights come from saved groups that disagree. The per-weight state (Adam's moments
  and step) is keyed by name in both formats, so it does not depend on the groups.
- the shape under which an expert LoRA ``lora_B`` is stored. Expert parallelism writes it as the
  expert-minor ``[out, r, E]`` (so its ranks' blocks are chunks of the experts' dimension;
  :mod:`hone.train.expert_checkpoint`) where the model holds ``[out, r * E]``: the same elements
  in the same order. :func:`as_saved_shapes` shows this run's tensors to DCP under the saved
  shape (views of the same storage), so DCP reads into them, and puts the originals back after;
  the reverse (a checkpoint without expert parallelism resumed with it) reads the whole factor on
  every rank, which then keeps its block.

A one-process checkpoint (``optimizer.pt``) numbers the weights in the order one process builds
its groups: :func:`one_process_order` gives that order on any layout.
"""

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hone.train.checkpoint_layout import CheckpointError
from hone.train.optim import decays

PARAMS = "params"
GROUPS_PREFIX = "optim.param_groups."


def one_process_order(model: nn.Module) -> list[str]:
    """The trainable weights' names in the order of a one-process optimizer's indices (the decayed
    weights, then the others; :func:`hone.train.optim.param_groups` without the DTensor split)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [n for n, p in named if decays(n, p)] + [n for n, p in named if not decays(n, p)]


def saved_group_template(metadata: Any) -> list[dict[str, Any]]:
    """Placeholders for the parameter groups a DCP checkpoint holds (its metadata lists them as
    ``optim.param_groups.<i>.<key>``), for DCP to fill whatever their number."""
    groups: dict[int, dict[str, Any]] = {}
    for key, entry in metadata.state_dict_metadata.items():
        if key.startswith(GROUPS_PREFIX):
            index, _, name = key[len(GROUPS_PREFIX) :].partition(".")
            size = getattr(entry, "size", None)  # a tensor (torchao's learning rate) is read into one of its kind
            value = None if size is None else torch.empty(tuple(size), dtype=entry.properties.dtype)
            groups.setdefault(int(index), {})[name] = value
    return [groups[i] for i in sorted(groups)]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a.cpu(), b.cpu())
    return a == b


def _to_device_of(value: Any, current: Any) -> Any:
    if isinstance(value, torch.Tensor) and isinstance(current, torch.Tensor):
        return value.to(current.device)
    return value


def regroup(current: list[dict[str, Any]], saved: list[dict[str, Any]], path: Path) -> tuple[list[dict[str, Any]], list[int]]:
    """``current`` (this optimizer's groups, weights named) with each group's hyperparameters taken
    from the saved group that holds its weights; and, per group, that saved group's index (for the
    scheduler's per-group entries). Refuses a weight the checkpoint has no group for, and a group
    whose weights were saved under different hyperparameters."""
    where = {name: j for j, group in enumerate(saved) for name in group[PARAMS]}
    groups, mapping = [], []
    for group in current:
        names = list(group[PARAMS])
        absent = [n for n in names if n not in where]
        if absent:
            raise CheckpointError(f"cannot resume from {path}: its optimizer holds no group for {absent[:3]} (another model?)")
        sources = sorted({where[n] for n in names})
        settings = [{k: v for k, v in saved[j].items() if k != PARAMS} for j in sources]
        first = settings[0]
        for other in settings[1:]:
            differ = sorted(k for k in first.keys() | other.keys() if not _same(first.get(k), other.get(k)))
            if differ:
                raise CheckpointError(
                    f"cannot resume from {path} on this layout: weights this run keeps in one optimizer group were "
                    f"saved in groups with different settings ({', '.join(differ)}); resume it on the layout that saved it"
                )
        here = {k: _to_device_of(v, group.get(k)) for k, v in first.items()}  # a tensor setting where this run keeps it
        groups.append({**here, PARAMS: names})
        mapping.append(sources[0] if sources else len(groups) - 1)
    return groups, mapping


def regroup_schedule(schedule: dict[str, Any], mapping: list[int], saved_groups: int) -> dict[str, Any]:
    """The scheduler's state with its per-group entries (``base_lrs``, ``_last_lr``, ``lr_lambdas``)
    in this optimizer's groups: each the entry of the saved group :func:`regroup` matched."""
    if mapping == list(range(saved_groups)):
        return schedule
    out = dict(schedule)
    for key, value in schedule.items():
        if isinstance(value, list) and len(value) == saved_groups:
            out[key] = [value[j] for j in mapping]
    return out


def _saved_view(value: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``value`` (a plain tensor or an FSDP2 DTensor sharded on dim 0) as ``shape``, sharing its storage."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(value, DTensor):
        return value.view(shape)
    if any(p != Shard(0) and not p.is_replicate() for p in value.placements):
        raise CheckpointError(f"cannot view a tensor sharded as {value.placements} as {shape}")
    local = value.to_local()
    view = local.view(local.shape[0], *shape[1:])
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(view, value.device_mesh, value.placements, run_check=False, shape=torch.Size(shape), stride=stride)


def _reshapes(name: str, value: Any, saved: Any) -> tuple[int, ...] | None:
    """The saved shape where it holds an expert ``lora_B`` under the other of its two shapes:
    ``[out, r, E]`` (expert parallelism) for this run's ``[out, r * E]``, or the reverse."""
    size = getattr(saved, "size", None)
    if ".lora_B." not in f".{name}" or size is None or not isinstance(value, torch.Tensor):
        return None
    size, shape = tuple(size), tuple(value.shape)
    if len(size) == 3 and len(shape) == 2 and size[0] == shape[0] and size[1] * size[2] == shape[1]:
        return size
    if len(size) == 2 and len(shape) == 3 and size[0] == shape[0] and size[1] == shape[1] * shape[2]:
        return size
    return None


def _whole_then_block(value: torch.Tensor, shape: tuple[int, ...]) -> tuple[torch.Tensor, Callable[[], None]]:
    """For this run's ``[out, r, E]`` (a rank's experts: a DTensor sharded on ``E``) saved as
    ``[out, r * E]``: the rank's block is no chunk of the saved tensor, so each rank reads the whole
    tensor (an expert LoRA factor: small) into a stand-in, then keeps its block of it."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    whole = torch.empty(shape, dtype=value.dtype, device=value.device)

    def keep_block() -> None:
        if isinstance(value, DTensor):
            block = distribute_tensor(whole.view(value.shape), value.device_mesh, value.placements, src_data_rank=None)
            value.to_local().copy_(block.to_local())
        else:
            value.copy_(whole.view(value.shape))

    return whole, keep_block


def _stand_in(value: torch.Tensor, shape: tuple[int, ...]) -> tuple[torch.Tensor, Callable[[], None] | None]:
    if len(shape) == 3:
        return _saved_view(value, shape), None  # the same storage: nothing to do after the load
    return _whole_then_block(value, shape)


Undo = list[tuple[dict[str, Any], str, Any, Callable[[], None] | None]]


def as_saved_shapes(state: dict[str, Any], metadata: Any) -> Undo:
    """Replace, in ``state`` (``{"model", "optim"}`` of DCP), each tensor the checkpoint holds under
    another shape of the same elements by a stand-in of that shape (a view, or the whole tensor
    where this run holds a block of its experts); returns what to put back after the load
    (:func:`put_back`)."""
    saved = metadata.state_dict_metadata
    undo: Undo = []
    weights, moments = state["model"], state["optim"].get("state", {})
    for name in list(weights):
        shape = _reshapes(name, weights[name], saved.get(f"model.{name}"))
        if shape is not None:
            original = weights[name]
            weights[name], finish = _stand_in(original, shape)
            undo.append((weights, name, original, finish))
        if name not in moments:
            continue
        moments[name] = dict(moments[name])
        for key, value in list(moments[name].items()):
            shape = _reshapes(name, value, saved.get(f"optim.state.{name}.{key}"))
            if shape is not None:
                moments[name][key], finish = _stand_in(value, shape)
                undo.append((moments[name], key, value, finish))
    return undo


def check_shapes(state: dict[str, Any], metadata: Any, path: Path) -> None:
    """Refuse, naming the tensor, a weight or moment whose saved shape this run cannot read into
    (after :func:`as_saved_shapes`): another model, ``lora_r`` or number of experts."""
    saved = metadata.state_dict_metadata
    wanted = {f"model.{n}": v for n, v in state["model"].items()}
    for name, values in state["optim"].get("state", {}).items():
        wanted.update({f"optim.state.{name}.{k}": v for k, v in values.items()})
    for key, value in wanted.items():
        size = getattr(saved.get(key), "size", None)
        if isinstance(value, torch.Tensor) and size is not None and tuple(size) != tuple(value.shape):
            raise CheckpointError(
                f"cannot resume from {path}: it holds '{key}' as {tuple(size)}, this run as {tuple(value.shape)} "
                "(another model, lora_r or number of experts)"
            )


def put_back(undo: Undo) -> None:
    """Undo :func:`as_saved_shapes`: the originals back (a view shares their storage; a whole
    tensor read gives them their block)."""
    for holder, key, value, finish in undo:
        if finish is not None:
            finish()
        holder[key] = value
