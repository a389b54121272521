"""``hone train``: from a validated config to a trained adapter or model, in one function.

    output dir checks + config.yml -> tokenizer -> data -> model -> loop -> final/ -> report

:func:`run_training` is also the code path ``hone bench`` measures (``step_callback`` sees
every optimizer step), so a benchmark times exactly what users run. The tokenizer, data and
model modules are imported inside the function: this module imports (and its helpers are
testable) without them.

Under ``torchrun`` every process runs this function: it joins the process group
(:func:`~hone.train.distributed.init_world`), checks the launch before anything loads, and runs
each start-up phase :func:`~hone.train.distributed.together`, so one rank's failure stops every
rank with that rank's message. Rank 0 alone writes the run directory (config.yml,
optimizations.json, metrics, checkpoints, final outputs) and prints; it prepares the data first,
the others then read it from the cache.
"""

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from hone.atomic import atomic_write_text
from hone.config.root import HoneConfig
from hone.paths import ensure_writable_dir
from hone.run_files import CONFIG_FILE, FINAL_DIR, METRICS_FILE, PLOT_FILE, TENSORBOARD_DIR
from hone.runtime.world import World, world_from_env
from hone.track.report import format_report
from hone.track.trackers import abandon_trackers, start_trackers
from hone.train.allocator_watch import RetryWatch
from hone.train.checkpoint import resolve_resume
from hone.train.device import resolve_device
from hone.train.distributed import check_launch, close_world, device_of, init_world, together
from hone.train.loop import LoopResult, train_loop
from hone.train.rerun import OutputDirInUse, clear_run_dir, in_use_message, run_markers
from hone.train.seed import seed_everything
from hone.train.step_log import StepMetrics
from hone.transforms.allocator import configure_allocator
from hone.transforms.base import RunFacts, RunHooks
from hone.transforms.card import cap_process_memory
from hone.transforms.planner import Plan, plan_optimizations, write_record
from hone.transforms.watch import CompileWatch


@dataclass
class TrainResult:
    steps: int
    """Optimizer step reached (== ``total_steps`` unless interrupted)."""
    total_steps: int
    final_train_loss: float | None
    first_eval_loss: float | None
    """The baseline eval (step 0) when there is eval data."""
    last_eval_loss: float | None
    metrics_path: Path
    final_dir: Path | None
    """``<output_dir>/final``; None when the run was interrupted before the end."""
    skipped_steps: int
    interrupted: str | None
    """Signal name (``SIGINT``/``SIGTERM``) when stopped early; resume with ``training.resume``."""
    last_checkpoint: Path | None
    output_dir: Path
    wall_s: float
    """Wall time of the training loop in this process (eval and checkpoints included)."""
    tokens_per_s: float
    """Real input tokens per second of optimizer-step time."""


def prepare_output_dir(cfg: HoneConfig, warn: Callable[[str], None]) -> Path | None:
    """Check ``training.output_dir`` against ``training.resume``, create it and write the
    resolved config into it. Returns the checkpoint to resume from, if any.

    A directory that already holds a run is never trained into afresh (its metrics and
    checkpoints would be mixed with the new run's): the user resumes it, overwrites it
    (``training.overwrite_output_dir``, which clears it first) or picks another ``output_dir``
    (:mod:`hone.train.rerun`). The one exception: ``resume: latest`` on a run that died before
    its first checkpoint starts over, with a warning, since there is nothing to continue.
    """
    from hone.config.loader import dump_config
    from hone.config.recorded import recorded_config

    out = Path(cfg.training.output_dir)
    resume_from = resolve_resume(cfg.training, warn)
    if cfg.training.overwrite_output_dir:
        overwrite_output_dir(out, warn)
    if resume_from is None and out.is_dir():
        found = run_markers(out)
        restartable = cfg.training.resume == "latest" and FINAL_DIR not in found
        if found and not restartable:
            raise OutputDirInUse(in_use_message(out, found, cfg.training.max_steps))
        if found:
            warn(f"starting over in {out}: the previous run there left no checkpoint to resume from")
    ensure_writable_dir(out)  # a file, read-only or full disk: refused before data and model
    atomic_write_text(out / CONFIG_FILE, dump_config(recorded_config(cfg)))  # absolute paths: readable from anywhere
    return resume_from


