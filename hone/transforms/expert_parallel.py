"""Expert parallelism as a transform: each rank keeps ``E / N`` of every MoE layer's experts.

``distributed.expert_parallel: N`` (N > 1, on W processes, N dividing W) splits the routed
experts of every experts module into N contiguous blocks, one per rank of an expert-parallel
group (all ranks where N = W; else W / N groups of N consecutive ranks, the ranks at the same
place in each holding the same block, whose gradients are summed over them once per step:
:mod:`hone.parallel.groups`; FSDP2 beside it shards the rest over all W ranks)
(:func:`hone.models.experts.parallel.shard_experts`), on the base model before the adapter, so
PEFT's expert LoRA creates factors for the local experts only. hone's experts forward then
sends each token to the ranks holding its experts and back
(:mod:`hone.parallel.expert_parallel`), with buffers sized for the largest micro-batch
(``micro_batch_size x sequence_len`` token slots per pair of ranks: a token travels at most once
to each rank, so the exchanges never overflow and no rank waits on the host); the local experts'
pair rows are the worst case by default (nothing can overflow), or, with
``distributed.expert_capacity_factor``, about that multiple of the balanced share, and the pairs
over capacity, counted on the device, are checked once per micro-batch (an overflow stops the
run on every rank). The split experts
stay out of DDP (their gradients already sum every rank's tokens) and the gradient norm adds
their squares over the ranks (:func:`hone.train.grad_norm.global_grad_norm`); every other
weight stays under DDP's SUM, or is sharded by FSDP2 (``distributed.strategy: fsdp``, which
leaves the blocks out: :mod:`hone.transforms.fsdp`).

Refused here (the config's validators refuse the rest): a model without MoE layers, a number of
experts that N does not divide, tiled MLP or tiled layers (each rank would run as many pieces of
a layer as its own tokens make, and the exchanges need them in step). MXFP4 experts (an MXFP4
checkpoint, ``model.quantize: mxfp4``) split like bf16 ones: each rank keeps its block of the
blocks and scales (a big preset's as each module is drawn and quantized), and its local experts
run through the grouped MXFP4 kernels.

``distributed.expert_parallel: auto`` (:func:`expert_parallel_choice`) is 1 on one process. On
``W`` processes it is ``W`` where expert parallelism can run (MoE layers hone's experts forward
computes, ``W`` dividing the experts, no tiling asked for, a strategy of auto or ddp)
*and* where it is needed: the replicated training state (weights, gradients, AdamW moments) does
not fit one device by the rule ``distributed.strategy: auto`` uses to leave DDP for FSDP2, while
the state of one rank with the experts split does. Elsewhere 1: where replicas fit, DDP alone
measured 1.9x on 2 H100 and expert parallelism would add two all-to-all exchanges per MoE layer
each way; where even the split state does not fit, FSDP2 alone shards every weight (``auto`` does
not weigh expert parallelism beside FSDP2, which runs where the config asks for both:
``expert_parallel: N`` with ``strategy: fsdp``). If the plan then has to tile the MLP or the layers to fit
the activations, ``auto`` falls back to 1 as well (:func:`hone.transforms.decide.decide`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

from hone.config.root import HoneConfig
from hone.models.experts.backend import is_experts_module
from hone.models.experts.parallel import shard_experts, shard_module, take_overflow
from hone.models.materialize import Replace
from hone.parallel.expert_parallel import ExpertCapacityError, ExpertShard, check_overflow, expert_capacity
from hone.parallel.groups import ExpertGroups, expert_groups
from hone.runtime.step import StepContext
from hone.transforms.base import PlanContext, RunFacts, Transform
from hone.transforms.data_parallel import FIT_FRACTION, device_budget, training_state_bytes
from hone.transforms.memory.facts import model_facts
from hone.units import gib

AUTO = "distributed.expert_parallel: auto"


def with_expert_parallel(cfg: HoneConfig, size: int) -> HoneConfig:
    """``cfg`` as the plan runs it: ``distributed.expert_parallel`` set to the decided ``size``
    (``cfg`` itself where it already says so). The memory estimates read the size from the
    config; the user's file and the run's record keep what was written."""
    if cfg.distributed.expert_parallel == size:
        return cfg
    return cfg.model_copy(update={"distributed": cfg.distributed.model_copy(update={"expert_parallel": size})})


#: Why ``auto`` leaves tiling off under expert parallelism (:func:`untiled_per_rank`).
TILING_HELD_OFF = "expert parallelism does not run with it yet (every rank takes part in each layer's exchange)"


def untiled_per_rank(cfg: HoneConfig) -> HoneConfig:
    """``cfg`` as the ``auto`` memory decisions see it under expert parallelism (``cfg`` as the
    plan runs it, the size decided): a tiled MLP and tiled layers off where they are ``auto``, so
    ``auto`` never picks what :func:`_tiling_problems` then refuses (a run that needs them does not
    fit, and says so); an explicit count stays, and is refused."""
    memory = cfg.memory
    update = {key: "off" for key in ("tiled_mlp", "tiled_layers") if getattr(memory, key) == "auto"}
    if cfg.distributed.expert_parallel == 1 or not update:
        return cfg
    return cfg.model_copy(update={"memory": memory.model_copy(update=update)})


def expert_parallel_choice(cfg: HoneConfig, facts: RunFacts) -> tuple[int, str]:
    """(size, why) of ``distributed.expert_parallel`` on this run: as written, or ``auto``'s rule
    (the module doc)."""
    asked = cfg.distributed.expert_parallel
    if asked != "auto":
        return asked, f"distributed.expert_parallel: {asked}"
    world = facts.world.world_size
    refused = _cannot_split(cfg, world)
    if refused is not None:
        return 1, f"{AUTO}: 1, {refused}"
    replicated, budget = training_state_bytes(cfg, facts.device.type), device_budget(facts)
    if replicated is None:
        return 1, f"{AUTO}: 1, the training state of this model could not be estimated"
    if budget is None or replicated <= FIT_FRACTION * budget:
        room = f"fits {FIT_FRACTION:.0%} of one device's {gib(budget)}" if budget is not None else "is held by every rank"
        return 1, (
            f"{AUTO}: 1, the replicated training state of {gib(replicated)} {room}: DDP alone, without "
            "two all-to-all exchanges per MoE layer each way"
        )
    split = training_state_bytes(with_expert_parallel(cfg, world), facts.device.type)
    if split is None or split > FIT_FRACTION * budget:
        per_rank = f"{gib(split)} per rank" if split is not None else "an unknown state per rank"
        return 1, (
            f"{AUTO}: 1, the training state of {gib(replicated)} does not fit {FIT_FRACTION:.0%} of one device's "
            f"{gib(budget)}, nor with the experts split over {world} ranks ({per_rank}): FSDP2 shards every weight"
        )
    return world, (
        f"{AUTO}: {world}, the replicated training state of {gib(replicated)} does not fit {FIT_FRACTION:.0%} of one "
        f"device's {gib(budget)}; with the experts split over {world} ranks each holds {gib(split)}"
    )


def _cannot_split(cfg: HoneConfig, world: int) -> str | None:
    """Why ``auto`` cannot split this run's experts over ``world`` processes (None: it can)."""
    if world == 1:
        return "one process"
    if cfg.distributed.context_parallel > 1:
        return f"distributed.context_parallel: {cfg.distributed.context_parallel} (not combined with expert parallelism yet)"
    if cfg.distributed.strategy in ("fsdp", "none"):
        return (
            f"distributed.strategy: {cfg.distributed.strategy} (auto splits the experts beside DDP only; "
            "beside FSDP2 write distributed.expert_parallel: N)"
        )
    if cfg.model.experts_implementation in ("eager", "grouped_mm"):
        return f"model.experts_implementation: {cfg.model.experts_implementation} (the exchange is in hone's experts forward)"
    for key in ("tiled_mlp", "tiled_layers"):
        if getattr(cfg.memory, key) not in ("auto", "off"):
            return f"memory.{key}: {getattr(cfg.memory, key)} (every rank must take part in each layer's exchange)"
    try:
        facts = model_facts(cfg)
    except Exception as exc:  # noqa: BLE001 -- auto falls back; the reason goes on record
        return f"the model could not be read ({type(exc).__name__}: {exc})"
    if not any(layer.moe for layer in facts.layers) or facts.experts < 1:
        return f"{facts.architecture} has no mixture-of-experts layers"
    if facts.experts_layout_problems:
        return f"hone's experts forward cannot run {facts.experts_layout_problems[0]}"
    if facts.experts % world:
        return f"{facts.architecture}'s {facts.experts} experts per layer do not split evenly over {world} processes"
    return None


