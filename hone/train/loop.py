"""The training loop, spelled out: one optimizer step per iteration, nothing hidden.

:func:`train_loop` sets the run up (:mod:`hone.train.setup`), evaluates the untrained model,
then runs :func:`run_steps` until the plan's last step or a stop signal. Each iteration:

1. takes the next window of micro-batches and runs one optimizer step on it
   (:func:`~hone.train.train_step.train_step`: forward/backward per micro-batch, the step's one
   sync, the update unless the loss or the gradient is not finite; its outcome is a
   :class:`~hone.train.train_step.StepOutcome`);
2. counts it in the :class:`~hone.train.state.TrainState` (a skipped step is counted and said
   in words), and stops with :class:`NonFiniteLossError` after
   ``training.max_consecutive_nonfinite`` non-finite steps in a row;
3. logs, evaluates, checkpoints, each component on its own cadence (the step log every
   ``logging.logging_steps``; the evaluator every ``training.eval_steps``; the checkpointer every
   ``training.save_steps``; all of them after the last step), and stops cleanly on
   SIGINT/SIGTERM: the step in progress finishes, a checkpoint is saved, the loop returns.

**The host's share of the step boundary overlaps the device's work.** The step's one sync is
where the host waits for the device; whatever the host does after it, the device waits for. So
the boundary's bookkeeping runs *before* that sync, while step N's forward and backward still
run on the device: the host builds step N+1's window (collate, pinned copies, attention inputs;
:mod:`hone.train.prefetch`) and writes step N-1's metrics row (:mod:`hone.train.step_log`).
After the sync only the update, the counting and the cadence checks remain before step N+1's
forward. What the run computes and writes is unchanged: the same data order, each row with its
own step's values, written before an eval, a checkpoint, a stop, the end or an error; the
position a checkpoint saves is that of the window its step trained, never the one prefetched.

A fresh run with eval data evaluates once before the first step (step 0), so the report can
compare the final eval loss with the untrained model's.

**Several processes** (``torchrun``, see docs/distributed.md): every rank runs this loop on its
share of each step (how the loss and the gradients are reduced: :mod:`hone.train.train_step`).
A signal seen by any rank stops all of them after the same step: the stop flag is all-reduced
with the step's loss and read at the step's one sync. Only rank 0 writes metrics, plots and
checkpoints (:mod:`hone.train.checkpoint_io`).
"""

import math
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from torch import nn

from hone.config.root import HoneConfig
from hone.errors import HoneError
from hone.runtime.world import World, current_world
from hone.train.batches import StepPlan
from hone.train.device import memory_reading
from hone.train.prefetch import WindowFeed
from hone.train.setup import Trainer, set_up
from hone.train.signals import StopRequest, graceful_stop
from hone.train.step_log import StepLog, StepMetrics
from hone.train.train_step import StepResult, train_step
from hone.transforms.base import RunHooks


class NonFiniteLossError(HoneError):
    """Too many optimizer steps in a row had a non-finite loss or gradient."""


@dataclass
class LoopResult:
    start_step: int  # 0, or the step resumed from
    steps: int  # the step reached
    total_steps: int
    final_loss: float | None  # the last finite train loss
    eval_losses: list[tuple[int, float]]  # (step, loss), including earlier runs when resumed
    skipped_steps: int
    interrupted: str | None  # signal name when stopped by SIGINT/SIGTERM
    last_checkpoint: Path | None
    metrics_path: Path
    plot_path: Path | None
    elapsed_s: float  # time spent in optimizer steps by this process (no eval, no saving)
    wall_s: float  # the whole loop in this process, eval and checkpoints included
    tokens: int  # real input tokens processed by the run's steps here (all processes' together)
    trained_tokens: int  # trained tokens of those steps (all processes' together)
    resumed_from: Path | None
    plan: StepPlan


@dataclass
class Tally:
    """What this process's steps add up to (not saved: a resumed run starts its own)."""

    final_loss: float | None = None  # the last finite train loss
    elapsed_s: float = 0.0
    tokens: int = 0
    trained_tokens: int = 0
    last_checkpoint: Path | None = None
    interrupted: str | None = None


