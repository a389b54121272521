"""Evaluation: mean loss per trained token over the whole eval split, and perplexity.

The mean is over tokens, not over batches (the sum of every token's loss divided by the
count), so it does not depend on how the split is cut into batches.

With several processes the split's batches are dealt round-robin (batch ``i`` to rank
``i % world_size``; under context parallelism to the group ``i % (world_size / N)``, whose ranks
each compute their shard of it); each rank sums its losses and tokens, and one all-reduce (SUM) gives every
rank the mean one process would compute. Every rank runs the same number of forwards (a rank
with one batch fewer repeats its first one and discards it), so an engine that communicates in
the forward (FSDP2 gathers each layer's weights) never waits for a rank that has finished.

Preference pairs (DPO, IPO, ORPO): the loss is the objective's over the whole split (pair
terms averaged over its pairs, ORPO's NLL over its chosen tokens), and TRL's metrics
(``rewards/margins``, ...) are means over its pairs, logged as ``eval_rewards/margins`` etc.

During training, the :class:`Evaluator` decides when: a fresh run with eval data evaluates once
before the first step (step 0), so the report can compare the final eval loss with the
untrained model's; then every ``training.eval_steps`` (or ``evals_per_epoch`` times an epoch)
and after the last step.
"""

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from hone.config.training import TrainingConfig
from hone.data.packing import Packing
from hone.runtime.step import micro_batch_loss
from hone.runtime.world import SINGLE, World
from hone.track.tracker import Tracker
from hone.train.batches import StepPlan, micro_batches

if TYPE_CHECKING:
    from hone.transforms.base import RunHooks


@dataclass(frozen=True)
class EvalResult:
    loss: float
    perplexity: float | None  # None for preference pairs
    tokens: int
    pairs: int = 0
    metrics: dict[str, float] = field(default_factory=dict)  # preference pairs: TRL's metrics, by name


def perplexity(loss: float) -> float:
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


