"""Which rows go into which micro-batch, and how many optimizer steps a run has.

Each epoch visits the training rows in its own seeded random order (a function of
``training.seed`` and the epoch number only, so it is the same in every process and after a
resume). One optimizer step takes ``micro_batch_size * gradient_accumulation_steps`` rows from
that order; the rows left over at the end of an epoch (fewer than one full step) are **dropped
for that epoch**, so every step has the same shape and the step count is exact:

    steps_per_epoch = floor(rows / (micro_batch_size * gradient_accumulation_steps))

Because each epoch shuffles anew, a different handful of rows sits out each epoch.
``training.max_steps`` gives the total directly (wrapping into further epochs as needed);
otherwise ``total = floor(num_epochs * steps_per_epoch)`` (fractions allowed, at least 1).

With a preference objective (``training.objective: dpo | ipo | orpo``) the unit is a **pair**:
``micro_batch_size`` pairs make a micro-batch, packed into one row (:mod:`hone.data.pairs`), and
everything above holds with "pairs" for "rows" (sample packing does not apply to pairs).

With ``data.sample_packing`` the unit is a *packed row* instead of a dataset row: the rows
are packed once into bins of ``sequence_len`` tokens by :mod:`hone.data.packing` (deterministic
in the seed, saved with the prepared data; this module only reads the bins) and each epoch
visits the bins in its own seeded order, so everything above holds with "bins" for "rows" (the
step count and schedule follow the packed length).

The position in the data is explicit, ``(epoch, index into that epoch's order)``, and is stored
in checkpoints, so a resumed run continues with exactly the micro-batch that comes next.

**Several processes (data parallelism).** With ``W`` processes and accumulation ``k``, one
optimizer step takes the rows a single process with accumulation ``W * k`` would take, cut into
the same ``W * k`` micro-batches; rank ``r`` trains micro-batches ``r*k .. r*k + k-1`` of that
list (a contiguous block; the rule is :meth:`BatchStream.next_window`). So the global batch
sequence does not depend on how many processes share it, every rank reads a disjoint part of
it, and the position stored in a checkpoint is global: a run resumed on another number of
processes continues the same sequence (exactly so when ``W * k`` stays the same).

**Context parallelism** (``distributed.context_parallel: N``): the ``N`` consecutive ranks of a
group split each sequence, so they read the same micro-batches; the data is shared by the
``W / N`` groups, which take the place of the ranks above (``world_size`` of the plan is ``W / N``,
``rank`` the group's index: :meth:`hone.runtime.world.World.data_parallel`). The global batch
sequence depends only on ``(W / N) * k``: a run resumed with another ``N`` (or none) continues it.
"""

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from hone.config.training import TrainingConfig
from hone.data.collate import MicroBatch, collate, collate_packed, rows_at
from hone.data.packing import Packing
from hone.data.pairs import FixedPairRows, collate_pairs, pair_rows_at
from hone.errors import HoneError


class NotEnoughData(HoneError):
    """The training split cannot fill a single optimizer step."""


@dataclass
class DataPosition:
    """Where the next optimizer step starts: epoch number and rows of its order consumed."""

    epoch: int = 0
    index: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}


@dataclass(frozen=True)
class StepPlan:
    """The shape of a run in optimizer steps, fixed before the first step."""

    rows: int
    micro_batch_size: int
    accumulation: int
    """Micro-batches per optimizer step on each process (``gradient_accumulation_steps``)."""
    steps_per_epoch: int
    total_steps: int
    world_size: int = 1
    """Data-parallel replicas sharing each step: the processes, or under context parallelism the
    groups of ``N`` ranks that split each sequence; 1 for a single process."""
    unit: str = "row"
    """What a step counts, as the console says it: ``row`` (or packed row), ``pair`` for a preference objective."""

    @property
    def micro_batches_per_step(self) -> int:
        """Micro-batches of one optimizer step over all processes (``world_size * accumulation``)."""
        return self.accumulation * self.world_size

    @property
    def rows_per_step(self) -> int:
        """Rows (or bins) of one optimizer step over all processes: the global batch."""
        return self.micro_batch_size * self.micro_batches_per_step

    @property
    def dropped_per_epoch(self) -> int:
        return self.rows - self.steps_per_epoch * self.rows_per_step

    @property
    def epochs(self) -> float:
        return self.total_steps / self.steps_per_epoch

    def epoch_at(self, step: int) -> float:
        """Fractional epoch reached after ``step`` optimizer steps."""
        return step / self.steps_per_epoch

    def due(self, step: int, every: int | None, per_epoch: int | None) -> bool:
        """Whether a periodic action (save, eval) falls after ``step``: every ``every`` steps, or
        ``per_epoch`` times per epoch at steps ``ceil(k * steps_per_epoch / per_epoch)`` of each
        epoch (``k = 1..per_epoch``): the step where the epoch's ``k``-th fraction is crossed."""
        if every:
            return step % every == 0
        if per_epoch:
            n = min(per_epoch, self.steps_per_epoch)
            return step >= 1 and (step * n) // self.steps_per_epoch != ((step - 1) * n) // self.steps_per_epoch
        return False

    def describe(self) -> str:
        dropped = (
            f", {self.dropped_per_epoch} {self.unit}{'s' if self.dropped_per_epoch != 1 else ''} per epoch left "
            "out (less than a full step)"
            if self.dropped_per_epoch
            else ""
        )
        world = f" x {self.world_size} processes" if self.world_size > 1 else ""
        return (
            f"{self.total_steps} optimizer steps ({self.epochs:.3g} epochs of {self.steps_per_epoch} steps; "
            f"{self.rows_per_step} {self.unit}s per step = micro_batch_size {self.micro_batch_size} x "
            f"gradient_accumulation_steps {self.accumulation}{world}{dropped})"
        )


