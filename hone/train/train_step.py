"""One optimizer step, and the forward and backward of one micro-batch, spelled out.

Each optimizer step (:func:`train_step`):

1. takes the next accumulation window (``gradient_accumulation_steps`` micro-batches) from
   the seeded data order and counts its trained tokens *before* any backward pass
   (:func:`take_window`; the loop collates and copies it one step ahead,
   :mod:`hone.train.prefetch`);
2. for each micro-batch: forward, ``sum of token losses / window's trained tokens``,
   backward (:func:`forward_backward_step`; so the window's gradient is the mean over all its
   tokens, whatever the split); then, while the device still computes, the caller's host work
   (``while_device_works``: the next window, the previous step's metrics row), and only then
   the step's one sync;
3. skips the update if the loss or the gradient norm is not finite (grads zeroed, optimizer
   and schedule untouched, the step counted; the loop stops with an error after
   ``training.max_consecutive_nonfinite`` of those in a row);
4. clips the gradient norm, steps the optimizer and the schedule, zeroes the gradients. The
   plan's after-step actions (e.g. float8 scale updates) are registered on the optimizer
   (:meth:`~hone.transforms.base.RunHooks.register_after_step`), so they run exactly when the
   optimizer updates and this code never names them.

What happened is a :class:`StepOutcome`; the loop counts and reports it.

**Several processes** (``torchrun``, see docs/distributed.md): each rank trains its share of the
step's global batch (:mod:`hone.train.batches`); the window's trained-token count is
all-reduced (SUM) before the first backward, so every rank divides its token-loss sum by the
*global* count; gradients are summed across ranks once per step (the plan's data-parallel
transform: DDP with a SUM hook, ``no_sync`` for all but the window's last micro-batch; expert
blocks of a group smaller than the job over their replicas, after the last backward). The loss
that is logged is the global mean, all-reduced together with a stop flag (a signal seen by any
rank stops all of them after the same step) and read at the step's one sync. Every rank holds
the reduced gradients, so the clipping norm and the non-finite decision are the same
everywhere.

**Preference pairs** (DPO, IPO, ORPO): a micro-batch's loss is a vector of sums
(:mod:`hone.runtime.pair_loss`): ``[NLL token sum, pair-loss sum, metric sums...]``. The window
counts its pairs and its chosen NLL tokens beside its tokens (all-reduced together with several
processes), divides the two loss terms by them (its ``divisor`` is then the vector ``[NLL
tokens, pairs]``) and the metrics by its pairs, and reads ``[loss, NLL mean, metric means...]``
at the step's one sync (all-reduced with the stop flag).

Precision: the model arrives in its dtypes (see :mod:`hone.models.precision`). When the
loader says so (``autocast_dtype``: float32 trainable weights beside bf16/fp16 compute) the
forward runs under ``torch.autocast``; the loss is always computed outside it, in float32.
``model.dtype: float16`` needs loss scaling to keep small gradients from flushing to zero; it
is done with ``torch.amp.GradScaler`` on CUDA and refused on CPU (where bfloat16 or float32 are
the choices). With fp16, an overflow the scaler handles by lowering its scale is counted as a
skipped step but not towards the consecutive limit.
"""

import math
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from enum import Enum

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function  # names the step's phases in a profile; no cost otherwise

from hone.config.root import HoneConfig
from hone.data.collate import MicroBatch
from hone.errors import HoneError
from hone.parallel.groups import sum_over_replicas
from hone.runtime.pair_loss import PAIR_TERMS, window_values
from hone.runtime.step import StepModule
from hone.runtime.world import World
from hone.train.batches import Batches, BatchStream, DataPosition
from hone.train.grad_norm import global_grad_norm
from hone.train.signals import StopRequest
from hone.transforms.base import RunHooks


class UnsupportedPrecision(HoneError):
    """A dtype that cannot be trained on this device."""


def loss_scaler(cfg: HoneConfig, device: torch.device) -> torch.amp.GradScaler | None:
    """A GradScaler for float16 on CUDA, None otherwise; float16 on CPU is refused."""
    if cfg.model.dtype != "float16":
        return None
    if device.type != "cuda":
        raise UnsupportedPrecision(
            f"model.dtype: float16 training needs a CUDA GPU (loss scaling); on {device.type} use bfloat16 or float32"
        )
    return torch.amp.GradScaler("cuda")


