"""The optimization planner: which transforms a run applies, in which order, and the record.

Each optimization is a :class:`~hone.transforms.base.Transform` in its own module; this one
orders them (:data:`TRANSFORMS`, read top to bottom, as torchtitan's ``parallelize``), resolves
every ``auto`` setting once per plan (:func:`hone.transforms.decide.decide`), and applies and
records them. Combinations the config alone can rule out are refused earlier, by the config's
validators (``hone validate`` catches them); the checks here are the ones that need the run:
the device and the shapes of the prepared data.

The applied list is printed and written to ``optimizations.json`` in the run directory,
together with what was skipped and why, and the compile counts once training ends.
"""

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hone.atomic import atomic_write_text
from hone.config.root import HoneConfig
from hone.data.pairs import fixed_pair_rows
from hone.errors import HoneError
from hone.models.materialize import AsDrawn, Replace
from hone.run_files import OPTIMIZATIONS_FILE
from hone.runtime.step import StepModule
from hone.transforms.allocator import ALLOCATOR
from hone.transforms.attention import ATTENTION
from hone.transforms.base import Decisions, PlanContext, RunFacts, RunHooks, Stage, Transform
from hone.transforms.checkpointing import CHECKPOINTING
from hone.transforms.compile import COMPILE
from hone.transforms.context_parallel import CONTEXT_PARALLEL
from hone.transforms.data_parallel import DDP
from hone.transforms.decide import decide
from hone.transforms.expert_parallel import EXPERT_PARALLEL
from hone.transforms.experts import EXPERTS
from hone.transforms.fp8 import FP8
from hone.transforms.fsdp import FSDP
from hone.transforms.layer_runs import LAYER_RUNS
from hone.transforms.lora_linear import LORA_LINEAR
from hone.transforms.loss import LOSS
from hone.transforms.quantize import QUANTIZE
from hone.transforms.tiled_layers import TILED_LAYERS
from hone.transforms.tiled_mlp import TILED_MLP

__all__ = ["TRANSFORMS", "Applied", "Plan", "PlanError", "decisions", "plan_optimizations", "write_record"]

