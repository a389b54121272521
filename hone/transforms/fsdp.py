"""FSDP2 as a transform: parameters, gradients and optimizer state sharded across the ranks.

PyTorch's own ``fully_shard`` (public API only), applied the way torchtitan's ``parallelize``
does: after everything that swaps or compiles modules (each decoder layer is compiled in place
first, then sharded), one FSDP unit per decoder layer, then the root unit.

The root unit. hone's loop never calls the causal LM's ``forward``: it runs the decoder, then
hands the last hidden states and the output head to the loss function (a fused loss reads
``head.weight`` without calling the head). FSDP2 all-gathers a unit's parameters in the
pre-forward hook of the module it wraps, so the root must be a module whose ``forward`` *is*
that step. :class:`ShardedLM` is that module: it holds the decoder and the head (the very
module objects of the model, so ``model.named_parameters()`` and PEFT see the sharded
parameters under their usual names) and its forward is hone's ``micro_batch_loss``. The loop
reaches it through the plan: the transform's ``wrap_step`` makes it the per-micro-batch module. Tied
embeddings (Qwen3, Gemma) are one parameter inside that unit: FSDP2 shards it once and both
the embedding and the head use the gathered copy. The root keeps its parameters gathered from
forward to backward (``reshard_after_forward=False``): the backward needs the head and the
embedding first thing, as in torchtitan.

Gradients are summed, not averaged. hone divides the loss by the trained tokens of the whole
accumulation window across all ranks, so the gradient of the step is the sum of the ranks'
gradients. FSDP2 averages by default; every unit gets ``set_gradient_divide_factor(1.0)`` and
``set_force_sum_reduction_for_comms(True)`` (a plain SUM reduce-scatter: NCCL's zero-copy path,
and the only reduction gloo has: a divide factor alone makes FSDP2 use ``PREMUL_SUM``, which
gloo refuses).

Mixed precision from ``model.dtype`` (:mod:`hone.models.precision`): ``param_dtype`` is the
compute dtype (bf16: the frozen bf16 base and the fp32 LoRA weights are gathered in bf16, which
is what autocast computes with on one GPU), ``reduce_dtype`` float32. float32 runs cast nothing.
float16 is refused (its loss scaling with sharded gradients is not wired).

Gradient accumulation: FSDP2 reduce-scatters after every micro-batch's backward (its default).
Skipping the sync for all but the last micro-batch (``set_requires_gradient_sync(False)``)
would keep every layer's *unsharded* gradient alive across the window, which for a full
fine-tune is the memory FSDP exists to save; the extra reduce-scatters overlap with compute.

Expert parallelism beside it (``distributed.expert_parallel: N``): each rank's block of the
experts (and the LoRA factors on it) is passed to every ``fully_shard`` as ``ignored_params``, so
those stay plain local tensors: not sharded, not gathered, their gradients not reduce-scattered
(they already sum every rank's tokens of the expert-parallel group, brought back by the exchange's
backward; a group smaller than the job sums them over the block's replicas once per step:
:mod:`hone.parallel.groups`). Everything else
(attention, router, norms, embeddings, head, the other LoRA factors) is sharded over all ranks as
without expert parallelism. What reads the mix: :func:`hone.train.grad_norm.global_grad_norm`
(the experts' squares summed over the ranks), :func:`hone.train.optim.param_groups` (DTensor and
plain weights in separate groups: torch's foreach and fused AdamW refuse a mix),
:mod:`hone.train.sharded_checkpoint` (the blocks saved as shards of the whole experts) and
:func:`hone.models.save.save_final_sharded` (the blocks gathered).

Composes with every activation checkpointing policy (transformers' checkpointing layer calls the
layer, FSDP2's hooks included, inside the checkpoint; FSDP2 recognises the recompute in the
backward and keeps the parameters gathered) and with regional compile (Dynamo leaves FSDP2's
hooks out of the compiled graph).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from hone.config.root import HoneConfig
from hone.errors import HoneError
from hone.models.experts.parallel import expert_parallel_params
from hone.models.precision import precision_for
from hone.models.structure import decoder_layers
from hone.runtime.step import LossFn, StepModule
from hone.transforms.base import PlanContext, RunFacts, Transform

if TYPE_CHECKING:
    from hone.data.collate import MicroBatch


class FsdpError(HoneError):
    """FSDP2 cannot shard this run the way its config asks."""


# ---------------------------------------------------------------- whether it can run


def fsdp_problems(cfg: HoneConfig, device_type: str, expert_parallel: int = 1) -> list[str]:
    """What FSDP2 cannot do on this run (on ``device_type``, the experts split over the plan's
    decided ``expert_parallel`` ranks: the config may say ``auto``), each naming the key and the fix."""
    problems = []
    if cfg.model.dtype == "float16":
        problems.append(
            "distributed.strategy: fsdp with model.dtype: float16 is not supported (float16 needs loss scaling "
            "over sharded gradients); use bfloat16"
        )
    if cfg.distributed.cpu_offload and device_type != "cuda":
        problems.append(f"distributed.cpu_offload: true offloads from a GPU; this run trains on {device_type}")
    if cfg.distributed.cpu_offload and expert_parallel > 1:
        problems.append(
            f"distributed.cpu_offload: true with distributed.expert_parallel: {expert_parallel} is not "
            "supported (the experts' blocks stay on the GPU, apart from FSDP2): set distributed.cpu_offload: false"
        )
    return problems


# ---------------------------------------------------------------- the root unit


class ShardedLM(nn.Module):
    """The FSDP2 root: decoder and output head of a causal LM, whose forward is one micro-batch's
    summed token loss (what :func:`hone.runtime.step.micro_batch_loss` computes unsharded)."""

    def __init__(self, decoder: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.decoder = decoder
        self.head = head

    def forward(self, batch: MicroBatch, loss_fn: LossFn, autocast_dtype: torch.dtype | None = None) -> torch.Tensor:
        from hone.runtime.step import decoder_head_loss

        return decoder_head_loss(self.decoder, self.head, batch, loss_fn, autocast_dtype)


#: model -> its root unit. Kept beside the model, not on it: nothing is added to a
#: transformers or PEFT object.
_ROOTS: weakref.WeakKeyDictionary[nn.Module, ShardedLM] = weakref.WeakKeyDictionary()


def sharded_root(model: nn.Module) -> ShardedLM | None:
    """The root unit FSDP2 drives ``model`` through, or None when it is not sharded."""
    return _ROOTS.get(model)


# ---------------------------------------------------------------- applying FSDP2


def mixed_precision(cfg: HoneConfig):
    """FSDP2's policy from ``model.dtype``: gather in the compute dtype, reduce in float32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    compute = precision_for(cfg.model.dtype, full_finetune=not cfg.adapter.is_lora).compute
    if compute == torch.float32:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)


