"""Data parallelism over the processes ``torchrun`` started: the strategy, and DDP as a transform.

Which strategy a run uses (:func:`resolve_strategy`) is decided once, before the model loads:

- a world of one process: none (nothing to share);
- ``distributed.strategy: ddp`` / ``fsdp``: as written; ``none`` on several processes is refused
  (:func:`hone.train.distributed.check_launch`);
- ``auto`` on several processes: FSDP2 when the training state (weights, gradients, AdamW moments,
  from :mod:`hone.transforms.memory` on the meta device) does not fit one device, DDP otherwise.
  Where the estimate cannot be made (an unusual model), DDP, and the plan says so.
- ``auto`` with ``distributed.expert_parallel: N``: the same rule, with the experts counted at
  ``E / N`` (what a rank holds whichever strategy runs beside expert parallelism): what DDP would
  replicate is everything outside the experts plus the rank's own block. A LoRA run, or a full
  fine-tune of a MoE whose shared part is small, keeps DDP (no all-gather per layer, replicas of
  a small state); a full fine-tune whose replicated state does not fit (qwen3-30b-a3b: ~1.5B
  weights outside the experts, with gradients and moments, beside 7B of experts per rank on 4
  GPUs) shards that part with FSDP2 instead, the experts staying plain tensors.

DDP here is PyTorch's ``DistributedDataParallel`` around the loop's per-micro-batch module
(:class:`hone.runtime.step.StepModule`). Why DDP rather than FSDP2's ``replicate``: DDP is the
stable public API, its bucketed all-reduce overlaps the backward, and its communication hook is
the documented place to choose the reduction; ``replicate`` is the composable route FSDP2 runs
on, but its API is still private in torch 2.x. Two choices make the math exact:

- **Sum, not mean.** Every rank divides its token-loss sum by the *global* token count of the
  window (all-reduced before the first backward), so the gradient of the whole step is the sum of
  the ranks' gradients. DDP averages by default; a communication hook (:func:`sum_gradients`)
  all-reduces with SUM instead, so nothing is rescaled and fp32 results match one process.
- **One reduction per optimizer step.** Gradient accumulation runs all but the window's last
  micro-batch under ``no_sync`` (:attr:`StepModule.no_sync`), so gradients are reduced once.

After the reduction every rank holds the same full gradients, so the clipping norm computed
locally is the global one and every rank takes the same skip/step decision. Under expert
parallelism the split experts (and their LoRA factors) stay out of DDP: their gradients already
sum every rank's tokens of the expert-parallel group (and the step sums them over the block's
replicas where the group is a part of the job: :mod:`hone.parallel.groups`), and
:func:`hone.train.grad_norm.global_grad_norm` adds their squares over the group.

As a transform (:data:`DDP`) it comes last in the plan, beside FSDP2: it wraps the final modules.
"""

import inspect
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hone.config.root import HoneConfig
from hone.models.experts.mxfp4 import mxfp4_state_names
from hone.models.experts.parallel import expert_parallel_names
from hone.runtime.step import StepModule
from hone.transforms.base import PlanContext, RunFacts, Transform
from hone.transforms.memory.decide import loss_of
from hone.transforms.memory.estimate import estimate_memory
from hone.transforms.memory.knobs import Knobs
from hone.units import gib

#: The margin a training state must leave on the device for activations, the loss and the
#: allocator before ``auto`` keeps whole replicas (DDP) rather than sharding (FSDP2).
FIT_FRACTION = 0.8