class StepOutcome(Enum):
    """What an optimizer step did."""

    UPDATED = "updated"
    NO_TRAINED_TOKENS = "no trained tokens"  # every label of the window masked: nothing to learn from
    NONFINITE_LOSS = "non-finite loss"
    NONFINITE_GRAD_NORM = "non-finite gradient norm"
    FP16_OVERFLOW = "float16 gradient overflow"  # the scaler's normal recovery: it lowered its scale

    @property
    def counts_toward_limit(self) -> bool:
        """Whether it is one of the ``training.max_consecutive_nonfinite`` in a row that stop a run."""
        return self in (StepOutcome.NONFINITE_LOSS, StepOutcome.NONFINITE_GRAD_NORM)


@dataclass(frozen=True)
class StepResult:
    """An optimizer step as the host read it at the step's one sync."""

    outcome: StepOutcome
    loss: float  # mean per trained token over the window; nan when there were none
    grad_norm: float | None  # before clipping; None when the loss was already unusable
    trained_tokens: int  # the window's, over every process
    tokens: int  # real (non-padding) input tokens of the window, over every process
    any_rank_stopping: bool = False  # several processes: a signal seen by any rank, read at the sync
    loss_scale: float | None = None  # float16: the scale the overflow lowered the scaler to
    metrics: dict[str, float] = field(default_factory=dict)  # preference pairs: TRL's metrics, window means

    @property
    def updated(self) -> bool:
        return self.outcome is StepOutcome.UPDATED

    def problem(self) -> str:
        """Why the step was skipped, as the console says it."""
        if self.outcome is StepOutcome.NONFINITE_LOSS:
            return f"loss is {self.loss}"
        if self.outcome is StepOutcome.NONFINITE_GRAD_NORM:
            return f"gradient norm is {self.grad_norm}"
        if self.outcome is StepOutcome.FP16_OVERFLOW:
            return f"float16 gradient overflow (loss scale lowered to {self.loss_scale:g})"
        return self.outcome.value


def classify(trained_tokens: int, loss: float, grad_norm: float | None, scaled: bool) -> StepOutcome:
    """The step's outcome from what the host read; ``grad_norm`` None: not measured yet.
    With loss scaling (``scaled``) a non-finite norm is an overflow the scaler recovers from."""
    if trained_tokens == 0:
        return StepOutcome.NO_TRAINED_TOKENS
    if not math.isfinite(loss):
        return StepOutcome.NONFINITE_LOSS
    if grad_norm is not None and not math.isfinite(grad_norm):
        return StepOutcome.FP16_OVERFLOW if scaled else StepOutcome.NONFINITE_GRAD_NORM
    return StepOutcome.UPDATED


@dataclass
class StepParts:
    """What every optimizer step acts on; built once by the set-up (:mod:`hone.train.setup`)."""

    step_module: StepModule
    hooks: RunHooks
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler | None
    params: list[nn.Parameter]  # the trainable ones: the gradient norm's
    max_grad_norm: float | None
    sharded: list[nn.Parameter] = field(default_factory=list)  # those of params each rank holds its own block of
    expert_group: dist.ProcessGroup | None = None  # the ranks the blocks are split over (None: every rank)
    expert_replicas: dist.ProcessGroup | None = None  # the ranks holding this rank's blocks too (None: none)
    metric_names: tuple[str | None, ...] = ()
    """Preference pairs: the names of the values read after the loss (None: not logged)."""

    def named(self, values: list[float]) -> dict[str, float]:
        """The step's metrics by name (preference pairs; empty otherwise)."""
        return {name: value for name, value in zip(self.metric_names, values, strict=False) if name is not None}

    def sum_expert_replicas(self) -> None:
        """Sum the expert blocks' gradients over their replicas (expert parallelism over part of
        the job; once per step, after the last backward): each then holds every rank's tokens, as
        DDP's sum gives the other weights. A block without a gradient joins with zeros."""
        if self.expert_replicas is None:
            return
        with record_function("hone: expert replica sums"):
            self._sum_replicas()

    def _sum_replicas(self) -> None:
        trained = [p for p in self.sharded if p.requires_grad]
        for param in trained:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        sum_over_replicas([p.grad for p in trained], self.expert_replicas)