def overwrite_output_dir(out: Path, say: Callable[[str], None]) -> None:
    """Clear the earlier run in ``out`` (``training.overwrite_output_dir``), saying what went;
    refuses a directory holding anything ``hone train`` does not write."""
    removed = clear_run_dir(out)
    if removed:
        say(f"overwriting {out}: removed the earlier run's {', '.join(removed)}")


def pad_token_id(tokenizer) -> int:
    """Padding id for collation; any id works (padding is masked), the pad token is tidiest."""
    for attr in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, attr, None)
        if value is not None:
            return int(value)
    return 0


def run_training(
    cfg: HoneConfig,
    *,
    device: torch.device | str | None = None,
    console: Console | None = None,
    step_callback: Callable[[StepMetrics], None] | None = None,
    save_outputs: bool = True,
) -> TrainResult:
    """Train the model of ``cfg`` on its data; outputs go to ``cfg.training.output_dir``.

    Launched by ``torchrun`` (``WORLD_SIZE`` set), this process is one rank of a data-parallel
    run: ``device`` is then its local GPU (or the CPU, with ``device="cpu"``).

    ``save_outputs=False`` writes neither checkpoints nor the final adapter or model (``hone
    bench`` times steps; a 30B full fine-tune would write 240 GB of both)."""
    # the allocator's settings are read when CUDA initialises: before anything touches the GPU
    configure_allocator(
        cfg, torch.device(device).type if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    )
    device = resolve_device(device)
    world = world_from_env()
    check_launch(cfg, world, device.type)  # more processes than GPUs, strategy none: before anything loads
    world = init_world(device.type, cpu_collectives=cfg.distributed.cpu_offload)
    trackers: list = []  # W&B / MLflow, started on rank 0 before the data and the model
    try:
        return _run_training(
            cfg,
            world,
            device_of(world, device.type) if world.distributed else device,
            console,
            step_callback,
            trackers,
            save_outputs=save_outputs,
        )
    except BaseException:
        abandon_trackers(trackers)  # those the loop did not close: a start-up failure
        raise
    finally:
        close_world()


def _run_training(
    cfg: HoneConfig,
    world: World,
    device: torch.device,
    console: Console | None,
    step_callback: Callable[[StepMetrics], None] | None,
    trackers: list,
    *,
    save_outputs: bool = True,
) -> TrainResult:
    from hone.train.checkpoint_io import checkpoint_io_for

    console = console or Console()
    if not world.is_main:
        console = Console(quiet=True)  # rank 0 speaks for the run
    out = Path(cfg.training.output_dir)
    warn = _Warn(console)
    _cap_memory(cfg, device, console)
    resume_from, tokenizer, data, facts, plan = _data_and_plan(cfg, world, device, console, warn, trackers)
    loaded, hooks = _model(cfg, world, device, tokenizer, plan, facts, console)
    console.print(plan.describe(), highlight=False, markup=False, soft_wrap=True)
    for line in plan.auto_choices(cfg):
        console.print(f"  {line}", highlight=False, markup=False, soft_wrap=True)
    if world.is_main:
        write_record(out, plan)
    watch = CompileWatch(warn).start() if plan.decided.compile else None
    record = _PlanRecord(out, plan, watch, world)
    try:
        loop = train_loop(
            loaded.model,
            data.train,
            data.eval,
            cfg,
            device=device,
            pad_id=pad_token_id(tokenizer),
            console=console,
            step_callback=_OnStep(console, watch, step_callback, RetryWatch(warn)),
            resume_from=resume_from,
            autocast_dtype=getattr(loaded, "autocast_dtype", None),
            hooks=hooks,
            world=world,
            trackers=trackers,
            before_trackers_close=record.write,
            save_checkpoints=save_outputs,
        )
    finally:
        record.write()  # where the loop failed before it could
    if watch is not None:
        console.print(_compile_summary(watch.summary()), highlight=False, markup=False, soft_wrap=True)

    final_dir = None
    if save_outputs and not loop.interrupted:
        writer = checkpoint_io_for(hooks, world)
        final_dir = Path(writer.save_final(loaded.model, tokenizer, out / FINAL_DIR, cfg.adapter))
    result = _result(loop, out, final_dir)
    console.print(_report(loop, result), highlight=False, markup=False, soft_wrap=True)
    return result