def plan_steps(num_rows: int, training: TrainingConfig, world_size: int = 1) -> StepPlan:
    """Steps per epoch and in total for ``num_rows`` training rows (or packed bins) shared by
    ``world_size`` processes."""
    per_step = training.samples_per_step * world_size
    unit = "pair" if training.is_preference else "row"
    steps_per_epoch = num_rows // per_step
    if steps_per_epoch == 0:
        world = f" x {world_size} processes" if world_size > 1 else ""
        fewer = " or run on fewer processes" if world_size > 1 else ""
        raise NotEnoughData(
            f"the training data has {num_rows} {unit}{'s' if num_rows != 1 else ''}, fewer than one optimizer "
            f"step uses (training.micro_batch_size {training.micro_batch_size} x "
            f"training.gradient_accumulation_steps {training.gradient_accumulation_steps}{world} = {per_step}): "
            f"add data or lower them{fewer}"
        )
    if training.max_steps is not None:
        total = training.max_steps
    else:
        epochs = training.epochs
        assert epochs is not None
        # The epsilon keeps 0.29 * 100 (= 28.999999999999996 in floats) from becoming 28.
        total = max(1, math.floor(epochs * steps_per_epoch + 1e-9))
    return StepPlan(
        rows=num_rows,
        micro_batch_size=training.micro_batch_size,
        accumulation=training.gradient_accumulation_steps,
        steps_per_epoch=steps_per_epoch,
        total_steps=total,
        world_size=world_size,
        unit=unit,
    )


def epoch_order(num_rows: int, seed: int, epoch: int) -> np.ndarray:
    """The row order of ``epoch``: a permutation depending only on (seed, epoch)."""
    rng = np.random.default_rng([seed % 2**64, epoch])
    return rng.permutation(num_rows)


class BatchStream:
    """Hands out one accumulation window (a list of micro-batches of row indices) per step,
    this process's share of the step's global batch (``rank`` of ``plan.world_size``)."""

    def __init__(self, plan: StepPlan, seed: int, position: DataPosition | None = None, rank: int = 0):
        if not 0 <= rank < plan.world_size:
            raise ValueError(f"rank {rank} outside a world of {plan.world_size}")
        self.plan = plan
        self.seed = seed
        self.rank = rank
        self.position = DataPosition(**(position or DataPosition()).as_dict())
        self._order_epoch: int | None = None
        self._order: np.ndarray | None = None

    def _order_for(self, epoch: int) -> np.ndarray:
        if self._order_epoch != epoch:
            self._order = epoch_order(self.plan.rows, self.seed, epoch)
            self._order_epoch = epoch
        assert self._order is not None
        return self._order

    def next_window(self) -> list[list[int]]:
        """Row indices of this rank's micro-batches of the next step; advances the (global)
        position past the whole step. Rank ``r`` takes micro-batches ``r*k .. r*k + k-1`` of the
        ``world_size * k`` a single process with that accumulation would take."""
        k = self.plan.accumulation
        return self.next_global_window()[self.rank * k : (self.rank + 1) * k]

    def next_global_window(self) -> list[list[int]]:
        """Row indices of every micro-batch of the next step, all processes' (what a single process
        with accumulation ``world_size * k`` trains); advances the position past them."""
        per_step = self.plan.rows_per_step
        if self.position.index + per_step > self.plan.rows:  # the epoch's leftover rows are dropped
            self.position = DataPosition(self.position.epoch + 1, 0)
        order = self._order_for(self.position.epoch)
        start = self.position.index
        rows = order[start : start + per_step].tolist()
        self.position = DataPosition(self.position.epoch, start + per_step)
        if self.position.index + per_step > self.plan.rows:
            self.position = DataPosition(self.position.epoch + 1, 0)
        mbs = self.plan.micro_batch_size
        return [rows[i : i + mbs] for i in range(0, per_step, mbs)]


