"""The training loop, spelled out: one optimizer step per iteration, nothing hidden.

Each optimizer step:

1. takes the next accumulation window (``gradient_accumulation_steps`` micro-batches) from
   the seeded data order and counts its trained tokens *before* any backward pass;
2. for each micro-batch: forward, ``sum of token losses / window's trained tokens``,
   backward (so the window's gradient is the mean over all its tokens, whatever the split);
3. skips the update if the loss or the gradient norm is not finite (grads zeroed, optimizer
   and schedule untouched, the step counted), and stops with an error after
   ``training.max_consecutive_nonfinite`` of those in a row;
4. clips the gradient norm, steps the optimizer and the schedule, zeroes the gradients;
5. logs, evaluates, checkpoints on their intervals, and stops cleanly on SIGINT/SIGTERM.

**Several processes** (``torchrun``, see docs/distributed.md): each rank trains its share of the
step's global batch (:mod:`hone.train.batches`); the window's trained-token count is
all-reduced (SUM) before the first backward, so every rank divides its token-loss sum by the
*global* count; gradients are summed across ranks once per step (the plan's data-parallel
transform: DDP with a SUM hook, ``no_sync`` for all but the window's last micro-batch). The loss
that is logged is the global mean, all-reduced together with a stop flag (a signal seen by any
rank stops all of them after the same step) and read at the step's one sync. Every rank holds
the reduced gradients, so the clipping norm and the non-finite decision are the same
everywhere. Only rank 0 writes metrics, plots and checkpoints (:mod:`hone.train.checkpoint_io`).

A fresh run with eval data evaluates once before the first step (step 0), so the report can
compare the final eval loss with the untrained model's; eval also runs every
``training.eval_steps`` and after the last step. A checkpoint is written every
``training.save_steps``, after the last step, and when a signal stops the run.

Precision: the model arrives in its dtypes (see :mod:`hone.models.precision`). When the
loader says so (``autocast_dtype``: float32 trainable weights beside bf16/fp16 compute) the
forward runs under ``torch.autocast``; the loss is always computed outside it, in float32.
``model.dtype: float16`` needs loss scaling to keep small gradients from flushing to zero; it
is done with ``torch.amp.GradScaler`` on CUDA and refused on CPU (where bfloat16 or float32 are
the choices). With fp16, an overflow the scaler handles by lowering its scale is counted as a
skipped step but not towards the consecutive limit.
"""

import math
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console
from torch import nn
from torch.profiler import record_function  # names the loop's phases in a profile; no cost otherwise

from hone.config.loader import dump_config
from hone.config.root import HoneConfig
from hone.data.packing import packing_for
from hone.errors import HoneError
from hone.track.tracker import Tracker
from hone.train.batches import BatchStream, DataPosition, StepPlan, micro_batches, plan_steps
from hone.train.checkpoint import checkpoint_eval_rows, remove_checkpoints_after, resume_history
from hone.train.checkpoint_io import RankZeroCheckpoints
from hone.train.collate import MicroBatch
from hone.train.distributed import World, current_world
from hone.transforms.base import RunFacts, RunHooks, StepModule
from hone.train.device import peak_memory_gib
from hone.train.evaluate import evaluate
from hone.train.grad_norm import global_grad_norm
from hone.train.optim import build_optimizer, build_scheduler, make_schedule
from hone.train.seed import seed_everything
from hone.train.signals import graceful_stop


class NonFiniteLossError(HoneError):
    """Too many optimizer steps in a row had a non-finite loss or gradient."""


class UnsupportedPrecision(HoneError):
    """A dtype that cannot be trained on this device."""


@dataclass
class StepMetrics:
    """What one optimizer step did; passed to ``step_callback`` and logged as a metrics row."""

    step: int
    epoch: float
    loss: float  # mean per trained token over the window; nan when non-finite
    lr: float  # learning rate this step used
    grad_norm: float | None  # before clipping; None when the loss was already non-finite
    trained_tokens: int  # tokens with a loss in this step
    trained_tokens_total: int
    tokens: int  # real (non-padding) input tokens in this step
    tokens_per_s: float  # real input tokens per second of step time
    step_time_s: float
    peak_mem_gib: float | None
    skipped: bool

    def as_row(self) -> dict[str, Any]:
        row = asdict(self)
        row["epoch"] = round(self.epoch, 4)
        return row


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
class _Counters:
    """The loop's mutable progress; goes into every checkpoint as ``trainer_state.json``."""

    step: int = 0
    position: DataPosition = field(default_factory=DataPosition)
    skipped_steps: int = 0
    consecutive_nonfinite: int = 0
    trained_tokens_total: int = 0
    tokens_total: int = 0