class _Warn:
    """``warn(message)``: a warning on stderr (the run's console quieted or not, as the run's is),
    so that it stays apart from the progress a user pipes or greps."""

    def __init__(self, console: Console):
        self.console = Console(stderr=True, quiet=console.quiet)

    def __call__(self, message: str) -> None:
        self.console.print(f"warning: {message}", highlight=False, markup=False, soft_wrap=True)


def _data_and_plan(
    cfg: HoneConfig, world: World, device: torch.device, console: Console, warn: Callable[[str], None], trackers: list
) -> tuple[Path | None, Any, Any, RunFacts, Plan]:
    """Start-up, phase 1: the run directory, the data and the plan (rank 0 first: it fills the
    data cache). Returns the checkpoint to resume from, the tokenizer, the data, the run's facts
    and its plan (which refuses what this run cannot do before the model loads)."""
    from hone.data.prepare import prepare_data
    from hone.models.hub import download_missing
    from hone.models.tokenizer import load_tokenizer

    resume_from = None
    with together(world):
        if world.is_main:
            resume_from = prepare_output_dir(cfg, warn)
            download_missing(cfg.model, say=lambda m: console.print(m, highlight=False, markup=False, soft_wrap=True))
            trackers += start_trackers(cfg, warn)  # a tracker that cannot start stops the run here
            tokenizer = load_tokenizer(cfg.model)
            data = prepare_data(cfg, tokenizer)
    resume_from = _from_rank_zero(world, resume_from)
    facts = None
    with together(world):
        if not world.is_main:
            tokenizer = load_tokenizer(cfg.model)
            data = prepare_data(cfg, tokenizer)
        console.print(_data_summary(data), highlight=False, markup=False, soft_wrap=True)
        memory = cfg.memory.gpu_memory_bytes if device.type == "cuda" else None
        facts = RunFacts(device=device, world=world, memory_bytes=memory, **data_facts(cfg, data.stats))
        plan = plan_optimizations(cfg, facts)  # refuses what this run cannot do before the model loads
        if world.distributed:  # the global batch must fit the data before every GPU loads a model
            check_split(cfg, data, world)
    if cfg.memory.alias_note:
        console.print(f"note: {cfg.memory.alias_note}", highlight=False, markup=False, soft_wrap=True)
    return resume_from, tokenizer, data, facts, plan


def _model(
    cfg: HoneConfig, world: World, device: torch.device, tokenizer: Any, plan: Plan, facts: RunFacts, console: Console
) -> tuple[Any, RunHooks]:
    """Start-up, phase 2: the model, through the plan (the data-parallel wrap happens in the
    loop); returns it loaded, and the plan's hooks for the loop."""
    from hone.models.loader import load_model

    sharded_load = plan.shards_parameters and cfg.model.path is not None
    with together(world):
        seed_everything(cfg.training.seed)  # new modules (LoRA) draw their initial weights from it
        if sharded_load:  # built on the meta device, sharded, then each rank reads only its rows
            from hone.models.sharded_load import load_model_sharded

            loaded = load_model_sharded(
                cfg,
                tokenizer,
                device,
                shard=lambda model: plan.apply(model, "adapted", cfg, facts),
                before_adapter=lambda base: plan.apply(base, "base", cfg, facts),
            )
        else:
            loaded = load_model(
                cfg,
                tokenizer,
                device,
                before_adapter=lambda base: plan.apply(base, "base", cfg, facts),
                as_drawn=plan.as_drawn(cfg, facts),
            )
    console.print(f"model: {loaded.description}", highlight=False, markup=False, soft_wrap=True)
    console.print(
        f"trainable parameters: {loaded.trainable_params:,} of {loaded.total_params:,} "
        f"({100 * loaded.trainable_params / max(loaded.total_params, 1):.2f}%) on {device}",
        highlight=False,
        markup=False,
        soft_wrap=True,
    )
    with together(world):
        if not sharded_load:  # the sharded loader applied the adapted stage before any weight existed
            plan.apply(loaded.model, "adapted", cfg, facts)
        hooks = plan.hooks(loaded.model, cfg, facts)
    return loaded, hooks