def resolve_strategy(cfg: HoneConfig, facts: RunFacts, expert_parallel: int | None = None) -> tuple[str, str]:
    """(strategy, why): ``none`` on one process, else ``ddp`` or ``fsdp`` (``none`` as written on
    several processes, which the launch check refuses). ``expert_parallel``: the plan's decided
    size (None: as the config writes it, ``auto`` counting as 1)."""
    world = facts.world
    chosen = cfg.distributed.strategy
    if expert_parallel is None:
        written = cfg.distributed.expert_parallel
        expert_parallel = written if isinstance(written, int) else 1
    elif cfg.distributed.expert_parallel != expert_parallel:  # the estimate below reads the size from the config
        cfg = cfg.model_copy(update={"distributed": cfg.distributed.model_copy(update={"expert_parallel": expert_parallel})})
    if not world.distributed:
        return "none", "one process: no data parallelism"
    if chosen != "auto":
        return chosen, f"distributed.strategy: {chosen} ({world.world_size} processes)"
    state = training_state_bytes(cfg, facts.device.type)
    if state is None:
        return "ddp", (
            f"distributed.strategy: auto on {world.world_size} processes: DDP (the training state of this "
            "model could not be estimated; set distributed.strategy: fsdp if it does not fit one device)"
        )
    budget = device_budget(facts)
    held = f", experts split over {expert_parallel} ranks by distributed.expert_parallel" if expert_parallel > 1 else ""
    if budget is not None and state > FIT_FRACTION * budget:
        return "fsdp", (
            f"distributed.strategy: auto on {world.world_size} processes: FSDP2, the training state "
            f"(weights, gradients, optimizer{held}) of {gib(state)} does not fit {FIT_FRACTION:.0%} of one "
            f"device's {gib(budget)}"
        )
    room = f" fits {FIT_FRACTION:.0%} of one device's {gib(budget)}" if budget is not None else " is held by every rank"
    return "ddp", (
        f"distributed.strategy: auto on {world.world_size} processes: DDP, the training state "
        f"(weights, gradients, optimizer{held}) of {gib(state)}{room}"
    )


def training_state_bytes(cfg: HoneConfig, device_type: str) -> int | None:
    """Weights + gradients + AdamW moments of ``cfg``'s run on one device, unsharded (under
    expert parallelism: the rank's block of the experts and all the rest; meta-device estimate);
    None when the model cannot be built on the meta device."""
    try:
        est = estimate_memory(cfg, Knobs("full", loss_of(cfg), device=device_type))
    except Exception:  # noqa: BLE001 -- any failure to estimate means "unknown", never a refusal
        return None
    return est.weights + est.trainable_state + est.optimizer


def device_budget(facts: RunFacts) -> int | None:
    """The bytes of one device the training state is compared with (None: CPU processes, which share the host)."""
    if facts.memory_bytes is not None:
        return facts.memory_bytes
    if facts.device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(facts.device).total_memory
    return None  # CPU processes share the host's memory: DDP