@dataclass
class Window:
    """One optimizer step's micro-batches (this rank's), with the token counts the loss divides by."""

    batches: list[MicroBatch]
    trained_tokens: int  # this rank's
    tokens: int  # this rank's real input tokens
    divisor: int | torch.Tensor  # the trained tokens every micro-batch's loss sum is divided by (pairs: [NLL tokens, pairs])
    position: DataPosition  # where the data stands after this window: what a checkpoint after its step saves
    global_counts: torch.Tensor | None = None  # several processes: (trained, real[, NLL tokens, pairs]) over all ranks
    pairs: int = 0  # this rank's preference pairs (0: SFT rows)
    nll_tokens: int = 0  # this rank's chosen tokens that ORPO's NLL averages over


def take_window(stream: BatchStream, batches: Batches, device: torch.device, hooks: RunHooks, world: World) -> Window:
    """The next window from the seeded data order (advancing ``stream``), with its counts taken
    before any backward. With several processes every rank divides by the global count (0 -> 1:
    the loss stays 0)."""
    return with_global_counts(collate_window(stream, batches, device, hooks), device, world)


def collate_window(stream: BatchStream, batches: Batches, device: torch.device, hooks: RunHooks) -> Window:
    """The next window's micro-batches on ``device`` (copies queued, not waited for) with this
    rank's counts; advances ``stream``. Nothing here talks to other ranks, so it may run a step
    ahead of the one that trains it (:mod:`hone.train.prefetch`)."""
    with record_function("hone: batches"):
        # the part of each whole micro-batch this rank trains (context parallelism: its shard of the
        # sequence), after the attention inputs of the whole sequence are attached and before counting
        # (counted on the host copy: no wait for the device)
        hosts = [batches(rows) for rows in stream.next_window()]
        micro = [hooks.local_batch(host.to(device).with_attention(hooks.layout), host) for host in hosts]
    trained = sum(b.trained_tokens for b in micro)
    pairs, nll_tokens = sum(b.pairs for b in micro), sum(b.nll_tokens for b in micro)
    divisor = pair_divisor(nll_tokens, pairs, device) if pairs else trained
    return Window(micro, trained, sum(b.tokens for b in micro), divisor, stream.position, None, pairs, nll_tokens)


def pair_divisor(nll_tokens: int, pairs: int, device: torch.device) -> torch.Tensor:
    """``[NLL tokens, pairs]`` (each at least 1) on ``device``, what a window's pair loss terms divide by."""
    return _on_device([max(nll_tokens, 1), max(pairs, 1)], torch.float32, device)