class _OnStep:
    """The loop's step callback in ``hone train``: the cold start's time said once (compilation,
    autotuning, allocator growth), the compile watch and the allocator's retry watch told of
    every step, then the caller's."""

    def __init__(
        self,
        console: Console,
        watch: CompileWatch | None,
        step_callback: Callable[[StepMetrics], None] | None,
        retries: RetryWatch | None = None,
    ):
        self.console = console
        self.watch = watch
        self.step_callback = step_callback
        self.retries = retries
        self.first = True

    def __call__(self, metrics: StepMetrics) -> None:
        if self.first:
            self.first = False
            note = " (compilation included)" if self.watch is not None else ""
            self.console.print(f"first step: {metrics.step_time_s:.1f} s{note}", highlight=False, markup=False)
        if self.watch is not None:
            self.watch.on_step(metrics.step, metrics.step_time_s)
        if self.retries is not None:
            self.retries.on_step(metrics.step, metrics.alloc_retries, metrics.peak_reserved_gib)
        if self.step_callback is not None:
            self.step_callback(metrics)


class _PlanRecord:
    """Stops counting compilations and writes the final ``optimizations.json``, once: before the
    loop closes the trackers (so they get the whole record), or after a loop that failed first."""

    def __init__(self, out: Path, plan: Plan, watch: CompileWatch | None, world: World):
        self.out = out
        self.plan = plan
        self.watch = watch
        self.world = world
        self.written = False

    def write(self) -> None:
        if self.written:
            return
        self.written = True
        if self.watch is not None:
            self.watch.stop()
        if self.world.is_main:  # again: what the data-parallel wrap and the compiler recorded
            write_record(self.out, self.plan, self.watch.summary() if self.watch is not None else None)


def check_split(cfg: HoneConfig, data, world: World) -> None:
    """Refuse (:class:`~hone.train.batches.NotEnoughData`) training data that cannot fill one
    optimizer step of the run's data-parallel replicas (``world.world_size`` processes, or the
    ``world_size / N`` groups of context parallelism), before the model loads."""
    from hone.data.packing import packing_for
    from hone.train.batches import plan_steps

    packing = packing_for(data.train, cfg, "train")
    replicas = world.data_parallel(cfg.distributed.context_parallel)[1]
    plan_steps(packing.num_bins if packing is not None else len(data.train), cfg.training, replicas)


def _from_rank_zero(world: World, value):
    """Rank 0's ``value`` on every rank (the checkpoint it resolved to resume from)."""
    if not world.distributed:
        return value
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _cap_memory(cfg: HoneConfig, device: torch.device, console: Console) -> None:
    """``memory.gpu_memory``: this process's allocations held to the card size the plan is made
    for, before the model loads (a note where the device is not a GPU)."""
    limit = cfg.memory.gpu_memory_bytes
    if limit is not None and device.type != "cuda":
        console.print(f"note: memory.gpu_memory applies to CUDA devices; unused on {device.type}", highlight=False, markup=False)
        return
    done = cap_process_memory(limit, device)
    if done:
        console.print(done, highlight=False, markup=False, soft_wrap=True)