def train_loop(
    model: nn.Module,
    train_data,
    eval_data,
    cfg: HoneConfig,
    *,
    device: torch.device,
    pad_id: int,
    hooks: RunHooks,
    console: Console | None = None,
    step_callback: Callable[[StepMetrics], None] | None = None,
    resume_from: Path | None = None,
    autocast_dtype: torch.dtype | None = None,
    world: World | None = None,
    trackers: list | None = None,
    before_trackers_close: Callable[[], None] | None = None,
    save_checkpoints: bool = True,
) -> LoopResult:
    """Train ``model`` (already on ``device``, in its dtype, with its trainable parameters set
    and the plan applied) on ``train_data`` (rows of ``input_ids``/``labels``), evaluating on
    ``eval_data`` if given.

    ``hooks`` are what the run's plan gives the loop (loss function, attention layout, per
    micro-batch contexts, after-step actions, data-parallel wrapping, checkpoint IO).

    ``world``: this process among the run's (default: the process group joined, if any). Every
    rank calls this with the same data and config; rank 0 writes the outputs.

    ``trackers``: W&B / MLflow trackers already started (``hone train`` starts them before the
    model loads); without them rank 0 starts those of ``logging.trackers`` here. The loop
    closes them, after ``before_trackers_close()`` (``hone train`` completes
    ``optimizations.json`` with the compile counts there, so the trackers get the whole record).

    ``save_checkpoints=False`` writes no checkpoint, not even the last (``hone bench``).

    Outputs go to ``cfg.training.output_dir``: ``metrics.jsonl``, ``tensorboard/``,
    ``checkpoints/``, ``loss.png``. Returns a summary; raises :class:`HoneError` subclasses
    for the user's problems (diverging loss, a checkpoint that does not fit).
    """
    console = console or Console()
    trainer = set_up(
        model,
        train_data,
        eval_data,
        cfg,
        device=device,
        pad_id=pad_id,
        hooks=hooks,
        world=world or current_world(),
        console=console,
        resume_from=resume_from,
        autocast_dtype=autocast_dtype,
        trackers=trackers,
        save_checkpoints=save_checkpoints,
    )
    tally = Tally()
    loop_start = time.perf_counter()
    try:
        if trainer.evaluator.baseline_due(trainer.state.step):
            trainer.evaluator.run(trainer.state.step)  # the baseline the final eval is compared with
        with graceful_stop(announce=trainer.world.is_main) as stop:
            run_steps(trainer, stop, tally, step_callback)
    except BaseException:
        trainer.tracker.failed = True  # trackers mark the run failed
        raise
    finally:
        if before_trackers_close is not None:
            before_trackers_close()
        plot_path = trainer.tracker.close()
    if tally.interrupted:
        console.print(
            f"Stopped by {tally.interrupted} after step {trainer.state.step}/{trainer.plan.total_steps}; checkpoint "
            f"saved to {tally.last_checkpoint}. To continue, run the same command with --set training.resume=latest "
            "(or set training.resume: latest in the config); to start over, add --overwrite.",
            highlight=False,
            markup=False,
            soft_wrap=True,
        )
    return _result(trainer, tally, plot_path, time.perf_counter() - loop_start)


def run_steps(trainer: Trainer, stop: StopRequest, tally: Tally, step_callback: Callable[[StepMetrics], None] | None) -> None:
    """Optimizer steps until the plan's last one, or until a signal stops the run (then
    ``tally.interrupted`` names it, after the step in progress and its checkpoint). The last
    step's metrics row is written before this returns or raises."""
    try:
        _steps(trainer, stop, tally, step_callback)
    except BaseException:
        with suppress(Exception):  # the error that stopped the run is the one to report
            trainer.log.flush()
        raise
    trainer.log.flush()