@torch.no_grad()
def evaluate(
    model: nn.Module,
    dataset,
    *,
    batch_size: int,
    pad_id: int,
    device: torch.device,
    autocast_dtype: torch.dtype | None = None,
    packing: Packing | None = None,
    hooks: "RunHooks | None" = None,
    world: World = SINGLE,
    step: nn.Module | None = None,
    objective: str = "sft",
    reference: torch.Tensor | None = None,
    pad_to: int | None = None,
) -> EvalResult:
    """Run the model over ``dataset`` in order, without dropout or gradients.

    ``packing`` (the split's bins from :func:`hone.data.packing.packing_for`, made once per run,
    not per eval) runs the bins instead of padded rows; the loss is the same either way, only
    faster. ``hooks`` give the run's loss function and attention layout (default: the standard
    loss, the layout of the model as it stands)."""
    if hooks is None:
        from hone.models.attention.layout import layout_for
        from hone.runtime.loss import logit_postprocess, standard_loss

        loss_fn, layout = standard_loss(logit_postprocess(getattr(model, "config", None))), layout_for(model)
        fixed_pairs, fixed_boundaries = None, None
    else:
        loss_fn, layout, fixed_pairs = hooks.loss_fn, hooks.layout, hooks.fixed_pairs
        fixed_boundaries = batch_size if hooks.fixed_boundaries else None
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    tokens, pairs, nll_tokens = 0, 0, 0
    try:
        batches = micro_batches(
            dataset,
            packing,
            pad_id,
            objective,
            reference,
            share_prompt=layout.shares_prompt,
            fixed_pairs=fixed_pairs,
            fixed_boundaries=fixed_boundaries,
            pad_to=pad_to,
        )
        starts = list(range(0, batches.units, batch_size))
        # context parallelism: the N ranks of a group evaluate the same batches, each its shard
        replica, replicas = world.data_parallel(hooks.context_parallel if hooks is not None else 1)
        mine = starts[replica::replicas]
        rounds = -(-len(starts) // replicas)  # every rank runs this many forwards
        for i in range(rounds):
            counted = i < len(mine)
            start = mine[i] if counted else (mine[0] if mine else starts[0])
            indices = list(range(start, min(start + batch_size, batches.units)))
            host = batches(indices)
            batch = host.to(device).with_attention(layout)
            batch = hooks.local_batch(batch, host) if hooks is not None else batch
            if batch.trained_tokens == 0 and not world.distributed:
                continue
            loss_sum = step(batch) if step is not None else micro_batch_loss(model, batch, loss_fn, autocast_dtype)
            if counted and batch.trained_tokens > 0:
                total = total + loss_sum.double()
                tokens, pairs, nll_tokens = tokens + batch.trained_tokens, pairs + batch.pairs, nll_tokens + batch.nll_tokens
    finally:
        model.train(was_training)
    if objective != "sft":
        return _pair_result(total, [tokens, pairs, nll_tokens], objective, world, device)
    if world.distributed:
        both = torch.stack([total, torch.zeros_like(total) + tokens])
        dist.all_reduce(both, op=dist.ReduceOp.SUM)
        total, tokens = both[0], int(both[1].item())
    loss = total.item() / tokens if tokens else math.nan
    return EvalResult(loss=loss, perplexity=perplexity(loss), tokens=tokens)


def _pair_result(total: torch.Tensor, counts: list[int], objective: str, world: World, device: torch.device) -> EvalResult:
    """The split's loss and metrics from the summed pair vectors (:mod:`hone.runtime.pair_loss`)
    and ``counts`` (trained tokens, pairs, NLL tokens), summed over the ranks in one all-reduce."""
    from hone.runtime.pair_loss import PAIR_TERMS, metric_names

    names = metric_names(objective)
    sums = total.reshape(-1) if total.dim() else torch.zeros(PAIR_TERMS + len(names), dtype=torch.float64, device=device)
    both = torch.cat([sums, torch.tensor(counts, dtype=torch.float64, device=device)])
    if world.distributed:
        dist.all_reduce(both, op=dist.ReduceOp.SUM)
    values = both.tolist()
    tokens, pairs, nll_tokens = (int(v) for v in values[-3:])
    if not pairs:
        return EvalResult(loss=math.nan, perplexity=None, tokens=tokens)
    nll = values[0] / max(nll_tokens, 1)
    metrics = {name: v / pairs for name, v in zip(names, values[PAIR_TERMS:-3], strict=True)}
    if objective == "orpo":
        metrics = {"nll_loss": nll, **metrics}
    return EvalResult(loss=nll + values[1] / pairs, perplexity=None, tokens=tokens, pairs=pairs, metrics=metrics)


class Evaluator:
    """Evaluates the training model on its own cadence and logs each result as an eval row."""

    def __init__(
        self,
        model: nn.Module,
        dataset,
        training: TrainingConfig,
        plan: StepPlan,
        tracker: Tracker,
        *,
        pad_id: int,
        device: torch.device,
        autocast_dtype: torch.dtype | None,
        packing: Packing | None,
        hooks: "RunHooks",
        world: World,
        step: nn.Module,
        reference: torch.Tensor | None = None,
        pad_to: int | None = None,
    ):
        self.model = model
        self.dataset = dataset
        self.enabled = dataset is not None and len(dataset) > 0
        self.eval_steps = training.eval_steps
        self.evals_per_epoch = training.evals_per_epoch
        self.batch_size = training.micro_batch_size
        self.objective = training.objective
        self.plan = plan
        self.tracker = tracker
        self.pad_id = pad_id
        self.device = device
        self.autocast_dtype = autocast_dtype
        self.packing = packing
        self.hooks = hooks
        self.world = world
        self.step = step
        self.reference = reference  # DPO/IPO of a full fine-tune: the eval pairs' precomputed reference log-probs
        self.pad_to = pad_to  # data.pad_to_sequence_len: every unpacked eval row padded to this width

    def baseline_due(self, step: int) -> bool:
        """Before the first step of a fresh run: the baseline the final eval is compared with."""
        return self.enabled and step == 0

    def due(self, step: int, last: bool) -> bool:
        return self.enabled and (self.plan.due(step, self.eval_steps, self.evals_per_epoch) or last)

    def run(self, step: int) -> None:
        """Evaluate now (every rank) and log the result as the eval row of ``step``."""
        result = evaluate(
            self.model,
            self.dataset,
            batch_size=self.batch_size,
            pad_id=self.pad_id,
            device=self.device,
            autocast_dtype=self.autocast_dtype,
            packing=self.packing,
            hooks=self.hooks,
            world=self.world,
            step=self.step,
            objective=self.objective,
            reference=self.reference,
            pad_to=self.pad_to,
        )
        row = {
            "step": step,
            "epoch": round(self.plan.epoch_at(step), 4),
            "eval_loss": result.loss,
            "eval_ppl": result.perplexity,
            "eval_tokens": result.tokens,
        }
        if self.objective != "sft":
            del row["eval_ppl"]
            row["eval_pairs"] = result.pairs
            row.update({f"eval_{name}": value for name, value in result.metrics.items()})
        self.tracker.log_eval(row)