class PaddedBatches:
    """Units are dataset rows; a micro-batch pads its rows to the longest one, or to ``width``
    (``data.pad_to_sequence_len``: one shape for every micro-batch)."""

    packing: Packing | None = None

    def __init__(self, dataset: Any, pad_id: int, width: int | None = None):
        self.dataset = dataset
        self.pad_id = pad_id
        self.width = width
        self.units = len(dataset)

    def __call__(self, indices: list[int]) -> MicroBatch:
        return collate(rows_at(self.dataset, indices), self.pad_id, self.width)


class PackedBatches:
    """Units are packed rows (bins); a micro-batch is ``len(indices)`` rows of ``width`` tokens.
    ``fixed_boundaries``: micro-batches of that many rows (or fewer) all count the boundaries of
    the most segments such rows can hold (:meth:`Packing.most_segments`), so the attention sees
    one shape every step (CUDA graphs); None: each micro-batch its own count."""

    def __init__(self, dataset: Any, packing: Packing, pad_id: int, fixed_boundaries: int | None = None):
        self.dataset = dataset
        self.packing = packing
        self.pad_id = pad_id
        self.units = packing.num_bins
        self.segments = packing.most_segments(fixed_boundaries) if fixed_boundaries else None

    def __call__(self, indices: list[int]) -> MicroBatch:
        bins = [self.packing.bin(int(i)).tolist() for i in indices]
        docs = rows_at(self.dataset, [d for b in bins for d in b])  # one read for the whole batch
        grouped, at = [], 0
        for b in bins:
            grouped.append(docs[at : at + len(b)])
            at += len(b)
        return collate_packed(grouped, self.packing.capacity, self.pad_id, self.segments)


class PairBatches:
    """Units are preference pairs; a micro-batch packs ``len(indices)`` pairs into one row
    (``prompt_nll``: ORPO's NLL covers the chosen prompts, see :mod:`hone.data.pairs`)."""

    packing: Packing | None = None

    def __init__(
        self,
        dataset: Any,
        pad_id: int,
        prompt_nll: bool = False,
        reference: Any = None,
        share_prompt: bool = False,
        fixed: FixedPairRows | None = None,
    ):
        self.dataset = dataset
        self.pad_id = pad_id
        self.prompt_nll = prompt_nll
        self.reference = reference
        """``[pairs, 2]`` precomputed reference log-probs (chosen, rejected), or None."""
        self.share_prompt = share_prompt
        """Each prompt once, chosen and rejected as its two branches (the plan's decision)."""
        self.fixed = fixed
        """One layout for every micro-batch (CUDA graphs), or None: rows as wide as their pairs."""
        self.units = len(dataset)

    def __call__(self, indices: list[int]) -> MicroBatch:
        reference = self.reference[indices] if self.reference is not None else None
        rows = pair_rows_at(self.dataset, indices)
        return collate_pairs(rows, self.pad_id, self.prompt_nll, reference, share_prompt=self.share_prompt, fixed=self.fixed)


Batches = PaddedBatches | PackedBatches | PairBatches


def micro_batches(
    dataset: Any,
    packing: Packing | None,
    pad_id: int,
    objective: str = "sft",
    reference: Any = None,
    share_prompt: bool = False,
    fixed_pairs: FixedPairRows | None = None,
    fixed_boundaries: int | None = None,
    pad_to: int | None = None,
) -> Batches:
    """The micro-batch builder of a split: padded rows, or the bins of ``packing`` (from
    :func:`hone.data.packing.packing_for`, never packed here); pairs for a preference ``objective``
    (with their precomputed ``reference`` log-probs, if any; ``share_prompt``: each prompt once,
    and ``fixed_pairs``: one layout for every micro-batch, as the run's attention layout says).
    ``fixed_boundaries``: packed micro-batches of that many rows take one boundary count
    (:class:`PackedBatches`); ``pad_to``: unpacked rows are padded to that width
    (:class:`PaddedBatches`)."""
    if objective != "sft":
        return PairBatches(
            dataset, pad_id, prompt_nll=objective == "orpo", reference=reference, share_prompt=share_prompt, fixed=fixed_pairs
        )
    if packing is None:
        return PaddedBatches(dataset, pad_id, pad_to)
    return PackedBatches(dataset, packing, pad_id, fixed_boundaries)