def _on_device(values: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host counts on ``device`` without waiting: through pinned memory to a GPU (from pageable
    memory the copy would block the host)."""
    counts = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        counts = counts.pin_memory()
    return counts.to(device, non_blocking=True)


def with_global_counts(window: Window, device: torch.device, world: World) -> Window:
    """``window`` ready to train: with several processes, its counts all-reduced (SUM) on the
    device and the divisor the global trained count. Called for each window in step order, so
    every rank issues this collective at the same point."""
    if not world.distributed:
        return window
    if window.pairs:
        counts = _global_counts([window.trained_tokens, window.tokens, window.nll_tokens, window.pairs], device)
        return replace(window, divisor=counts[2:].float().clamp(min=1), global_counts=counts)
    counts = _global_counts([window.trained_tokens, window.tokens], device)
    return replace(window, divisor=counts[0].clamp(min=1), global_counts=counts)


def _global_counts(local: list[int], device: torch.device) -> torch.Tensor:
    """This rank's counts of the window (trained and real tokens; pairs: NLL tokens and pairs too),
    all-reduced (SUM) on the device: the global counts every rank divides by. Issued before the
    first backward; the host reads them only at the step's one sync (pinned memory keeps the copy
    asynchronous)."""
    counts = _on_device(local, torch.int64, device)
    dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    return counts


def forward_backward_step(
    step: StepModule,
    batch: MicroBatch,
    divisor: int | torch.Tensor,
    hooks: RunHooks,
    scaler: torch.amp.GradScaler | None,
    reduce: bool,
) -> torch.Tensor:
    """Forward and backward of one micro-batch; returns its token-loss sum (detached, on the device).

    The micro-batch contributes ``sum of its token losses / divisor`` (the window's trained
    tokens), so the gradients accumulated over a window equal those of one big batch holding all
    of its rows. Unless ``reduce`` (the window's last micro-batch), the backward runs under the
    data-parallel module's ``no_sync``: gradients are reduced once per window. Its graph is freed
    on return, before the next micro-batch."""
    with step.no_sync() if not reduce else nullcontext(), hooks.step_context(batch):
        with record_function("hone: forward + loss"):
            loss_sum = step.module(batch)
            loss = window_share(loss_sum, divisor)
        with record_function("hone: backward"):
            (scaler.scale(loss) if scaler is not None else loss).backward()
    return loss_sum.detach()


def window_share(sums: torch.Tensor, divisor: int | torch.Tensor) -> torch.Tensor:
    """What one micro-batch's loss sums add to the window's loss: the token-loss sum over the
    window's trained tokens, or a pair micro-batch's two loss terms over ``[NLL tokens, pairs]``."""
    if sums.dim() == 0:
        return sums / divisor
    return (sums[:PAIR_TERMS] / divisor).sum()


def forward_backward(
    step: StepModule,
    batches: list[MicroBatch],
    divisor: int | torch.Tensor,
    hooks: RunHooks,
    scaler: torch.amp.GradScaler | None,
) -> torch.Tensor:
    """Forward + backward every micro-batch of a window; returns the window's token-loss sum
    divided by ``divisor``, as a device tensor (nothing here waits for the device); pairs:
    ``[loss, NLL mean, metric means...]`` (:func:`hone.runtime.pair_loss.window_values`)."""
    total = None
    last = len(batches) - 1
    for i, batch in enumerate(batches):
        loss_sum = forward_backward_step(step, batch, divisor, hooks, scaler, reduce=i == last)
        total = loss_sum if total is None else total + loss_sum
    assert total is not None
    if total.dim() == 0:
        return total / divisor
    assert isinstance(divisor, torch.Tensor)
    return window_values(total, divisor)


def train_step(
    parts: StepParts, window: Window, stop: StopRequest, while_device_works: Callable[[], None] | None = None
) -> StepResult:
    """One optimizer step on ``window``: forward/backward, the step's one sync, and the update
    if the loss and the gradients are usable; the gradients are zeroed either way.

    ``while_device_works`` is called once, after the forward and backward (and the clipping) are
    queued and before the sync: host work placed there overlaps the device's."""
    meanwhile = while_device_works or _nothing
    if window.trained_tokens == 0 and window.global_counts is None:  # nothing to learn from: no forward
        meanwhile()
        result = StepResult(StepOutcome.NO_TRAINED_TOKENS, math.nan, None, 0, window.tokens)
    elif parts.scaler is None:
        result = _plain_step(parts, window, stop, meanwhile)
    else:
        result = _float16_step(parts, window, stop, parts.scaler, meanwhile)
    with record_function("hone: after step"):
        parts.optimizer.zero_grad(set_to_none=True)
    return result


def _nothing() -> None:
    pass


def _plain_step(parts: StepParts, window: Window, stop: StopRequest, meanwhile: Callable[[], None]) -> StepResult:
    """Clip on the device, then the step's one sync: loss and norm together."""
    loss_t = forward_backward(parts.step_module, window.batches, window.divisor, parts.hooks, None)
    parts.sum_expert_replicas()
    with record_function("hone: grad norm"):  # over every rank (FSDP2, experts)
        norm_t = global_grad_norm(parts.params, parts.max_grad_norm, parts.sharded, parts.expert_group)
    with record_function("hone: while the device works"):
        meanwhile()
    with record_function("hone: read loss and norm"):
        read = read_step(loss_t, norm_t, window, stop)
    outcome = classify(read.trained_tokens, read.loss, read.grad_norm, scaled=False)
    if outcome is StepOutcome.UPDATED:
        with record_function("hone: optimizer"):
            parts.optimizer.step()
            parts.scheduler.step()
    grad_norm = read.grad_norm if outcome in (StepOutcome.UPDATED, StepOutcome.NONFINITE_GRAD_NORM) else None
    return StepResult(
        outcome,
        read.loss,
        grad_norm,
        read.trained_tokens,
        read.tokens,
        read.any_rank_stopping,
        metrics=parts.named(read.values),
    )


def _float16_step(
    parts: StepParts, window: Window, stop: StopRequest, scaler: torch.amp.GradScaler, meanwhile: Callable[[], None]
) -> StepResult:
    """float16: the scaler unscales only a finite loss's gradients (its bookkeeping allows one
    unscale per update), so the loss is read first, the norm after unscaling."""
    loss_t = forward_backward(parts.step_module, window.batches, window.divisor, parts.hooks, scaler)
    parts.sum_expert_replicas()  # the scaled gradients: a sum commutes with unscaling
    with record_function("hone: while the device works"):
        meanwhile()
    read = read_step(loss_t, None, window, stop)
    grad_norm = None
    if classify(read.trained_tokens, read.loss, None, scaled=True) is StepOutcome.UPDATED:
        scaler.unscale_(parts.optimizer)
        grad_norm = global_grad_norm(parts.params, parts.max_grad_norm, parts.sharded, parts.expert_group).item()
    outcome = classify(read.trained_tokens, read.loss, grad_norm, scaled=True)
    loss_scale = None
    if outcome is StepOutcome.UPDATED:
        scaler.step(parts.optimizer)  # calls optimizer.step(): the gradients are finite
        scaler.update()
        parts.scheduler.step()
    elif outcome is StepOutcome.FP16_OVERFLOW:
        scaler.update()  # lowers the loss scale: the scaler's normal recovery
        loss_scale = scaler.get_scale()
    return StepResult(
        outcome,
        read.loss,
        grad_norm,
        read.trained_tokens,
        read.tokens,
        read.any_rank_stopping,
        loss_scale,
        parts.named(read.values),
    )


@dataclass(frozen=True)
class StepReading:
    """The host's view of a step after its one sync."""

    loss: float
    grad_norm: float | None
    trained_tokens: int
    tokens: int
    any_rank_stopping: bool
    values: list[float] = field(default_factory=list)  # preference pairs: what follows the loss (NLL mean, metrics)


def read_step(loss: torch.Tensor, grad_norm: torch.Tensor | None, window: Window, stop: StopRequest) -> StepReading:
    """The step's loss and gradient norm on the host: the one device sync of an optimizer step,
    taken before the update so a non-finite step is skipped exactly. With several processes the
    loss is the global mean, all-reduced with the stop flag, and the global token counts ride along.
    ``loss`` is a scalar, or for pairs ``[loss, values...]`` (read, and all-reduced, together)."""
    flat = loss.reshape(-1)
    if window.global_counts is None:
        value, norm, values = read_values(flat[0], grad_norm, flat[1:] if flat.numel() > 1 else None)
        return StepReading(value, norm, window.trained_tokens, window.tokens, False, values)
    flag = torch.zeros_like(flat[:1]) + float(stop.requested)  # no host-to-device copy
    both = torch.cat([flat, flag])
    dist.all_reduce(both, op=dist.ReduceOp.SUM)  # the global mean loss (and metrics); any rank stopping
    counts = window.global_counts.numel()
    value, norm, extra = read_values(both[0], grad_norm, torch.cat([window.global_counts.double(), both[1:].double()]))
    trained, real = int(extra[0]), int(extra[1])
    values = extra[counts:-1]
    return StepReading(math.nan if trained == 0 else value, norm, trained, real, extra[-1] > 0, values)


def read_values(
    loss: torch.Tensor, grad_norm: torch.Tensor | None, extra: torch.Tensor | None = None
) -> tuple[float, float | None, list[float]]:
    """``loss``, ``grad_norm`` and ``extra`` (several processes: the global token counts and the
    stop flag) on the host, in one copy."""
    if grad_norm is None and extra is None:
        return float(loss.item()), None, []
    dtype = torch.float64 if extra is not None else torch.float32  # token counts stay exact
    parts = [loss.reshape(1).to(dtype)]
    if grad_norm is not None:
        parts.append(grad_norm.reshape(1).to(device=loss.device, dtype=dtype))
    if extra is not None:
        parts.append(extra.reshape(-1).to(device=loss.device, dtype=dtype))
    values = torch.cat(parts).tolist()
    if grad_norm is None:
        return values[0], None, values[1:]
    return values[0], values[1], values[2:]