def _window_loss_backward(
    model: nn.Module,
    window: list[MicroBatch],
    window_tokens: int | torch.Tensor,
    hooks: RunHooks,
    scaler: torch.amp.GradScaler | None,
    autocast_dtype: torch.dtype | None,
    step: StepModule | None = None,
) -> torch.Tensor:
    """Forward + backward every micro-batch of the window; returns the window's token-loss sum
    divided by ``window_tokens``, as a device tensor (nothing here waits for the device).

    Each micro-batch contributes ``sum of its token losses / window_tokens``, so the gradients
    accumulated over the window equal those of one big batch holding all of its rows. With
    several processes ``window_tokens`` is the global count (a device tensor) and ``step`` the
    data-parallel module: every micro-batch but the last runs under its ``no_sync``, so the
    gradients are reduced once, after the window's last backward.
    """
    if step is None:
        step = hooks.step_module(model, autocast_dtype)
    total = None
    last = len(window) - 1
    for i, batch in enumerate(window):
        with step.no_sync() if i < last else nullcontext(), hooks.step_context(batch):
            with record_function("hone: forward + loss"):
                loss_sum = step.module(batch)
                loss = loss_sum / window_tokens
            with record_function("hone: backward"):
                (scaler.scale(loss) if scaler is not None else loss).backward()
        total = loss_sum.detach() if total is None else total + loss_sum.detach()
        del loss_sum, loss  # free the activations' graph before the next micro-batch
    assert total is not None
    return total / window_tokens


def _grad_norm(params: list[nn.Parameter], max_norm: float | None) -> torch.Tensor:
    """Global L2 norm of the gradients (a device tensor), clipping them to ``max_norm`` when it
    is set. Clipping scales by ``min(1, max_norm / norm)`` on the device: no host sync."""
    return global_grad_norm(params, max_norm)  # over every rank's shard when FSDP2 shards the gradients


def _read_step(
    loss: torch.Tensor, grad_norm: torch.Tensor | None, extra: torch.Tensor | None = None
) -> tuple[float, float | None, list[float]]:
    """The step's loss and gradient norm on the host: the one device sync of an optimizer step
    (all values in one copy), taken before the update so a non-finite step is skipped exactly.
    ``extra`` (several processes: the global token counts and the stop flag) rides along."""
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


def _global_counts(trained: int, real: int, device: torch.device) -> torch.Tensor:
    """This rank's (trained, real) token counts of the window, all-reduced (SUM) on the device:
    the global counts every rank divides by. Issued before the first backward; the host reads
    them only at the step's one sync (pinned memory keeps the copy asynchronous)."""
    counts = torch.tensor([trained, real], dtype=torch.int64)
    if device.type == "cuda":
        counts = counts.pin_memory()
    counts = counts.to(device, non_blocking=True)
    dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    return counts


def _is_finite(value: float) -> bool:
    return math.isfinite(value)


def _check_precision(cfg: HoneConfig, device: torch.device) -> torch.amp.GradScaler | None:
    """A GradScaler for float16 on CUDA, None otherwise; float16 on CPU is refused."""
    if cfg.model.dtype != "float16":
        return None
    if device.type != "cuda":
        raise UnsupportedPrecision(
            f"model.dtype: float16 training needs a CUDA GPU (loss scaling); on {device.type} use "
            "bfloat16 or float32"
        )
    return torch.amp.GradScaler("cuda")


