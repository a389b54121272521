"""What a transform is: the seam every optimization plugs into.

A transform is a small, named unit switched on by one config key. It says what it needs from
the run (``check``, before any model loads), which other transforms it cannot be combined with,
and then acts through any of these hooks (all optional). Every hook reads the run through one
:class:`PlanContext`: the config, the run's facts and the plan's :class:`Decisions` (every
``auto`` setting, resolved once per plan), so no transform decides an ``auto`` setting itself:

- ``model`` -- change the model in place (pick an attention kernel, checkpoint layers, compile,
  shard) and return what it did, for ``optimizations.json``. ``stage`` says whether it runs on
  the base model before the adapter is attached or on the adapted model.
- ``loss`` -- supply the :data:`LossFn` of the run. Exactly one transform does (the loss
  transform: the standard one computes logits, a fused one never materialises them).
- ``attention_layout`` -- decide once, for the loaded model, how packed micro-batches reach the
  attention (document boundaries, hone's mask, or transformers' own handling); the micro-batch
  then carries it, so the loss and the loop know nothing about attention.
- ``step_context`` -- a context manager around each micro-batch's forward and backward
  (activation offload).
- ``micro_batch`` -- the part of each whole micro-batch this rank computes (context parallelism:
  its shard of the sequence), taken before the window's tokens are counted.
- ``after_optimizer_step`` -- e.g. float8 scale updates.
- ``wrap_step`` -- data parallelism (DDP; FSDP2's root): wrap the module the loop calls once per
  micro-batch (:class:`StepModule`), whose ``forward`` is the micro-batch's loss sum, and say how
  gradient accumulation skips the reduction for all but a window's last micro-batch.
- ``shards_parameters`` -- its ``model`` hook spreads the parameters over the ranks (FSDP2):
  the model may then be built on the meta device and loaded sharded, and every rank writes its
  shards of each checkpoint (Distributed Checkpoint) instead of rank 0 writing the ordinary files.

The planner (:mod:`hone.transforms.planner`) is the one place that orders and applies them;
code elsewhere reaches a transform only through the plan's :class:`RunHooks`, never by name.
"""

from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from hone.config.root import HoneConfig
from hone.data.collate import MicroBatch
from hone.runtime.step import LossFn, MicroBatchLoss, StepContext, StepModule
from hone.runtime.world import SINGLE, World

if TYPE_CHECKING:
    from hone.data.pairs import FixedPairRows
    from hone.models.attention.layout import AttentionLayout
    from hone.models.materialize import Replace

Stage = Literal["base", "adapted"]


@dataclass(frozen=True)
class RunFacts:
    """What the planner needs to know about the run beyond its config."""

    device: torch.device
    shape_note: str | None = None
    """None when every training micro-batch has one shape and layout; otherwise why not
    (rows of different lengths, each micro-batch padded to its longest). Packed rows count as one
    shape: where the plan records CUDA graphs their boundaries take one count (``fixed_boundaries``)."""
    lengths_vary: bool = False
    """Micro-batches are padded to different widths (unpacked rows of different lengths)."""
    pair_splits: tuple[Any, ...] = ()
    """Preference runs whose data has been read: the statistics of the splits the pair
    micro-batches come from (:class:`hone.data.stats.SplitStats`), which size the one layout
    they all take where the plan records CUDA graphs (:func:`hone.data.pairs.fixed_pair_rows`)."""
    shapes_known: bool = True
    """False where the data has not been read (``hone plan``): ``shape_note`` then says only what
    the config itself implies, and the run decides again from its data."""
    memory_bytes: int | None = None
    """The device memory to plan for (``hone plan --gpu-memory``); None: the device's own."""
    host_memory_bytes: int | None = None
    """The host memory to plan an ``offload`` split for (``hone plan --host-memory``); None:
    this machine's RAM."""
    world: World = SINGLE
    """The run's processes (a world of one unless launched by torchrun)."""