def _size(ctx: PlanContext) -> int:
    return ctx.decided.expert_parallel


def _check(ctx: PlanContext) -> list[str]:
    """What the model must be: read on the meta device (:func:`model_facts`), before it loads."""
    n = _size(ctx)
    key = f"distributed.expert_parallel: {n}"
    problems = _tiling_problems(ctx, key)
    facts = model_facts(ctx.cfg)
    if not any(layer.moe for layer in facts.layers) or facts.experts < 1:
        return [*problems, f"{key} splits the experts of mixture-of-experts layers, and {facts.architecture} has none"]
    if facts.experts % n:
        problems.append(
            f"{key}: {facts.architecture} has {facts.experts} experts per layer, which {n} ranks cannot split evenly: "
            f"use a divisor of {facts.experts}"
        )
    return problems


def _tiling_problems(ctx: PlanContext, key: str) -> list[str]:
    """Tiled MLP and tiled layers run each layer on pieces of the tokens whose number follows the
    rank's own micro-batch; expert parallelism needs every rank in the same exchange (not yet)."""
    d, problems = ctx.decided, []
    if d.tiled_mlp_shards > 0:
        problems.append(
            f"{key} does not run with memory.tiled_mlp yet ({d.tiled_mlp_why}): every rank must take part in each "
            "layer's exchange, and the tiled shards follow each rank's tokens; set memory.tiled_mlp: off"
        )
    if d.tiled_layers_chunks >= 2:
        problems.append(
            f"{key} does not run with memory.tiled_layers yet ({d.tiled_layers_why}): every rank must take part in each "
            "layer's exchange; set memory.tiled_layers: off"
        )
    return problems