#: Every transform, in the order it is applied. A ``base`` transform acts on the model before the
#: adapter is attached, the others on the adapted model; within a stage, this order.
TRANSFORMS: tuple[Transform, ...] = (
    # records the CUDA allocator's setting, which run_training applies before CUDA starts; it
    # changes no module, so its place only orders the record
    ALLOCATOR,
    # base model: the attention kernel for this device and data, and how packed micro-batches
    # reach it (boundaries or hone's mask); first, so that everything after it traces the
    # attention the run will really use
    ATTENTION,
    # base model, model.quantize: nf4: every linear but the head swapped for a frozen 4-bit one,
    # one layer at a time onto the device; it swaps modules, so it comes before anything that
    # wraps or traces layers, and the adapter then wraps the 4-bit layers with LoRA
    QUANTIZE,
    # base model: the MoE experts implementation; before the adapter, which reads it to decide
    # whether expert LoRA runs inside hone's fused kernels
    EXPERTS,
    # base model, distributed.expert_parallel: each rank keeps its block of every MoE layer's
    # experts; after the experts backend (whose forward holds the exchange) and before the
    # adapter, so that PEFT's expert LoRA creates factors for the local experts only
    EXPERT_PARALLEL,
    # adapted model: float8 matmuls for the base's linears; it swaps module instances, so it comes
    # after the quantized base (a 4-bit base is not also float8) and before the tiled MLP,
    # checkpointing, compile and FSDP2, which wrap, trace and shard the swapped modules
    FP8,
    # adapted model: each PEFT LoRA linear instance replaced by hone's fused one, which reads its
    # base layer (bf16 or the float8 one just swapped in) at each call; before the tiled MLP,
    # checkpointing and compile, which wrap and trace the layers as they are
    LORA_LINEAR,
    # adapted model: each decoder layer's MLP computed in shards of tokens; it takes the
    # PEFT-wrapped projections as they are, and comes before checkpointing and compile, which wrap
    # and trace the layer with the tiled MLP inside (a checkpointed layer recomputes the tiled
    # forward; a compiled layer breaks its graph around it)
    TILED_MLP,
    # the loss function (the fused linear cross-entropy where it applies); it changes no module and
    # sits before compile, so that a compiled run compiles the standard loss along with the layers
    LOSS,
    # adapted model: recompute (or offload) each decoder layer's activations; transformers'
    # checkpointing wraps each layer's call, so the layer compiled next runs inside the checkpoint
    CHECKPOINTING,
    # adapted model: each decoder layer computed in chunks of the sequence; it is the layer's
    # checkpoint, so it comes after checkpointing (whose flag it switches off on the inner layer,
    # and whose offloader then moves the tiled layers' saved inputs) and before compile, which
    # compiles each tiled layer's inner layer, the code the chunks run
    TILED_LAYERS,
    # adapted model: one saved input per run of k decoder layers; it wraps whatever stands in the
    # decoder's list (the checkpointed or the tiled layer), whose saved input it recognises, so it
    # comes after both, and takes the offloader's hooks over; before compile, which compiles the
    # innermost layer (the wrapper stays eager: its bookkeeping is Python)
    LAYER_RUNS,
    # torch.compile of each decoder layer or of the whole decoder: it traces whatever modules it
    # finds, so everything that swaps modules or kernels goes before it
    COMPILE,
    # adapted model, distributed.context_parallel: each attention computes the whole sequence for
    # 1/N of the heads between two all-to-all exchanges (a backend registered with transformers
    # around the kernel chosen above); after compile, which traces the exchanges with the layers
    # when it first runs, and before DDP / FSDP2, which reduce the gradients over every rank
    CONTEXT_PARALLEL,
    # data parallelism over several processes, last: DistributedDataParallel wraps the module the
    # loop calls per micro-batch, which must hold the final modules. At most one of DDP and FSDP2.
    DDP,
    # FSDP2, last for the same reason: each decoder layer is compiled in place first, then sharded
    # (torchtitan's order), the checkpointing wrapper calls the sharded layer, and the
    # per-micro-batch module becomes the root unit
    FSDP,
)


class PlanError(HoneError):
    """The run cannot apply an optimization its config asks for."""