def data_facts(cfg: HoneConfig, stats) -> dict:
    """What the plan takes from the prepared data's statistics (:class:`RunFacts` fields): whether
    every micro-batch has one shape, and the preference splits' pair lengths."""
    note = shape_note(cfg, stats)
    return {
        "shape_note": note,
        "lengths_vary": note is not None,  # packed rows are one shape (shape_note)
        "pair_splits": tuple(s for s in (stats.train, stats.eval) if s is not None and s.pairs),
    }


def shape_note(cfg: HoneConfig, stats) -> str | None:
    """None when every training micro-batch has one shape; otherwise why not (for the planner:
    CUDA graphs need a single shape)."""
    if cfg.data.sample_packing:  # rows are sequence_len wide; the documents in them move, but wherever the plan
        return None  # records graphs their boundaries take one count (RunHooks.fixed_boundaries, PackedBatches)
    if cfg.training.is_preference:  # one row per micro-batch, as wide as its pairs (a multiple of pairs.ALIGN)
        if cfg.performance.cudagraphs_setting:  # ... or all alike, for the graphs (FixedPairRows)
            return None
        return "preference pairs are packed into one row per micro-batch, as wide as its pairs' sequences"
    if cfg.data.pad_to_sequence_len:  # every row padded to sequence_len
        return None
    train = getattr(stats, "train", None)
    if train is not None and train.min_length != train.max_length:
        return (
            f"the training rows are {train.min_length} to {train.max_length} tokens long and each "
            "micro-batch is padded to its longest row; data.sample_packing or data.pad_to_sequence_len "
            "gives every micro-batch one shape"
        )
    return None


def _compile_summary(stats: dict) -> str:
    text = (
        f"torch.compile: {stats['forward_graphs']} forward and {stats['backward_graphs']} backward graph(s) compiled "
        f"for training, {stats['eval_graphs']} for eval; {stats['recompiles']} recompile(s), "
        f"{stats['compiles_after_first_step']} after the first step"
    )
    return text if stats.get("counted", True) else "torch.compile: compilations not counted (this torch has no compile callbacks)"


def _data_summary(data) -> str:
    try:
        from hone.data.summary import render_summary

        return render_summary(data)
    except ImportError:
        return f"data: {len(data.train)} train rows, {len(data.eval) if data.eval is not None else 0} eval rows"


def _result(loop: LoopResult, out: Path, final_dir: Path | None) -> TrainResult:
    evals = loop.eval_losses
    return TrainResult(
        steps=loop.steps,
        total_steps=loop.total_steps,
        final_train_loss=loop.final_loss,
        first_eval_loss=evals[0][1] if evals else None,
        last_eval_loss=evals[-1][1] if evals else None,
        metrics_path=loop.metrics_path,
        final_dir=final_dir,
        skipped_steps=loop.skipped_steps,
        interrupted=loop.interrupted,
        last_checkpoint=loop.last_checkpoint,
        output_dir=out,
        wall_s=loop.wall_s,
        tokens_per_s=loop.tokens / loop.elapsed_s if loop.elapsed_s > 0 else 0.0,
    )


def _report(loop: LoopResult, result: TrainResult) -> str:
    out = result.output_dir
    extras = [p for p in (out / METRICS_FILE, out / PLOT_FILE, out / TENSORBOARD_DIR, out / CONFIG_FILE) if p.exists()]
    return format_report(
        steps=loop.steps,
        total_steps=loop.total_steps,
        start_step=loop.start_step,
        elapsed_s=loop.elapsed_s,
        wall_s=loop.wall_s,
        tokens=loop.tokens,
        trained_tokens=loop.trained_tokens,
        final_loss=loop.final_loss,
        eval_losses=loop.eval_losses,
        skipped_steps=loop.skipped_steps,
        interrupted=loop.interrupted,
        output_dir=out,
        final_dir=result.final_dir,
        last_checkpoint=loop.last_checkpoint,
        extra_outputs=extras,
    )