def _max_tokens(ctx: PlanContext) -> int:
    """The most tokens one forward routes on a rank: every rank sizes its exchange from it."""
    return ctx.cfg.training.micro_batch_size * ctx.cfg.data.sequence_len


@contextmanager
def _no_check(batch: object) -> Iterator[None]:
    yield  # the worst-case capacity: no pair can overflow


def _factor(ctx: PlanContext) -> float | None:
    return ctx.cfg.distributed.expert_capacity_factor


def _capacity(ctx: PlanContext) -> int | None:
    """A rank's expert pair rows under ``expert_capacity_factor``; None: the worst case, no overflow."""
    factor = _factor(ctx)
    if factor is None:
        return None
    facts = model_facts(ctx.cfg)
    return expert_capacity(_max_tokens(ctx), facts.top_k, _size(ctx), factor, facts.experts // _size(ctx))


def _chunks(ctx: PlanContext) -> int:
    """The token chunks each layer's exchanges run in (``expert_parallel_chunks``; ``auto``: 1)."""
    chunks = ctx.cfg.distributed.expert_parallel_chunks
    return 1 if chunks == "auto" else chunks


def _recompute(ctx: PlanContext) -> bool:
    """Whether the local experts run again in the backward (``expert_parallel_recompute``)."""
    return ctx.cfg.distributed.expert_parallel_recompute


def _groups(ctx: PlanContext) -> ExpertGroups:
    """This rank's groups: every rank of the job where ``N`` is the world size (the default
    group), else its ``N`` consecutive ranks and its block's replicas (created once)."""
    world, n = ctx.facts.world, _size(ctx)
    if n == world.world_size:
        return ExpertGroups(n, n, world.rank)
    return expert_groups(n)


def _apply(model: nn.Module, ctx: PlanContext) -> dict[str, Any]:
    groups, capacity, max_tokens = _groups(ctx), _capacity(ctx), _max_tokens(ctx)
    modules = shard_experts(model, groups.size, groups.rank, max_tokens, capacity, groups, _chunks(ctx), _recompute(ctx))
    rule = "worst case: no pair can overflow" if capacity is None else f"factor {_factor(ctx)}: overflow stops the run"
    details = {"ranks": groups.size, "experts_modules": modules, "max_tokens": max_tokens, "capacity": capacity, "rule": rule}
    details["chunks"] = _chunks(ctx)
    if _recompute(ctx):
        details["recompute"] = "the local experts, in the backward"
    if groups.replica_count > 1:
        details["replicas"] = f"{groups.replica_count} (expert gradients summed over them once per step)"
    return details


def _step_context(model: nn.Module, ctx: PlanContext) -> StepContext:
    """With a capacity factor: after each micro-batch's forward and backward (before the
    optimizer step), the most pairs over capacity of one layer on one rank (one sync per
    micro-batch, none per layer); any stops the run on every rank together
    (:func:`~hone.parallel.expert_parallel.check_overflow`), saying what share of pairs that
    layer received and how to continue from the last checkpoint with a larger factor."""
    groups, capacity = _groups(ctx), _capacity(ctx)
    facts = model_facts(ctx.cfg)
    # over every rank (the default group), replicas too: any rank's overflow stops all of them together
    shard = ExpertShard(groups.size, groups.rank, facts.experts)
    # chunks split the capacity, so one count no longer says what a layer received
    share = _max_tokens(ctx) * facts.top_k if _chunks(ctx) == 1 else None

    @contextmanager
    def checked(batch: object) -> Iterator[None]:
        yield
        overflow = take_overflow(model)
        if overflow is None:
            return
        try:
            check_overflow(overflow, capacity or 0, shard, share)
        except ExpertCapacityError as exc:
            raise ExpertCapacityError(f"distributed.expert_capacity_factor: {_factor(ctx)}: {exc}. {_CONTINUE}") from None

    return checked


#: What to do after an overflow: the step it stopped was not taken, and nothing saved depends on the factor.
_CONTINUE = (
    "The step was not taken. A checkpoint does not depend on the capacity factor: continue from the last one "
    "with a larger factor (--set distributed.expert_capacity_factor=F --set training.resume=latest, F above the "
    "share named here with room for the router's variation; or unset: the worst case)"
)


def _as_drawn(skeleton: nn.Module, ctx: PlanContext) -> Replace:
    """A big preset drawn on the device: each experts module keeps its block as soon as it is
    drawn (with ``model.quantize: mxfp4``, after the quantize transform's hook made it MXFP4: the
    block of its blocks and scales), so no rank holds every expert of the model at once
    (``_apply`` then finds them split)."""
    groups, capacity = _groups(ctx), _capacity(ctx)

    def keep_block(module: nn.Module) -> None:
        if is_experts_module(module):
            shard_module(module, groups.size, groups.rank, _max_tokens(ctx), capacity, groups, _chunks(ctx), _recompute(ctx))
        return None  # split in place: the module stays

    return keep_block


def _why(ctx: PlanContext) -> str:
    d = ctx.decided
    if d.expert_parallel <= 1:
        return d.expert_parallel_why
    joint = "; " if ctx.cfg.distributed.expert_parallel == "auto" else ": "
    world = ctx.facts.world.world_size
    replicas = (
        f"; {world // d.expert_parallel} replicas of each block (groups of {d.expert_parallel} consecutive ranks) "
        "sum its gradients once per step"
        if d.expert_parallel < world
        else ""
    )
    return (
        f"{d.expert_parallel_why}{joint}each rank holds 1/{d.expert_parallel} of every MoE layer's experts; "
        f"tokens travel to them and back (two all-to-all exchanges per layer){replicas}"
    )


def _skipped(ctx: PlanContext) -> str | None:
    """``auto`` on several processes that chose 1 says why (recorded as skipped)."""
    if ctx.cfg.distributed.expert_parallel == "auto" and ctx.facts.world.distributed and ctx.decided.expert_parallel == 1:
        return ctx.decided.expert_parallel_why
    return None


EXPERT_PARALLEL = Transform(
    name="expert_parallel",
    switch="distributed.expert_parallel",
    wanted=lambda ctx: _size(ctx) > 1 and ctx.facts.world.distributed,
    why=_why,
    check=_check,
    skipped_because=_skipped,
    stage="base",
    model=_apply,
    as_drawn=_as_drawn,
    step_context=lambda model, ctx: _step_context(model, ctx) if _factor(ctx) is not None else _no_check,
    label=lambda d: f"expert parallel ({d['ranks']} ranks, {d['experts_modules']} MoE layers)" if d else "expert parallel",
)