def device_mesh(facts: RunFacts):
    """The 1-D mesh over every rank of the run (the process group must already exist)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(facts.device.type, (facts.world.world_size,))


def shard_model(
    model: nn.Module,
    mesh,
    *,
    mp_policy=None,
    reshard_after_forward: bool = True,
    cpu_offload: bool = False,
) -> ShardedLM:
    """``fully_shard`` each decoder layer, then the root (:class:`ShardedLM`); gradients summed.

    Works on a model whose parameters are on the meta device (the sharded loader materialises
    them afterwards with ``to_empty``). Expert-parallel blocks are left to their rank (module
    docstring)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    from hone.models.structure import causal_lm_parts

    layers = decoder_layers(model)
    if not layers:
        raise FsdpError(
            f"distributed.strategy: fsdp found no decoder layers in {type(model).__name__} (no module of a class "
            "listed in its _no_split_modules); use distributed.strategy: ddp"
        )
    kwargs: dict[str, Any] = {
        "mesh": mesh,
        "mp_policy": mp_policy or MixedPrecisionPolicy(),
        "offload_policy": CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy(),
    }
    own_experts = set(expert_parallel_params(model))
    if own_experts:  # expert parallel: each rank's block stays a plain local tensor
        kwargs["ignored_params"] = own_experts
    for layer in layers:
        fully_shard(layer, reshard_after_forward=reshard_after_forward, **kwargs)
    decoder, head = causal_lm_parts(model)
    root = ShardedLM(decoder, head)
    # the root's own inputs are a MicroBatch and a function: nothing for FSDP2 to cast
    root_mp = kwargs["mp_policy"]
    kwargs["mp_policy"] = MixedPrecisionPolicy(
        param_dtype=root_mp.param_dtype, reduce_dtype=root_mp.reduce_dtype, cast_forward_inputs=False
    )
    fully_shard(root, reshard_after_forward=False, **kwargs)
    for module in list(root.modules()):
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    _ROOTS[model] = root
    return root


