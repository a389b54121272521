"""DPO's and IPO's reference log-probabilities, computed once before training.

Without an adapter to switch off, the reference is the model as it starts. hone does not keep a
second, frozen copy of it for the whole run (a second model's worth of memory, and a second
forward every micro-batch); it runs **one** ``no_grad`` pass over every training and eval pair
with the initial weights before the first step (``training.preference.reference: precomputed``,
what ``auto`` picks for ``adapter.type: none``, and for LoRA over several epochs, where it saves
the reference's forward in every later epoch), in eval mode (no dropout, as a frozen reference),
through the run's own per-micro-batch module (so DDP and FSDP2 run it as they run training).
Under data parallelism each rank computes every ``world_size``-th forward of the pass and one
all-reduce assembles the table (disjoint rows, so the sum is exact): a rank does its share of
one epoch's reference forwards, and every rank holds the same numbers.

The table is kept with the run: rank 0 writes it atomically into the run directory
(:data:`~hone.run_files.REFERENCE_FILE`, safetensors, ``train`` and ``eval`` ``[pairs, 2]``
float32: chosen, rejected) before the first step; a resumed run reads it back instead of
recomputing it from weights that have trained since. Under LoRA a resumed run without the file
(one that started as a single epoch, with the step's reference) computes it with the adapter
switched off: the initial model, whatever the adapter has learnt since.
"""

from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from peft import PeftModel
from torch import nn

from hone.atomic import atomic_write_with
from hone.errors import HoneError
from hone.models.adapters import adapters_off
from hone.run_files import REFERENCE_FILE
from hone.runtime.world import SINGLE, World
from hone.train.batches import PairBatches, micro_batches


class ReferenceError(HoneError):
    """The precomputed reference log-probs of a resumed run are missing or do not fit its data."""


@torch.no_grad()
def reference_table(
    module: nn.Module,
    loss_fn: Any,
    batches: PairBatches,
    batch_size: int,
    device: torch.device,
    hooks: Any,
    world: World = SINGLE,
) -> torch.Tensor:
    """``[pairs, 2]`` float32 on the CPU: each pair's reference log-probs (chosen, rejected) from
    ``module`` (the run's step module) with ``loss_fn`` (the run's :class:`~hone.runtime.pair_loss.PairLoss`)
    switched to computing them, ``batch_size`` pairs per forward, in the split's order.

    With several ranks, rank ``r`` runs forwards ``r, r + N, ...`` and an all-reduce sums the
    tables (each row written by one rank, zero elsewhere). Every rank runs as many forwards (the
    last round repeats the split's first micro-batch and drops it where a rank has none left):
    FSDP2 gathers the weights inside each forward, a collective every rank must join."""
    starts = list(range(0, batches.units, batch_size))
    rounds = -(-len(starts) // world.world_size)
    table = torch.zeros(batches.units, 2, dtype=torch.float32, device=device if world.distributed else "cpu")
    with loss_fn.computing_reference():
        for turn in range(rounds):
            at = turn * world.world_size + world.rank
            start = starts[at] if at < len(starts) else 0
            indices = list(range(start, min(start + batch_size, batches.units)))
            host = batches(indices)
            batch = hooks.local_batch(host.to(device).with_attention(hooks.layout), host)
            logps = module(batch).float().to(table.device)
            if at < len(starts):
                table[start : start + len(indices)] = torch.stack([logps[: len(indices)], logps[len(indices) :]], dim=1)
    if world.distributed:
        import torch.distributed as dist

        dist.all_reduce(table)
    return table.cpu()


def prepare_reference(
    model: nn.Module,
    module: nn.Module,
    hooks: Any,
    train: PairBatches,
    eval_data: Any,
    *,
    output_dir: Path,
    batch_size: int,
    pad_id: int,
    objective: str,
    device: torch.device,
    world: World,
    resuming: bool,
) -> torch.Tensor | None:
    """Attach the reference table to ``train`` (read back when ``resuming``, else computed with
    the weights as they are now and written by rank 0); returns the eval split's table (None
    without eval pairs), which the evaluator attaches to its batches."""
    path = Path(output_dir) / REFERENCE_FILE
    adapter = isinstance(model, PeftModel)
    if resuming and (path.is_file() or not adapter):
        tables = _load(path)
    else:  # the initial weights: as they are now, or (a LoRA run resumed without the file) the adapter off
        switch = adapters_off(model) if resuming else nullcontext
        was_training = model.training
        model.eval()
        try:
            with switch():
                tables = {"train": reference_table(module, hooks.loss_fn, train, batch_size, device, hooks, world)}
                if eval_data is not None and len(eval_data) > 0:
                    split = micro_batches(
                        eval_data,
                        None,
                        pad_id,
                        objective,
                        share_prompt=hooks.layout.shares_prompt,
                        fixed_pairs=hooks.fixed_pairs,
                    )
                    tables["eval"] = reference_table(module, hooks.loss_fn, split, batch_size, device, hooks, world)
        finally:
            model.train(was_training)
        if world.is_main:
            _save(path, tables)
    for split, rows in (("train", train.units), ("eval", len(eval_data) if eval_data is not None else 0)):
        if rows and tables.get(split, torch.zeros(0, 2)).shape[0] != rows:
            raise ReferenceError(
                f"{path} holds reference log-probs for {tables.get(split, torch.zeros(0, 2)).shape[0]} {split} pairs, "
                f"but the run's {split} split has {rows}: the data changed since the run started; start over with --overwrite"
            )
    train.reference = tables["train"]
    return tables.get("eval")


def _save(path: Path, tables: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    atomic_write_with(path, lambda tmp: save_file({k: v.contiguous() for k, v in tables.items()}, str(tmp)))


def _load(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if not path.is_file():
        raise ReferenceError(
            f"the run resumes DPO/IPO with precomputed reference log-probs, but {path} is missing (it is written "
            "before the first step and kept with the run): they cannot be recomputed from trained weights; start over "
            "with --overwrite"
        )
    return load_file(str(path))
