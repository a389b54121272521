"""Expert parallelism as a transform: each rank keeps ``E / N`` of every MoE layer's experts.

``distributed.expert_parallel: N`` (N > 1, on N processes: all ranks form one group) splits
the routed experts of every experts module into N contiguous blocks, one per rank
(:func:`hone.models.experts.parallel.shard_experts`), on the base model before the adapter, so
PEFT's expert LoRA creates factors for the local experts only. hone's experts forward then
sends each token to the ranks holding its experts and back
(:mod:`hone.parallel.expert_parallel`), with buffers sized for the largest micro-batch
(``micro_batch_size x sequence_len`` tokens, ``k`` slots each): by default no pair can overflow
and no rank waits on the host; with ``distributed.expert_capacity_factor`` the buffers shrink to
about that multiple of the balanced share, and the pairs over capacity, counted on the device,
are checked once per micro-batch (an overflow stops the run on every rank). The split experts
stay out of DDP (their gradients already sum every rank's tokens) and the gradient norm adds
their squares over the ranks (:func:`hone.train.grad_norm.global_grad_norm`); every other
weight stays under DDP's SUM, or is sharded by FSDP2 (``distributed.strategy: fsdp``, which
leaves the blocks out: :mod:`hone.transforms.fsdp`).

Refused here (the config's validators refuse the rest): a model without MoE layers, a number of
experts that N does not divide, an MXFP4 checkpoint, tiled MLP or tiled layers (each rank would
run as many pieces of a layer as its own tokens make, and the exchanges need them in step).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

from hone.models.experts.backend import is_experts_module
from hone.models.experts.parallel import shard_experts, shard_module, take_overflow
from hone.models.materialize import Replace
from hone.parallel.expert_parallel import ExpertCapacityError, ExpertShard, check_overflow, expert_capacity
from hone.runtime.step import StepContext
from hone.transforms.base import PlanContext, Transform
from hone.transforms.memory.facts import model_facts, mxfp4_experts


def _size(ctx: PlanContext) -> int:
    return ctx.cfg.distributed.expert_parallel


def _check(ctx: PlanContext) -> list[str]:
    """What the model must be: read on the meta device (:func:`model_facts`), before it loads."""
    n = _size(ctx)
    key = f"distributed.expert_parallel: {n}"
    mxfp4 = mxfp4_experts(ctx.cfg)
    if mxfp4 is not None:
        return [f"{key} does not split MXFP4 experts yet ({mxfp4}): use distributed.expert_parallel: 1"]
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
    yield  # capacity T * k: no pair can overflow


def _factor(ctx: PlanContext) -> float | None:
    return ctx.cfg.distributed.expert_capacity_factor


def _capacity(ctx: PlanContext) -> int | None:
    """Slots per pair of ranks under ``expert_capacity_factor``; None: ``T * k``, no overflow."""
    factor = _factor(ctx)
    if factor is None:
        return None
    return expert_capacity(_max_tokens(ctx), model_facts(ctx.cfg).top_k, _size(ctx), factor)


def _apply(model: nn.Module, ctx: PlanContext) -> dict[str, Any]:
    world, capacity, max_tokens = ctx.facts.world, _capacity(ctx), _max_tokens(ctx)
    modules = shard_experts(model, world.world_size, world.rank, max_tokens, capacity)
    rule = "T * k: no pair can overflow" if capacity is None else f"factor {_factor(ctx)}: overflow stops the run"
    return {"ranks": world.world_size, "experts_modules": modules, "max_tokens": max_tokens, "capacity": capacity, "rule": rule}


def _step_context(model: nn.Module, ctx: PlanContext) -> StepContext:
    """With a capacity factor: after each micro-batch's forward and backward, the pairs over
    capacity summed over the layers and the ranks (one sync per micro-batch, none per layer); any
    stops the run on every rank together (:func:`~hone.parallel.expert_parallel.check_overflow`)."""
    world, capacity = ctx.facts.world, _capacity(ctx)
    shard = ExpertShard(world.world_size, world.rank, model_facts(ctx.cfg).experts)

    @contextmanager
    def checked(batch: object) -> Iterator[None]:
        yield
        overflow = take_overflow(model)
        if overflow is None:
            return
        try:
            check_overflow(overflow, capacity or 0, shard)
        except ExpertCapacityError as exc:
            raise ExpertCapacityError(f"distributed.expert_capacity_factor: {_factor(ctx)}: {exc}") from None

    return checked


def _as_drawn(skeleton: nn.Module, ctx: PlanContext) -> Replace:
    """A big preset drawn on the device: each experts module keeps its block as soon as it is
    drawn, so no rank holds every expert of the model at once (``_apply`` then finds them split)."""
    world, capacity = ctx.facts.world, _capacity(ctx)

    def keep_block(module: nn.Module) -> None:
        if is_experts_module(module):
            shard_module(module, world.world_size, world.rank, _max_tokens(ctx), capacity)
        return None  # split in place: the module stays

    return keep_block


EXPERT_PARALLEL = Transform(
    name="expert_parallel",
    switch="distributed.expert_parallel",
    wanted=lambda ctx: _size(ctx) > 1 and ctx.facts.world.distributed,
    why=lambda ctx: (
        f"distributed.expert_parallel: {_size(ctx)}: each rank holds 1/{_size(ctx)} of every MoE layer's experts; "
        "tokens travel to them and back (two all-to-all exchanges per layer)"
    ),
    check=_check,
    stage="base",
    model=_apply,
    as_drawn=_as_drawn,
    step_context=lambda model, ctx: _step_context(model, ctx) if _factor(ctx) is not None else _no_check,
    label=lambda d: f"expert parallel ({d['ranks']} ranks, {d['experts_modules']} MoE layers)" if d else "expert parallel",
)