def apply_fsdp(model: nn.Module, cfg: HoneConfig, facts: RunFacts, why: str) -> dict[str, Any]:
    """Shard ``model`` over the run's ranks (unless the sharded loader already did, on the meta
    device); returns what it did, for ``optimizations.json`` (``why``: the strategy's reason)."""
    dist_cfg = cfg.distributed
    policy = mixed_precision(cfg)
    if sharded_root(model) is None:  # the sharded loader may have sharded it on the meta device
        shard_model(
            model,
            device_mesh(facts),
            mp_policy=policy,
            reshard_after_forward=dist_cfg.reshard_after_forward,
            cpu_offload=dist_cfg.cpu_offload,
        )
    return {
        "world_size": facts.world.world_size,
        "units": _units(model),
        "expert_blocks_apart": len(expert_parallel_params(model)),
        "reshard_after_forward": dist_cfg.reshard_after_forward,
        "cpu_offload": dist_cfg.cpu_offload,
        "param_dtype": str(policy.param_dtype).removeprefix("torch.") if policy.param_dtype else "as stored",
        "reduce_dtype": str(policy.reduce_dtype).removeprefix("torch.") if policy.reduce_dtype else "as stored",
        "gradients": "summed across ranks (loss normalised by the global token count)",
        "why": why,
    }


def _units(model: nn.Module) -> int:
    """FSDP units of the sharded model (its layers and the root; the layers' classes are FSDP2's
    subclasses by now, so they are counted as such rather than by their model's layer class)."""
    from torch.distributed.fsdp import FSDPModule

    root = sharded_root(model)
    return sum(isinstance(m, FSDPModule) for m in (root.modules() if root is not None else model.modules()))


def fsdp_label(details: dict[str, Any]) -> str:
    return (
        f"FSDP2 ({details['world_size']} ranks, {details['units']} units, {details['param_dtype']} gather, "
        f"{details['reduce_dtype']} reduce{', cpu offload' if details.get('cpu_offload') else ''})"
    )


class RootStep(nn.Module):
    """The loop's per-micro-batch module for a sharded model: the loss through the root unit
    (the unsharded run's :class:`hone.runtime.step.MicroBatchLoss`, driven through FSDP2's hooks)."""

    def __init__(self, root: ShardedLM, loss_fn: LossFn, autocast_dtype: torch.dtype | None) -> None:
        super().__init__()
        self.root = root
        self.loss_fn = loss_fn
        self.autocast_dtype = autocast_dtype

    def forward(self, batch: MicroBatch) -> torch.Tensor:
        return self.root(batch, self.loss_fn, self.autocast_dtype)


def wrap_fsdp_step(step: StepModule) -> StepModule:
    """The loop's micro-batch module becomes the root unit's forward. No ``no_sync``: FSDP2
    reduce-scatters after every micro-batch (module docstring)."""
    inner = step.module
    root = sharded_root(inner.model)
    if root is None:
        raise FsdpError("the model was not sharded by the FSDP2 transform")
    return StepModule(RootStep(root, inner.loss_fn, inner.autocast_dtype))


def _skipped(ctx: PlanContext) -> str | None:
    if ctx.cfg.distributed.strategy == "fsdp" and not ctx.facts.world.distributed:
        return "distributed.strategy: fsdp on a single process (launch with --nproc-per-node N or torchrun to shard)"
    return None


FSDP = Transform(
    name="fsdp",
    switch="distributed.strategy",
    wanted=lambda ctx: ctx.decided.strategy == "fsdp",
    check=lambda ctx: fsdp_problems(ctx.cfg, ctx.facts.device.type, ctx.decided.expert_parallel),
    skipped_because=_skipped,
    why=lambda ctx: ctx.decided.strategy_why,
    model=lambda model, ctx: apply_fsdp(model, ctx.cfg, ctx.facts, ctx.decided.strategy_why),
    wrap_step=lambda step, ctx: (wrap_fsdp_step(step), {}),
    shards_parameters=True,
    label=fsdp_label,
)
