"""The set-up of a training run: from a ready model, its data and the plan's hooks to every
object the loop works with (:class:`Trainer`).

In order: the output directory, the loss scaler (float16 is refused on the CPU here), the
micro-batches (bins packed once, in :mod:`hone.data`), the step plan, the seed, the optimizer and
its schedule with the plan's after-step actions registered on it, the restored checkpoint when
resuming (its RNG state restored last, before anything draws from it), the data stream from the
restored position, the per-micro-batch module (DDP: the weights broadcast from rank 0), the
trackers, then the components that decide their own cadence: the step log, the evaluator and
the checkpointer.
"""

from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from torch import nn

from hone.config.loader import dump_config
from hone.config.recorded import recorded_config
from hone.config.root import HoneConfig
from hone.data.packing import packing_for
from hone.models.experts.parallel import expert_parallel_groups, expert_parallel_params
from hone.runtime.pair_loss import metric_names
from hone.runtime.world import World
from hone.track.tracker import Tracker
from hone.train.batches import Batches, BatchStream, StepPlan, micro_batches, plan_steps
from hone.train.checkpoint_io import checkpoint_io_for
from hone.train.checkpointer import Checkpointer
from hone.train.evaluate import Evaluator
from hone.train.optim import build_optimizer, build_scheduler
from hone.train.resume import Resumed, resume
from hone.train.seed import seed_everything
from hone.train.state import TrainState
from hone.train.step_log import StepLog
from hone.train.train_step import StepParts, loss_scaler
from hone.transforms.base import RunHooks


@dataclass
class Trainer:
    """Everything the loop works with, built once by :func:`set_up`."""

    plan: StepPlan
    state: TrainState
    start_step: int  # 0, or the step resumed from
    resumed_from: Path | None
    batches: Batches
    stream: BatchStream
    parts: StepParts
    device: torch.device
    world: World
    tracker: Tracker
    log: StepLog
    evaluator: Evaluator
    checkpointer: Checkpointer
    max_consecutive_nonfinite: int