def sum_gradients(process_group: dist.ProcessGroup | None, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: all-reduce a gradient bucket with SUM (DDP's default divides by
    the world size; hone's losses are already normalised by the global token count)."""
    work = dist.all_reduce(bucket.buffer(), op=dist.ReduceOp.SUM, group=process_group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


class WholeLayerGraphs(nn.Module):
    """DDP around regionally compiled layers, with Dynamo's DDP optimizer off while it runs.

    The DDP optimizer (``torch._dynamo.config.optimize_ddp``, on by default) splits every graph
    compiled inside DDP's forward at DDP's bucket boundaries, so that a *whole-model* graph's
    backward releases each bucket's gradients early. A decoder layer's graph needs no split: its
    backward already ends before the previous layer's starts, so the all-reduce of one layer's
    bucket overlaps the next layer's backward. The split also broke compiling on torch 2.11: an
    expert-parallel layer with hone's grouped kernels (CPU, Triton's interpreter) raised
    ``'float' object has no attribute 'meta'`` on its first piece. (On H100s the same layer's
    Inductor error, ``list indices must be integers or slices, not NoneType``, first seen on the
    second piece, stayed without the split: its cause was the expert-parallel send plan, now an
    opaque op, see :func:`hone.parallel.expert_parallel.plan_send`.) The switch is Dynamo's
    documented one, set only around this module's calls."""

    def __init__(self, ddp: nn.Module) -> None:
        super().__init__()
        self.ddp = ddp

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with torch._dynamo.config.patch(optimize_ddp=False):
            return self.ddp(*args, **kwargs)


def wrap_ddp(step: StepModule, split_graphs: bool = True) -> StepModule:
    """Wrap the per-micro-batch module in ``DistributedDataParallel`` (weights broadcast from
    rank 0 at construction, so every replica starts identical; MXFP4 experts are left out of the
    broadcast, see :func:`hone.models.experts.mxfp4.mxfp4_state_names`, and expert-parallel
    blocks out of the broadcast and the all-reduce, see :mod:`hone.models.experts.parallel`).
    ``split_graphs=False``: the layers are compiled one by one (:class:`WholeLayerGraphs`)."""
    from torch.nn.parallel import DistributedDataParallel

    module: nn.Module = step.module
    # no buffer broadcast before each forward: a causal LM has no running statistics and its RoPE
    # tables are the same on every rank (torch >= 2.13 names the switch forward_sync_buffers)
    takes = inspect.signature(DistributedDataParallel.__init__).parameters
    buffers = {"forward_sync_buffers": False} if "forward_sync_buffers" in takes else {"broadcast_buffers": False}
    # MXFP4 experts are frozen; expert-parallel ones differ per rank and their gradients already
    # sum every rank's tokens: neither may be broadcast or all-reduced
    frozen = mxfp4_state_names(module) + expert_parallel_names(module)
    if frozen:  # torch's documented hook for tensors DDP must leave alone (set before construction)
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, frozen)
    ddp = DistributedDataParallel(
        module,
        device_ids=None,  # the module is already on this rank's device; micro-batches are too
        find_unused_parameters=False,  # every trainable weight gets a gradient every micro-batch
        # gradients live in the all-reduce buckets: no copy into and out of them each step, and
        # one gradient's memory instead of two (the grad norm, clipping and optimizer read views)
        gradient_as_bucket_view=True,
        **buffers,
    )
    if "forward_sync_buffers" not in takes:
        broadcast_buffers_once(module, set(frozen), ddp.process_group)
    ddp.register_comm_hook(state=None, hook=sum_gradients)
    return StepModule(ddp if split_graphs else WholeLayerGraphs(ddp), no_sync=ddp.no_sync)


def broadcast_buffers_once(module: nn.Module, ignored: set[str], group: dist.ProcessGroup) -> None:
    """Rank 0's buffers on every rank, once, as torch >= 2.13's DDP does at construction: before
    2.13, ``broadcast_buffers=False`` (no sync before each forward) also skips the one at
    construction, and a buffer that differs per rank (a float8 copy of a weight quantized before
    the weights were broadcast) would stay different."""
    for name, buffer in module.named_buffers():
        if name not in ignored:
            dist.broadcast(buffer, src=dist.get_global_rank(group, 0), group=group)


def _wrap_step(step: StepModule, ctx: PlanContext) -> tuple[StepModule, dict[str, Any]]:
    regional = ctx.decided.compile and ctx.cfg.performance.torch_compile_scope == "regional"
    wrapped = wrap_ddp(step, split_graphs=not regional)
    details = {
        "why": ctx.decided.strategy_why,
        "processes": ctx.facts.world.world_size,
        "backend": dist.get_backend(),
        "reduction": "sum of gradients (comm hook); losses divided by the global token count",
        "accumulation": "no_sync on all but the window's last micro-batch",
        "compiled_graphs": "one per layer (Dynamo's DDP optimizer off)" if regional else "split at DDP's buckets where compiled",
    }
    return wrapped, details


def _skipped(ctx: PlanContext) -> str | None:
    if ctx.facts.world.distributed and ctx.decided.strategy != "ddp":
        return ctx.decided.strategy_why
    return None


def _check(ctx: PlanContext) -> list[str]:
    if not dist.is_available():
        return ["distributed.strategy: ddp needs torch.distributed, which this PyTorch build lacks"]
    return []


DDP = Transform(
    name="ddp",
    switch="distributed.strategy",
    wanted=lambda ctx: ctx.decided.strategy == "ddp",
    why=lambda ctx: ctx.decided.strategy_why,
    check=_check,
    skipped_because=_skipped,
    wrap_step=_wrap_step,
    label=lambda d: f"ddp ({d['processes']} processes, {d['backend']})" if "processes" in d else "ddp",
)