def _steps(trainer: Trainer, stop: StopRequest, tally: Tally, step_callback: Callable[[StepMetrics], None] | None) -> None:
    state, plan, log = trainer.state, trainer.plan, trainer.log
    feed = WindowFeed(trainer.stream, trainer.batches, trainer.device, trainer.parts.hooks, trainer.world)
    stop.step = state.step + 1  # the step a signal's line names (then kept by stop.after_step)
    while state.step < plan.total_steps:
        step_start = time.perf_counter()
        lr = float(trainer.parts.optimizer.param_groups[0]["lr"])  # a tensor for torchao's, changed in place
        window = feed.next()
        state.position = window.position  # this window's end, not the prefetched one's
        more = state.step + 1 < plan.total_steps  # the same on every rank: a stop is known only after the sync
        result = train_step(trainer.parts, window, stop, partial(_while_device_works, feed if more else None, log))
        metrics = _count(trainer, tally, result, lr, step_start)
        last = state.step == plan.total_steps
        log.hold(metrics, last)  # written while the next step computes, or below
        if step_callback is not None:
            step_callback(metrics)
        if state.consecutive_nonfinite >= trainer.max_consecutive_nonfinite:
            raise _diverged(state.step, state.consecutive_nonfinite, trainer.max_consecutive_nonfinite)
        if trainer.evaluator.due(state.step, last):
            log.flush()  # the step's row before its eval row
            trainer.evaluator.run(state.step)
        here = stop.after_step(state.step)
        stopping = result.any_rank_stopping if trainer.world.distributed else here
        if trainer.checkpointer.due(state.step, last, stopping):
            log.flush()  # metrics.jsonl holds the checkpoint's step when the checkpoint exists
            tally.last_checkpoint = trainer.checkpointer.save(state, trainer.tracker.rows)
            trainer.tracker.print(f"checkpoint: step {state.step} saved to {tally.last_checkpoint}")
        if stopping and not last:
            tally.interrupted = stop.signal_name or "SIGTERM"  # another rank saw the signal
            return


def _while_device_works(feed: WindowFeed | None, log: StepLog) -> None:
    """The step boundary's host work, done before the step's sync: the next window (when there
    is a next step) and the previous step's metrics row."""
    if feed is not None:
        feed.prefetch()
    log.flush()


def _count(trainer: Trainer, tally: Tally, result: StepResult, lr: float, step_start: float) -> StepMetrics:
    """Count the step in the run's state and this process's tally; its metrics."""
    state = trainer.state
    state.advance(result)
    if result.updated:
        tally.final_loss = result.loss
    else:
        trainer.log.skipped(state.step, result, state.consecutive_nonfinite)
    # no sync of its own: the step's time ends at its one sync (the optimizer's kernels, queued
    # after it, fall into the next step's wait), so steps add up to the wall time and the
    # device never idles for a clock reading
    step_time = time.perf_counter() - step_start
    tally.elapsed_s += step_time
    tally.tokens += result.tokens
    tally.trained_tokens += result.trained_tokens
    memory = memory_reading(trainer.device)
    return StepMetrics(
        step=state.step,
        epoch=trainer.plan.epoch_at(state.step),
        loss=result.loss,
        lr=lr,
        grad_norm=result.grad_norm,
        trained_tokens=result.trained_tokens,
        trained_tokens_total=state.trained_tokens_total,
        tokens=result.tokens,
        tokens_per_s=result.tokens / step_time if step_time > 0 else math.nan,
        step_time_s=step_time,
        peak_mem_gib=memory.peak_allocated_gib,
        skipped=not result.updated,
        peak_reserved_gib=memory.peak_reserved_gib,
        alloc_retries=memory.alloc_retries,
        metrics=result.metrics,
    )


def _diverged(step: int, in_a_row: int, limit: int) -> NonFiniteLossError:
    return NonFiniteLossError(
        f"training stopped at step {step}: {in_a_row} optimizer "
        "steps in a row had a non-finite loss or gradient (training.max_consecutive_nonfinite = "
        f"{limit}). The run has diverged: lower optimizer.learning_rate, "
        "keep training.max_grad_norm set, add warm-up, or use bfloat16 instead of float16; "
        "the last checkpoint (if any) is under checkpoints/"
    )


def _result(trainer: Trainer, tally: Tally, plot_path: Path | None, wall_s: float) -> LoopResult:
    rows = trainer.tracker.rows
    return LoopResult(
        start_step=trainer.start_step,
        steps=trainer.state.step,
        total_steps=trainer.plan.total_steps,
        final_loss=tally.final_loss if tally.final_loss is not None else _last_train_loss(rows),
        eval_losses=[(r["step"], r["eval_loss"]) for r in rows if r.get("eval_loss") is not None],
        skipped_steps=trainer.state.skipped_steps,
        interrupted=tally.interrupted,
        last_checkpoint=tally.last_checkpoint,
        metrics_path=trainer.tracker.metrics_path,
        plot_path=plot_path,
        elapsed_s=tally.elapsed_s,
        wall_s=wall_s,
        tokens=tally.tokens,
        trained_tokens=tally.trained_tokens,
        resumed_from=trainer.resumed_from,
        plan=trainer.plan,
    )


def _last_train_loss(rows: list[dict[str, Any]]) -> float | None:
    losses = [r["loss"] for r in rows if r.get("loss") is not None and "eval_loss" not in r]
    return losses[-1] if losses else None