def set_up(
    model: nn.Module,
    train_data,
    eval_data,
    cfg: HoneConfig,
    *,
    device: torch.device,
    pad_id: int,
    hooks: RunHooks,
    world: World,
    console: Console,
    resume_from: Path | None,
    autocast_dtype: torch.dtype | None,
    trackers: list | None,
    save_checkpoints: bool = True,
) -> Trainer:
    """Build the run's objects (see the module's docstring for the order, which matters).
    ``save_checkpoints=False``: no checkpoint is written (the bench times steps only)."""
    t = cfg.training
    output_dir = Path(t.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    has_eval = eval_data is not None and len(eval_data) > 0
    scaler = loss_scaler(cfg, device)
    batches = _train_batches(train_data, cfg, pad_id, hooks)
    replica, replicas = world.data_parallel(cfg.distributed.context_parallel)  # context parallel groups share batches
    plan = plan_steps(batches.units, t, replicas)
    seed_everything(t.seed)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(model, cfg.optimizer, device)
    scheduler = build_scheduler(optimizer, cfg.optimizer, plan.total_steps)
    hooks.register_after_step(optimizer)  # they run when (and only when) the optimizer updates
    checkpointer = Checkpointer(
        checkpoint_io_for(hooks, world),
        output_dir,
        t,
        plan,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=scaler,
        enabled=save_checkpoints,
    )
    resumed = resume(checkpointer, resume_from, plan, cfg, scheduler, world) if resume_from is not None else None
    if resumed is not None:
        # the weights were loaded in place: derive again what a transform derives from them after each
        # step (float8 scales). Loading a sharded optimizer steps it once with zero gradients to create
        # its state (torch's set_state_dict), which ran the hooks on the weights the checkpoint replaced.
        hooks.after_optimizer_step()
    state = resumed.state if resumed is not None else TrainState()
    stream = BatchStream(plan, t.seed, state.position, rank=replica)
    step_module = hooks.step_module(model, autocast_dtype)  # DDP: the weights broadcast from rank 0
    eval_reference = None
    if cfg.preference_reference == "precomputed":  # DPO/IPO of a full fine-tune: before the first step
        eval_reference = _precomputed_reference(
            cfg, model, step_module.module, hooks, batches, eval_data, pad_id, device, world, resumed
        )
    tracker = _tracker(cfg, world, console, plan, resumed, trackers)
    evaluator = Evaluator(
        model,
        eval_data,
        t,
        plan,
        tracker,
        pad_id=pad_id,
        device=device,
        autocast_dtype=autocast_dtype,
        packing=packing_for(eval_data, cfg, "eval") if has_eval else None,
        hooks=hooks,
        world=world,
        step=step_module.module,
        reference=eval_reference,
        pad_to=cfg.data.fixed_width,
    )
    _announce(tracker, batches, len(train_data), plan, resumed, resume_from)
    experts = (expert_parallel_params(model), *expert_parallel_groups(model))  # blocks, their group and replicas
    return Trainer(
        plan=plan,
        state=state,
        start_step=state.step,
        resumed_from=resume_from,
        batches=batches,
        stream=stream,
        parts=StepParts(
            step_module, hooks, optimizer, scheduler, scaler, params, t.max_grad_norm, *experts, step_metric_names(t.objective)
        ),
        device=device,
        world=world,
        tracker=tracker,
        log=StepLog(tracker, cfg.logging.logging_steps, state),
        evaluator=evaluator,
        checkpointer=checkpointer,
        max_consecutive_nonfinite=t.max_consecutive_nonfinite,
    )


def _announce(tracker, batches, train_rows: int, plan, resumed, resume_from: Path | None) -> None:
    """The run's opening lines: how the rows were packed, the step plan, where it resumed."""
    if batches.packing is not None:
        tracker.print(f"sample packing: {batches.packing.describe(train_rows)}")
    tracker.print(f"training: {plan.describe()}")
    if resumed is not None:
        step = resumed.state.step
        tracker.print(f"resumed from {resume_from} at step {step} (epoch {plan.epoch_at(step):.2f})")
        for note in resumed.notes:
            tracker.print(f"note: {note}")


def _train_batches(train_data, cfg: HoneConfig, pad_id: int, hooks: RunHooks):
    """The training split's micro-batch builder: packed where ``data.sample_packing`` packs, pairs
    with their prompts shared where the plan's attention layout takes them."""
    packing = packing_for(train_data, cfg, "train")
    return micro_batches(
        train_data,
        packing,
        pad_id,
        cfg.training.objective,
        share_prompt=hooks.layout.shares_prompt,
        fixed_pairs=hooks.fixed_pairs,
        fixed_boundaries=cfg.training.micro_batch_size if hooks.fixed_boundaries else None,
        pad_to=cfg.data.fixed_width,
    )


def _precomputed_reference(cfg, model, module, hooks, batches, eval_data, pad_id, device, world, resumed):
    """The reference log-probs of every pair with the initial weights (read back on resume):
    attached to the training batches; returns the eval split's (:mod:`hone.train.reference`)."""
    from hone.train.reference import prepare_reference

    return prepare_reference(
        model,
        module,
        hooks,
        batches,
        eval_data,
        output_dir=Path(cfg.training.output_dir),
        batch_size=cfg.training.micro_batch_size,
        pad_id=pad_id,
        objective=cfg.training.objective,
        device=device,
        world=world,
        resuming=resumed is not None,
    )


def step_metric_names(objective: str) -> tuple[str | None, ...]:
    """The names of a step's values after its loss (:func:`hone.runtime.pair_loss.window_values`:
    the NLL mean, logged by ORPO only, then the metrics); none for SFT."""
    if objective == "sft":
        return ()
    return ("nll_loss" if objective == "orpo" else None, *metric_names(objective))


def _tracker(
    cfg: HoneConfig, world: World, console: Console, plan: StepPlan, resumed: Resumed | None, trackers: list | None
) -> Tracker:
    """The run's tracker (rank 0 writes; the others only count). ``trackers``: W&B / MLflow
    already started (``hone train`` starts them before the model loads); without them rank 0
    starts those of ``logging.trackers`` here."""
    if trackers is None and world.is_main:
        from hone.track.trackers import start_trackers

        warn = Console(stderr=True, quiet=console.quiet)  # warnings on stderr, as in `hone train`'s start
        trackers = start_trackers(cfg, lambda m: warn.print(f"warning: {m}", highlight=False, markup=False))
    return Tracker(
        cfg.logging,
        Path(cfg.training.output_dir),
        console,
        total_steps=plan.total_steps,
        resume_step=resumed.state.step if resumed is not None else None,
        history=resumed.history if resumed is not None else None,
        enabled=world.is_main,
        external=trackers,
        run_config=dump_config(recorded_config(cfg)) if world.is_main else None,
    )