def train_loop(
    model: nn.Module,
    train_data,
    eval_data,
    cfg: HoneConfig,
    *,
    device: torch.device,
    pad_id: int,
    console: Console | None = None,
    step_callback: Callable[[StepMetrics], None] | None = None,
    resume_from: Path | None = None,
    autocast_dtype: torch.dtype | None = None,
    hooks: RunHooks | None = None,
    world: World | None = None,
    trackers: list | None = None,
    before_trackers_close: Callable[[], None] | None = None,
) -> LoopResult:
    """Train ``model`` (already on ``device``, in its dtype, with its trainable parameters set)
    on ``train_data`` (rows of ``input_ids``/``labels``), evaluating on ``eval_data`` if given.

    ``hooks`` are what the run's plan gives the loop (loss function, attention layout, per
    micro-batch contexts, after-step actions); without them the plan of ``cfg`` is drawn up
    for this device and its hooks used, with the model taken as it is.

    ``world``: this process among the run's (default: the process group joined, if any). Every
    rank calls this with the same data and config; rank 0 writes the outputs.

    ``trackers``: W&B / MLflow trackers already started (``hone train`` starts them before the
    model loads); without them rank 0 starts those of ``logging.trackers`` here. The loop
    closes them, after ``before_trackers_close()`` (``hone train`` completes
    ``optimizations.json`` with the compile counts there, so the trackers get the whole record).

    Outputs go to ``cfg.training.output_dir``: ``metrics.jsonl``, ``tensorboard/``,
    ``checkpoints/``, ``loss.png``. Returns a summary; raises :class:`HoneError` subclasses
    for the user's problems (diverging loss, a checkpoint that does not fit).
    """
    t, log_cfg = cfg.training, cfg.logging
    world = world or current_world()
    console = console or Console()
    output_dir = Path(t.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    has_eval = eval_data is not None and len(eval_data) > 0

    # ---- set-up: plan, optimizer, schedule, (loss scaler), state
    if hooks is None:
        from hone.transforms.planner import plan_optimizations

        facts = RunFacts(device, world=world)
        hooks = plan_optimizations(cfg, facts).hooks(model, cfg, facts)
    checkpoints = hooks.checkpoint_io or RankZeroCheckpoints(world)
    scaler = _check_precision(cfg, device)
    batches = micro_batches(train_data, packing_for(train_data, cfg, "train"), pad_id)  # bins: packed once, in hone.data
    eval_packing = packing_for(eval_data, cfg, "eval") if has_eval else None
    plan = plan_steps(batches.units, t, world.world_size)
    seed_everything(t.seed)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(model, cfg.optimizer, device)
    scheduler = build_scheduler(optimizer, cfg.optimizer, plan.total_steps)
    counters = _Counters()
    history: list[dict[str, Any]] | None = None
    notes: list[str] = []
    if resume_from is not None:
        saved = checkpoints.load(
            resume_from, model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler, state_dict_hooks=()
        )
        counters = _Counters(
            step=saved["step"],
            position=DataPosition(**saved["position"]),
            skipped_steps=saved["skipped_steps"],
            consecutive_nonfinite=saved["consecutive_nonfinite"],
            trained_tokens_total=saved["trained_tokens_total"],
            tokens_total=saved["tokens_total"],
        )
        history = resume_history(resume_from, saved)  # from the run's metrics.jsonl, not the checkpoint
        notes = _resume_notes(saved, plan, t.seed, scheduler, cfg)
        if world.is_main:
            dropped = remove_checkpoints_after(output_dir, counters.step)
            notes += [f"removed checkpoint {p.name} (newer than the one resumed from)" for p in dropped]
    start_step = counters.step
    stream = BatchStream(plan, t.seed, counters.position, rank=world.rank)
    step_module = hooks.step_module(model, autocast_dtype)  # DDP: the weights broadcast from rank 0
    if trackers is None and world.is_main:
        from hone.track.trackers import start_trackers

        trackers = start_trackers(cfg, lambda m: console.print(f"warning: {m}", highlight=False, markup=False))
    tracker = Tracker(
        log_cfg,
        output_dir,
        console,
        total_steps=plan.total_steps,
        resume_step=start_step if resume_from is not None else None,
        history=history,
        enabled=world.is_main,
        external=trackers,
        run_config=dump_config(cfg) if world.is_main else None,
    )

    def checkpoint_state() -> dict[str, Any]:
        return {
            "step": counters.step,
            "position": stream.position.as_dict(),
            "skipped_steps": counters.skipped_steps,
            "consecutive_nonfinite": counters.consecutive_nonfinite,
            "trained_tokens_total": counters.trained_tokens_total,
            "tokens_total": counters.tokens_total,
            "plan": {
                "rows": plan.rows,
                "rows_per_step": plan.rows_per_step,
                "total_steps": plan.total_steps,
                "world_size": plan.world_size,
            },
            "seed": t.seed,
            "eval_rows": checkpoint_eval_rows(tracker.rows),  # not every row: trainer_state.json stays small
        }

    def save() -> Path:
        return checkpoints.save(
            output_dir,
            counters.step,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            scaler=scaler,
            state=checkpoint_state(),
            keep=t.save_total_limit,
            state_dict_hooks=(),
        )

    def run_eval() -> None:
        result = evaluate(
            model,
            eval_data,
            batch_size=t.micro_batch_size,
            pad_id=pad_id,
            device=device,
            autocast_dtype=autocast_dtype,
            packing=eval_packing,
            hooks=hooks,
            world=world,
            step=step_module.module,
        )
        tracker.log_eval(
            {
                "step": counters.step,
                "epoch": round(plan.epoch_at(counters.step), 4),
                "eval_loss": result.loss,
                "eval_ppl": result.perplexity,
                "eval_tokens": result.tokens,
            }
        )

    if batches.packing is not None:
        tracker.print(f"sample packing: {batches.packing.describe(len(train_data))}")
    tracker.print(f"training: {plan.describe()}")
    if resume_from is not None:
        tracker.print(f"resumed from {resume_from} at step {start_step} (epoch {plan.epoch_at(start_step):.2f})")
        for note in notes:
            tracker.print(f"note: {note}")

    # ---- the loop
    last_checkpoint: Path | None = None
    final_loss: float | None = None
    interrupted: str | None = None
    elapsed = 0.0
    tokens_here = trained_here = 0
    loop_start = time.perf_counter()
    try:
        if has_eval and start_step == 0:
            run_eval()  # the baseline the final eval is compared with
        with graceful_stop() as stop:
            while counters.step < plan.total_steps:
                step_start = time.perf_counter()
                lr = optimizer.param_groups[0]["lr"]

                # 1. the window's micro-batches and its trained-token count, before any backward
                with record_function("hone: batches"):
                    window = [batches(rows).to(device).with_attention(hooks.layout) for rows in stream.next_window()]
                window_tokens = sum(b.trained_tokens for b in window)
                window_real_tokens = sum(b.tokens for b in window)
                divisor: int | torch.Tensor = window_tokens
                counts: torch.Tensor | None = None
                stopping = stop.requested
                if world.distributed:  # every rank divides by the global count (0 -> 1: the loss stays 0)
                    counts = _global_counts(window_tokens, window_real_tokens, device)
                    divisor = counts[0].clamp(min=1)

                def read(loss_t: torch.Tensor, norm: torch.Tensor | None) -> tuple[float, float | None]:
                    """The step's sync; with several processes the global loss, counts and stop flag."""
                    nonlocal window_tokens, window_real_tokens, stopping
                    if counts is None:
                        return _read_step(loss_t, norm)[:2]
                    flag = torch.zeros_like(loss_t) + float(stop.requested)  # no host-to-device copy
                    both = torch.stack([loss_t, flag])
                    dist.all_reduce(both, op=dist.ReduceOp.SUM)  # the global mean loss; any rank stopping
                    value, norm_value, extra = _read_step(both[0], norm, torch.cat([counts.double(), both[1:].double()]))
                    window_tokens, window_real_tokens, stopping = int(extra[0]), int(extra[1]), extra[2] > 0
                    return (math.nan if window_tokens == 0 else value), norm_value

                # 2. forward/backward each micro-batch, loss normalised by the window's tokens
                grad_norm: float | None = None
                problem: str | None = None
                overflow = False
                if window_tokens == 0 and counts is None:
                    loss_value = math.nan
                    problem = "no trained tokens"
                elif scaler is None:
                    # 3./4. clip on the device, then the step's one sync: loss and norm together
                    loss_t = _window_loss_backward(model, window, divisor, hooks, scaler, autocast_dtype, step_module)
                    with record_function("hone: grad norm"):
                        norm_t = _grad_norm(params, t.max_grad_norm)
                    with record_function("hone: read loss and norm"):
                        loss_value, grad_norm = read(loss_t, norm_t)
                    if window_tokens == 0:
                        problem, grad_norm = "no trained tokens", None
                    elif not _is_finite(loss_value):
                        problem, grad_norm = f"loss is {loss_value}", None
                    elif not _is_finite(grad_norm):
                        problem = f"gradient norm is {grad_norm}"
                    else:
                        with record_function("hone: optimizer"):
                            optimizer.step()
                            scheduler.step()
                else:
                    # float16: the scaler unscales only a finite loss's gradients (its bookkeeping
                    # allows one unscale per update), so the loss is read first
                    loss_value = read(_window_loss_backward(model, window, divisor, hooks, scaler, autocast_dtype, step_module), None)[0]
                    if window_tokens == 0:
                        problem = "no trained tokens"
                    elif not _is_finite(loss_value):
                        problem = f"loss is {loss_value}"
                    else:
                        scaler.unscale_(optimizer)
                        grad_norm = _grad_norm(params, t.max_grad_norm).item()
                        if not _is_finite(grad_norm):
                            scaler.update()  # lowers the loss scale: the scaler's normal recovery
                            problem = f"float16 gradient overflow (loss scale lowered to {scaler.get_scale():g})"
                            overflow = True
                        else:
                            scaler.step(optimizer)
                            scaler.update()
                            scheduler.step()
                with record_function("hone: after step"):
                    if problem is None:
                        hooks.after_optimizer_step()
                    optimizer.zero_grad(set_to_none=True)

                counters.step += 1
                skipped = problem is not None
                if skipped:
                    counters.skipped_steps += 1
                    counts = problem != "no trained tokens" and not overflow
                    if counts:
                        counters.consecutive_nonfinite += 1
                    tracker.print(
                        f"step {counters.step}: {problem}; step skipped (weights, optimizer and schedule "
                        f"unchanged){f', {counters.consecutive_nonfinite} in a row' if counts else ''}"
                    )
                else:
                    counters.consecutive_nonfinite = 0
                    final_loss = loss_value
                    counters.trained_tokens_total += window_tokens
                    counters.tokens_total += window_real_tokens

                # no sync of its own: the step's time ends at its one sync above (the optimizer's
                # kernels, queued after it, fall into the next step's wait), so steps add up to
                # the wall time and the device never idles for a clock reading
                step_time = time.perf_counter() - step_start
                elapsed += step_time
                tokens_here += window_real_tokens
                trained_here += window_tokens
                metrics = StepMetrics(
                    step=counters.step,
                    epoch=plan.epoch_at(counters.step),
                    loss=loss_value,
                    lr=lr,
                    grad_norm=grad_norm,
                    trained_tokens=window_tokens,
                    trained_tokens_total=counters.trained_tokens_total,
                    tokens=window_real_tokens,
                    tokens_per_s=window_real_tokens / step_time if step_time > 0 else math.nan,
                    step_time_s=step_time,
                    peak_mem_gib=peak_memory_gib(device),
                    skipped=skipped,
                )

                # 5. log, hand the step to an observer, evaluate, checkpoint, maybe stop
                last = counters.step == plan.total_steps
                with record_function("hone: log"):
                    if counters.step % log_cfg.logging_steps == 0 or last or skipped:
                        tracker.log_train(metrics.as_row())
                    else:
                        tracker.display.advance(counters.step)
                if step_callback is not None:
                    step_callback(metrics)
                if counters.consecutive_nonfinite >= t.max_consecutive_nonfinite:
                    raise NonFiniteLossError(
                        f"training stopped at step {counters.step}: {counters.consecutive_nonfinite} optimizer "
                        "steps in a row had a non-finite loss or gradient (training.max_consecutive_nonfinite = "
                        f"{t.max_consecutive_nonfinite}). The run has diverged: lower optimizer.learning_rate, "
                        "keep training.max_grad_norm set, add warm-up, or use bfloat16 instead of float16; "
                        "the last checkpoint (if any) is under checkpoints/"
                    )
                if has_eval and ((t.eval_steps and counters.step % t.eval_steps == 0) or last):
                    run_eval()
                if not world.distributed:
                    stopping = stop.requested
                if (t.save_steps and counters.step % t.save_steps == 0) or last or stopping:
                    last_checkpoint = save()
                if stopping and not last:
                    interrupted = stop.signal_name or "SIGTERM"  # another rank saw the signal
                    break
    except BaseException:
        tracker.failed = True  # trackers mark the run failed
        raise
    finally:
        if before_trackers_close is not None:
            before_trackers_close()
        plot_path = tracker.close()

    if interrupted:
        console.print(
            f"Stopped by {interrupted} after step {counters.step}/{plan.total_steps}; checkpoint saved to "
            f"{last_checkpoint}. To continue, run the same command with --set training.resume=latest "
            "(or set training.resume: latest in the config).",
            highlight=False,
            markup=False,
            soft_wrap=True,
        )
    return LoopResult(
        start_step=start_step,
        steps=counters.step,
        total_steps=plan.total_steps,
        final_loss=final_loss if final_loss is not None else _last_train_loss(tracker.rows),
        eval_losses=[(r["step"], r["eval_loss"]) for r in tracker.rows if r.get("eval_loss") is not None],
        skipped_steps=counters.skipped_steps,
        interrupted=interrupted,
        last_checkpoint=last_checkpoint,
        metrics_path=tracker.metrics_path,
        plot_path=plot_path,
        elapsed_s=elapsed,
        wall_s=time.perf_counter() - loop_start,
        tokens=tokens_here,
        trained_tokens=trained_here,
        resumed_from=resume_from,
        plan=plan,
    )


def _last_train_loss(rows: list[dict[str, Any]]) -> float | None:
    losses = [r["loss"] for r in rows if r.get("loss") is not None and "eval_loss" not in r]
    return losses[-1] if losses else None


def _resume_notes(
    saved: dict[str, Any], plan: StepPlan, seed: int, scheduler: torch.optim.lr_scheduler.LambdaLR, cfg: HoneConfig
) -> list[str]:
    """Differences between the checkpoint's run and this one that change what follows.

    The schedule's length follows this run's config (extending ``max_steps`` on resume is the
    common case); everything else (optimizer moments, learning rates) is the checkpoint's.
    """
    notes = []
    before = saved.get("plan", {})
    if before.get("rows") not in (None, plan.rows) or before.get("rows_per_step") not in (None, plan.rows_per_step):
        notes.append(
            f"the data or batch shape changed since the checkpoint ({before.get('rows')} rows, "
            f"{before.get('rows_per_step')} per step; now {plan.rows}, {plan.rows_per_step}): the data order "
            "after resuming differs from the interrupted run's"
        )
    saved_world = before.get("world_size", 1)
    if saved_world != plan.world_size and before.get("rows_per_step") in (None, plan.rows_per_step):
        notes.append(
            f"resumed on {plan.world_size} process{'es' if plan.world_size != 1 else ''} from a checkpoint of "
            f"{saved_world}: the global batch ({plan.rows_per_step} rows per step) is the same, so the data "
            "sequence continues exactly (losses match up to the rounding of a different reduction order)"
        )
    if saved.get("seed") not in (None, seed):
        notes.append(f"training.seed changed ({saved.get('seed')} -> {seed}): the data order differs")
    wanted = make_schedule(cfg.optimizer, plan.total_steps)
    current = scheduler.lr_lambdas[0]
    if asdict(current) != asdict(wanted):
        current.__dict__.update(asdict(wanted))
        for group, base_lr in zip(scheduler.optimizer.param_groups, scheduler.base_lrs):
            group["lr"] = base_lr * wanted(scheduler.last_epoch)
        notes.append(
            f"the learning-rate schedule changed (total {before.get('total_steps')} -> {plan.total_steps} steps): "
            "continuing on this config's schedule"
        )
    return notes