@dataclass(frozen=True)
class Decisions:
    """Every ``auto`` setting of one plan, resolved once from the config and the run's facts
    (:func:`hone.transforms.decide.decide`) before any transform is asked anything. Each
    transform's ``wanted``, ``why``, ``check`` and hooks read their setting here, so the run,
    ``hone plan`` and ``optimizations.json`` see one decision, made once."""

    strategy: str
    """Data parallelism: ``none`` (one process), ``ddp`` or ``fsdp``."""
    strategy_why: str
    param_shards: int
    """Processes FSDP2 shards the weights over (1 without FSDP2): the memory each card has left
    for activations, which the ``auto`` memory settings are decided on."""
    expandable_segments: bool
    """The CUDA allocator's expandable segments (``memory.expandable_segments``)."""
    allocator_why: str
    allocator_environment: str | None
    """What the environment already set for the allocator (left as it is), if anything."""
    compile: bool
    """``torch.compile`` of the model (``performance.torch_compile``; ``auto``: on CUDA)."""
    compile_why: str
    experts_implementation: str
    """The MoE experts implementation: ``hone``, ``grouped_mm`` or ``eager`` (``auto`` resolved)."""
    experts_why: str
    cuda_graphs: bool
    """Inductor's CUDA graphs around the compiled layers (:mod:`hone.transforms.cuda_graphs`)."""
    cuda_graphs_why: str
    checkpointing: str
    """The activation checkpointing policy in force: none, selective, full or offload."""
    checkpointing_why: str
    offload_layers: int | None
    """``offload``: how many decoder layers' inputs go to the host (None: all of them)."""
    offload_why: str | None
    """Why that split (``memory.offload_layers``); None unless the policy is ``offload``."""
    compiler_memory_budget: float | None
    """``selective`` on layers Inductor compiles is the compiler's activation memory budget (this
    fraction of the activations kept) instead of torch's selective checkpoint; None otherwise."""
    compiler_memory_budget_why: str | None
    """Why that budget (``memory.selective_memory_budget``); None when there is none."""
    tiled_mlp_shards: int
    """Shards of the tiled MLP; 0: untiled."""
    tiled_mlp_why: str
    tiled_mlp_skipped: str | None
    """Why ``tiled_mlp: auto`` left a run that does not fit untiled (recorded as skipped)."""
    tiled_layers_chunks: int
    """Chunks of each tiled decoder layer; 0: whole layers (a count below 2 tiles nothing)."""
    tiled_layers_why: str
    tiled_layers_skipped: str | None
    """Why ``tiled_layers: auto`` left the layers whole on a run that does not fit."""
    expert_parallel: int = 1
    """Ranks the experts of every MoE layer are split over (``distributed.expert_parallel``; 1: off)."""
    context_parallel: int = 1
    """Consecutive ranks each sequence is split over (``distributed.context_parallel``; 1: off)."""
    expert_parallel_why: str = "distributed.expert_parallel: 1"
    run_layers: int = 1
    """Layer-run checkpointing: one saved input per run of this many decoder layers (1: one per layer;
    ``memory.checkpoint_run_layers``; ``offload_layers`` then counts runs)."""
    run_layers_why: str = "memory.checkpoint_run_layers: 1"
    share_prompt: bool = False
    """Preference pairs compute each prompt once (``training.preference.share_prompt``)."""
    share_prompt_kernel: str | None = None
    """Through which attention: ``flex`` (a block mask) or ``mask`` (sdpa, a dense mask)."""
    share_prompt_why: str = "training.objective: sft trains no pairs"
    pair_sequence_len: int | None = None
    """A preference run whose pair statistics are known: each sequence's length as the memory
    decisions saw it, rows as wide as the data's pairs make them
    (:func:`hone.transforms.prompt_sharing.pair_rows_config`); None: ``data.sequence_len``."""
    fp8: str = "off"
    """The float8 scaling in force: ``off``, ``rowwise`` or ``tensorwise`` (``performance.fp8``;
    ``auto`` resolved by :func:`hone.transforms.fp8_sizes.fp8_scaling`)."""
    fp8_why: str = "performance.fp8: off"
    fp8_base_linears: str = "lora_targets"
    """With LoRA on a float8 base: ``lora_targets`` or ``all`` (``performance.fp8_base_linears``;
    ``auto`` resolved by :func:`hone.transforms.decide.decide`)."""
    fp8_base_linears_why: str | None = None
    """Why (None where no LoRA base is in float8)."""


@dataclass(frozen=True)
class PlanContext:
    """What every hook of a transform reads: the config, the run's facts and the plan's decisions."""

    cfg: HoneConfig
    facts: RunFacts
    decided: Decisions


def _no_problems(ctx: PlanContext) -> list[str]:
    return []


def _no_reason(ctx: PlanContext) -> str | None:
    return None