@dataclass
class Applied:
    name: str
    switch: str
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class Plan:
    """The transforms of one run, in order, its decisions, and what applying them did so far.

    ``apply`` and ``hooks`` take the config and the facts the plan was made from."""

    transforms: list[Transform]
    skipped: list[dict[str, str]]
    decided: Decisions
    """Every ``auto`` setting of the run, resolved once when the plan was made."""
    applied: list[Applied] = field(default_factory=list)

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.transforms]

    @property
    def shards_parameters(self) -> bool:
        """Whether a transform of this plan shards the weights (then the model is loaded sharded)."""
        return any(t.shards_parameters for t in self.transforms)

    def apply(self, model: nn.Module, stage: Stage, cfg: HoneConfig, facts: RunFacts) -> list[Applied]:
        """Run the ``model`` hooks of this ``stage``, in order; records and returns what they did."""
        ctx = PlanContext(cfg, facts, self.decided)
        done = []
        for transform in self.transforms:
            if transform.stage != stage:
                continue
            details = transform.model(model, ctx) if transform.model is not None else {}
            done.append(self._record(transform, details))
        return done

    def as_drawn(self, cfg: HoneConfig, facts: RunFacts) -> AsDrawn | None:
        """What the loader applies to each module of a big preset as it draws it (the base-stage
        transforms' ``as_drawn`` hooks, in plan order); None when no transform has one."""
        hooks = [t.as_drawn for t in self.transforms if t.as_drawn is not None and t.stage == "base"]
        if not hooks:
            return None
        ctx = PlanContext(cfg, facts, self.decided)

        def for_skeleton(skeleton: nn.Module) -> Replace:
            replaces = [hook(skeleton, ctx) for hook in hooks]

            def replace(module: nn.Module) -> nn.Module | None:
                current = module
                for each in replaces:
                    current = each(current) or current
                return None if current is module else current

            return replace

        return for_skeleton

    def hooks(self, model: nn.Module, cfg: HoneConfig, facts: RunFacts) -> RunHooks:
        """What the loop and the eval use of the plan, once ``model`` has been through it."""
        ctx = PlanContext(cfg, facts, self.decided)
        loss_fn = layout = fixed = None
        if self.decided.cuda_graphs and facts.pair_splits:  # one shape for the graphs: every pair row alike
            fixed = fixed_pair_rows(facts.pair_splits, cfg.training.micro_batch_size, self.decided.share_prompt)
        step_contexts, after_step, step_wrappers, batch_parts = [], [], [], []
        for transform in self.transforms:
            if transform.loss is not None:
                if loss_fn is not None:
                    raise PlanError(f"two transforms supply the loss ({transform.name} and an earlier one)")
                loss_fn, details = transform.loss(model, ctx)
                self._record(transform, details)
            if transform.attention_layout is not None:
                layout = transform.attention_layout(model, ctx)
                self._record(transform, {"packed_batches_carry": layout.kind})
                if fixed is not None:
                    self._record(transform, {"pair_rows": {"width": fixed.width, "keys": fixed.keys}})
            if transform.step_context is not None:
                step_contexts.append(transform.step_context(model, ctx))
            if transform.micro_batch is not None:
                batch_parts.append(transform.micro_batch(ctx))
            if transform.after_optimizer_step is not None:
                hook = transform.after_optimizer_step
                after_step.append(lambda hook=hook: hook(model))
            if transform.wrap_step is not None:  # applied in the loop; what is known now goes on record
                self._record(transform, _world_details(facts))
                step_wrappers.append(lambda step, t=transform: self._wrap(t, step, ctx))
        if loss_fn is None or layout is None:
            raise PlanError("the plan has no loss or no attention transform; hone's own TRANSFORMS always do")
        return RunHooks(
            loss_fn=loss_fn,
            layout=layout,
            step_contexts=step_contexts,
            after_step=after_step,
            step_wrappers=step_wrappers,
            sharded_checkpoints=self.shards_parameters,
            batch_parts=batch_parts,
            context_parallel=self.decided.context_parallel,
            fixed_pairs=fixed,
            fixed_boundaries=bool(self.decided.cuda_graphs and cfg.data.sample_packing),
        )

    def _wrap(self, transform: Transform, step: StepModule, ctx: PlanContext) -> StepModule:
        assert transform.wrap_step is not None
        wrapped, details = transform.wrap_step(step, ctx)
        self._record(transform, details)
        return wrapped

    def _record(self, transform: Transform, details: dict[str, Any]) -> Applied:
        for item in self.applied:
            if item.name == transform.name:
                item.details.update(details)
                return item
        item = Applied(transform.name, transform.switch, dict(details))
        self.applied.append(item)
        return item

    def in_order(self) -> list[Applied]:
        """The applied transforms in plan order (hooks run in stages, so not in that order)."""
        rank = {t.name: i for i, t in enumerate(self.transforms)}
        return sorted(self.applied, key=lambda a: rank.get(a.name, len(rank)))

    def auto_choices(self, cfg: HoneConfig) -> list[str]:
        """The speed and memory settings ``cfg`` leaves to ``auto``, each as decided with its
        reason (the run prints them at its start; ``hone plan`` shows the same reasons)."""
        d, perf, memory = self.decided, cfg.performance, cfg.memory
        lines = []
        if perf.torch_compile == "auto":
            lines.append(d.compile_why)
        if d.compile and perf.cudagraphs_setting is None:
            lines.append(d.cuda_graphs_why)
        if cfg.model.experts_implementation == "auto" and d.experts_implementation != "grouped_mm":
            lines.append(d.experts_why)
        if memory.checkpointing == "auto":
            lines.append(d.checkpointing_why)
        if memory.checkpoint_run_layers == "auto" and d.run_layers > 1:  # only where it is on: it is rare
            lines.append(d.run_layers_why)
        if memory.selective_memory_budget == "auto" and d.compiler_memory_budget_why is not None:
            lines.append(d.compiler_memory_budget_why)
        if cfg.distributed.expert_parallel == "auto":
            lines.append(d.expert_parallel_why)
        return lines

    def describe(self) -> str:
        """One console line: what was applied (and what the config mentions but this run skips)."""
        by_name = {t.name: t for t in self.transforms}
        parts = [by_name[a.name].describe(a.details) for a in self.in_order() if a.name in by_name]
        text = "optimizations: " + (", ".join(parts) if parts else "none")
        for skip in self.skipped:
            text += f"; skipped {skip['name']}: {skip['reason']}"
        return text


def _world_details(facts: RunFacts) -> dict[str, Any]:
    backend = dist.get_backend() if dist.is_available() and dist.is_initialized() else None
    return {"processes": facts.world.world_size, "backend": backend}


def plan_optimizations(
    cfg: HoneConfig, facts: RunFacts, transforms: tuple[Transform, ...] = TRANSFORMS, decided: Decisions | None = None
) -> Plan:
    """The transforms this run applies, in order; raises :class:`PlanError` with every problem
    (``decided``: the plan's decisions where the caller has them already)."""
    ctx = PlanContext(cfg, facts, decided if decided is not None else decide(cfg, facts))
    chosen, skipped, problems = [], [], []
    for transform in transforms:
        if not transform.wanted(ctx):
            reason = transform.skipped_because(ctx)
            if reason:
                skipped.append({"name": transform.name, "switch": transform.switch, "reason": reason})
            continue
        problems += transform.check(ctx)
        chosen.append(transform)
    if facts.world.distributed and not any(t.wrap_step is not None for t in chosen):
        problems.append(
            f"distributed.strategy: {cfg.distributed.strategy} resolves to {ctx.decided.strategy!r} on {facts.world.world_size} "
            f"processes ({ctx.decided.strategy_why}), and no transform of this hone provides it; allowed here: ddp"
        )
    names = {t.name for t in chosen}
    for transform in chosen:
        clash = sorted(names & set(transform.conflicts))
        if clash:
            problems.append(f"{transform.switch} ({transform.name}) cannot be combined with {', '.join(clash)}")
    if problems:
        raise PlanError("cannot apply the optimizations the config asks for:\n  - " + "\n  - ".join(problems))
    return Plan(chosen, skipped, ctx.decided)


def decisions(
    cfg: HoneConfig, facts: RunFacts, transforms: tuple[Transform, ...] = TRANSFORMS, decided: Decisions | None = None
) -> list[tuple[str, str, bool, str]]:
    """(name, switch, on, why) of every transform in plan order, without loading anything: what
    ``hone plan`` shows (``decided``: the plan's decisions where the caller has them already). A
    transform the run could not apply says so with the planner's reason."""
    ctx = PlanContext(cfg, facts, decided if decided is not None else decide(cfg, facts))
    lines = []
    for transform in transforms:
        if transform.wanted(ctx):
            problems = transform.check(ctx)
            why = transform.why(ctx) if transform.why is not None else f"{transform.switch} is on"
            if problems:
                why = "REFUSED: " + "; ".join(problems)
            lines.append((transform.name, transform.switch, True, why))
        else:
            why = transform.why(ctx) if transform.why is not None else f"{transform.switch} is off"
            reason = transform.skipped_because(ctx) or why
            lines.append((transform.name, transform.switch, False, reason))
    return lines


def write_record(out_dir: Path, plan: Plan, compile_stats: dict[str, Any] | None = None) -> Path:
    """``optimizations.json``: applied transforms in order, skipped ones, every ``auto`` setting as
    decided (with its reason), compile counts."""
    record: dict[str, Any] = {
        "applied": [asdict(a) for a in plan.in_order()],
        "skipped": plan.skipped,
        "decided": asdict(plan.decided),
        "torch": torch.__version__,
    }
    if compile_stats is not None:
        record["compile"] = compile_stats
    path = Path(out_dir) / OPTIMIZATIONS_FILE
    atomic_write_text(path, json.dumps(record, indent=2, default=str) + "\n")
    return path