@dataclass(frozen=True)
class Transform:
    name: str
    switch: str
    """The config key that turns it on (what the user changes to turn it off)."""
    wanted: Callable[[PlanContext], bool]
    """Whether the config asks for it on this run (e.g. ``torch_compile: auto`` on CUDA)."""
    check: Callable[[PlanContext], list[str]] = _no_problems
    """Requirements on the run; each problem is one message naming the key and the fix."""
    conflicts: tuple[str, ...] = ()
    """Transforms it cannot be combined with (also refused at validation time)."""
    skipped_because: Callable[[PlanContext], str | None] = _no_reason
    """Why a transform the config mentions is not applied on this run, for the record."""
    stage: Stage = "adapted"
    """Whether ``model`` runs on the base model (before the adapter) or on the adapted one."""
    model: Callable[[nn.Module, PlanContext], dict[str, Any]] | None = None
    loss: Callable[[nn.Module, PlanContext], tuple[LossFn, dict[str, Any]]] | None = None
    """The run's loss function for the ready model, and what to record about it."""
    attention_layout: Callable[[nn.Module, PlanContext], "AttentionLayout"] | None = None
    step_context: Callable[[nn.Module, PlanContext], StepContext] | None = None
    after_optimizer_step: Callable[[nn.Module], None] | None = None
    micro_batch: Callable[[PlanContext], Callable[[MicroBatch, MicroBatch | None], MicroBatch]] | None = None
    """The part of each whole micro-batch this rank trains and evaluates (context parallelism: its
    shard of the sequence), applied once the batch carries its attention inputs and before its
    tokens are counted, so the global counts sum the ranks' parts."""
    wrap_step: Callable[[StepModule, PlanContext], tuple[StepModule, dict[str, Any]]] | None = None
    """Data parallelism: wrap the per-micro-batch module; returns it and what to record."""
    why: Callable[[PlanContext], str] | None = None
    """Why it is on for this config, in words (``hone plan``); default: its switch's value."""
    label: Callable[[dict[str, Any]], str] | None = None
    """The console text of the applied transform from its recorded details (default: the name)."""
    as_drawn: Callable[[nn.Module, PlanContext], "Replace"] | None = None
    """A base-stage transform's work done while a big preset is drawn one module at a time
    (:mod:`hone.models.materialize`): given the meta skeleton, the replacement of each module as
    soon as it is drawn (the quantized base: each linear becomes 4-bit before the next is drawn,
    so the full-precision model never exists whole). Its ``model`` hook then finds it done."""
    shards_parameters: bool = False
    """Its adapted-stage ``model`` hook spreads the parameters over the ranks (FSDP2): such a plan
    can be applied to a model built on the meta device, before its weights are read, so that no
    rank ever holds the whole model (:mod:`hone.models.sharded_load`)."""

    def describe(self, details: dict[str, Any]) -> str:
        return self.label(details) if self.label is not None else self.name


@dataclass
class RunHooks:
    """What the plan gives the training loop and the eval, once the model is ready."""

    loss_fn: LossFn
    layout: "AttentionLayout"
    step_contexts: list[StepContext] = field(default_factory=list)
    after_step: list[Callable[[], None]] = field(default_factory=list)
    step_wrappers: list[Callable[[StepModule], StepModule]] = field(default_factory=list)
    """The plan's ``wrap_step`` hooks, in plan order (applied by :meth:`step_module`)."""
    batch_parts: list[Callable[[MicroBatch, MicroBatch | None], MicroBatch]] = field(default_factory=list)
    """The plan's ``micro_batch`` hooks, in plan order (applied by :meth:`local_batch`)."""
    context_parallel: int = 1
    """Ranks each micro-batch is split over: the data is shared by ``world_size / context_parallel``
    replicas (:meth:`hone.runtime.world.World.data_parallel`)."""
    fixed_pairs: "FixedPairRows | None" = None
    """Preference runs under CUDA graphs: the one layout every pair micro-batch takes, so the
    compiled layers see one shape (:class:`hone.data.pairs.FixedPairRows`); None: each row is as
    wide as its pairs."""
    fixed_boundaries: bool = False
    """Packed runs under CUDA graphs: every packed micro-batch's boundaries count one number of
    segments (:class:`hone.train.batches.PackedBatches`), so the compiled layers see one shape."""
    sharded_checkpoints: bool = False
    """A transform shards the weights (FSDP2): every rank writes its shards of each checkpoint
    (Distributed Checkpoint); otherwise rank 0 writes the ordinary files
    (:func:`hone.train.checkpoint_io.checkpoint_io_for`)."""

    def step_module(self, model: nn.Module, autocast_dtype: torch.dtype | None = None) -> StepModule:
        """The module the loop calls per micro-batch: the model with this plan's loss, wrapped
        by the data-parallel transforms in plan order. Build it once per run (wrapping DDP
        broadcasts the weights from rank 0)."""
        step = StepModule(MicroBatchLoss(model, self.loss_fn, autocast_dtype))
        for wrap in self.step_wrappers:
            step = wrap(step)
        return step

    def local_batch(self, batch: MicroBatch, host: MicroBatch | None = None) -> MicroBatch:
        """The part of the whole micro-batch ``batch`` (attention inputs attached) this rank trains.
        ``host``: the same micro-batch before it was copied to the device, which counts read
        without waiting for the device."""
        for part in self.batch_parts:
            batch = part(batch, host)
            host = None  # a part changed the batch: the host copy no longer describes it
        return batch

    def step_context(self, batch: MicroBatch) -> ExitStack:
        """Every transform's context for one micro-batch's forward and backward, entered in plan order."""
        stack = ExitStack()
        for make in self.step_contexts:
            stack.enter_context(make(batch))
        return stack

    def after_optimizer_step(self) -> None:
        for hook in self.after_step:
            hook()

    def register_after_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Run :meth:`after_optimizer_step` after every ``optimizer.step()``, so the loop never
        calls it: only a step that updates the weights runs it (a skipped step never calls
        ``optimizer.step()``; float16's ``GradScaler.step`` calls it only for finite gradients)."""
        optimizer.register_step_post_hook(lambda opt, args, kwargs: self.after_optimizer_step())
