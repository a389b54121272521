"""Activation checkpointing as a transform: what each decoder layer keeps for the backward.

Every policy checkpoints each decoder layer with torch's non-reentrant checkpoint, through
transformers' public switch (``activation_checkpointing_enable``, or its older name
``gradient_checkpointing_enable``), whose keyword arguments go to
``torch.utils.checkpoint.checkpoint``. The policies differ in what the checkpoint keeps:

- ``full``: the layer's input only; the backward recomputes the whole layer first.
- ``selective``: torch's selective activation checkpointing (``context_fn`` from
  ``create_selective_checkpoint_contexts``): the outputs of matmuls and attention kernels are
  saved (``MUST_SAVE``), everything else (norms, activations, RoPE, casts, LoRA's scaling) is
  recomputed (``PREFER_RECOMPUTE``). The backward recomputes only cheap, memory-bound ops, and
  the memory kept is that of the matmul outputs (the big [tokens x intermediate] MLP activations
  of SwiGLU's gate and up projections are kept; their product and the norms are not).
- ``offload``: ``full``, plus the layers' inputs held in pinned host memory between the forward
  and the backward (:mod:`hone.transforms.offload`); its per-micro-batch context comes from
  :func:`offload_step_context`.

All compose with regional compile (applied after this transform): transformers' checkpointing
wraps the layer's ``forward``, so the checkpoint (and a selective policy) is traced into the
compiled layer as torch's checkpoint operator and the compiler's partitioner honours it.
With LoRA the embedding output is made to require grad (transformers does it when it enables
checkpointing; the PEFT switch ``enable_input_require_grads`` is the same hook), so a layer
whose input comes from frozen weights still reaches the adapters.

As a transform (:data:`CHECKPOINTING`) it runs on the adapted model with the policy the plan
decided (``memory.activation_checkpointing``; ``auto`` picks the fastest policy the memory
estimate fits), after the tiled MLP (a checkpointed layer recomputes the tiled forward) and
before tiled layers and compile: transformers' checkpointing wraps each layer's call, so the
layer compiled next runs inside the checkpoint. ``selective`` on layers Inductor compiles is the
compiler's activation memory budget instead (:func:`memory_budget_context`, around each
micro-batch): torch's selective checkpointing wraps a layer from outside, and Inductor's kernels
overwrite the buffers it caches.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from hone.errors import HoneError
from hone.models.structure import decoder_layers, unwrap_peft
from hone.runtime.step import StepContext
from hone.transforms.base import PlanContext, Transform
from hone.transforms.offload import DEFAULT_MIN_BYTES, OffloadActivations

Policy = Literal["full", "selective", "offload"]


class CheckpointingError(HoneError):
    """The model cannot be checkpointed the way the config asks."""


def _ops(namespace: Any, names: tuple[str, ...]) -> list[Any]:
    """The operators of ``names`` that this torch build has (some are CUDA- or version-only)."""
    return [getattr(namespace, name) for name in names if hasattr(namespace, name)]


#: Outputs selective checkpointing keeps: every matmul (dense, batched, float8-scaled, grouped
#: for MoE experts) and every fused attention kernel. Compared by overload packet, so every
#: overload of an op counts.
SAVED_OPS: frozenset[Any] = frozenset(
    _ops(
        torch.ops.aten,
        (
            "mm",
            "addmm",
            "bmm",
            "baddbmm",
            "_scaled_mm",
            "_grouped_mm",
            "_scaled_grouped_mm",
            "_scaled_dot_product_flash_attention",
            "_scaled_dot_product_efficient_attention",
            "_scaled_dot_product_cudnn_attention",
            "_scaled_dot_product_flash_attention_for_cpu",
            "_scaled_dot_product_fused_attention_overrideable",
            "_flash_attention_forward",
            "_efficient_attention_forward",
        ),
    )
    + _ops(torch.ops.higher_order, ("flex_attention",))
)


def selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Save matmul and attention outputs; recompute the rest (torch's SAC policy signature).

    Nothing computed without grad is saved: autograd needs none of it, and torch's SAC would
    otherwise cache it anyway (its cache ignores grad mode) -- e.g. the tiled MLP's shards,
    computed under ``no_grad`` precisely so that their ``[tokens x intermediate]`` outputs are not
    kept (:mod:`hone.transforms.tiled_mlp`)."""
    if not torch.is_grad_enabled():
        return CheckpointPolicy.PREFER_RECOMPUTE
    if getattr(op, "overloadpacket", op) in SAVED_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def checkpoint_kwargs(policy: Policy) -> dict[str, Any]:
    """Keyword arguments for ``torch.utils.checkpoint.checkpoint`` under ``policy``."""
    kwargs: dict[str, Any] = {"use_reentrant": False}
    if policy == "selective":
        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, selective_policy)
    return kwargs


_OFFLOADERS: weakref.WeakKeyDictionary[nn.Module, OffloadActivations] = weakref.WeakKeyDictionary()


def apply_activation_checkpointing(
    model: nn.Module,
    policy: Policy,
    *,
    offload_min_bytes: int = DEFAULT_MIN_BYTES,
    use_streams: bool = True,
    offload_layers: int | None = None,
) -> dict[str, Any]:
    """Checkpoint each decoder layer of ``model`` (a transformers model or a PEFT wrapper) under
    ``policy``; returns what was done, for optimizations.json. ``offload_layers`` (``offload``
    only): move at most this many layers' inputs to the host, the first ones; the later layers'
    stay on the device (None: every layer's)."""
    if policy not in ("full", "selective", "offload"):
        raise ValueError(f"policy must be full, selective or offload (decide auto first), got {policy!r}")
    base = unwrap_peft(model)
    if not getattr(base, "supports_gradient_checkpointing", False):
        raise CheckpointingError(
            f"memory.activation_checkpointing: {policy}: {type(base).__name__} does not support activation "
            "checkpointing; set it to none"
        )
    layers = decoder_layers(model)
    kwargs = checkpoint_kwargs(policy)
    if hasattr(base, "activation_checkpointing_enable"):  # transformers >= 5.2x
        base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if getattr(base, "_require_grads_hook", None) is None and hasattr(base, "enable_input_require_grads"):
        base.enable_input_require_grads()  # the adapters behind a frozen embedding get gradients
    checkpointed = [layer for layer in layers if getattr(layer, "gradient_checkpointing", False)]
    if not checkpointed:
        raise CheckpointingError(
            f"memory.activation_checkpointing: {policy}: no decoder layer of {type(base).__name__} took "
            "checkpointing; set it to none"
        )
    record: dict[str, Any] = {
        "policy": policy,
        "layers": len(checkpointed),
        "layer_classes": sorted({type(layer).__name__ for layer in checkpointed}),
        "saves": _SAVES[policy],
        "recomputes": _RECOMPUTES[policy],
    }
    if policy == "selective":
        record["saved_ops"] = sorted(str(op) for op in SAVED_OPS)
    if policy == "offload":
        offloader = OffloadActivations(
            min_bytes=offload_min_bytes, use_streams=use_streams, model=model, max_tensors=offload_layers
        )
        stop, stop_name = _after_last_layer(base)
        offloader.pause_before(stop)
        _OFFLOADERS[model] = offloader
        _OFFLOADERS[base] = offloader
        record["offload"] = {
            "min_bytes": offload_min_bytes,
            "side_streams": use_streams,
            "paused_at": stop_name,
            "layers_offloaded": "all" if offload_layers is None else min(offload_layers, len(checkpointed)),
        }
    return record


def memory_budget_context(budget: float) -> AbstractContextManager[None]:
    """``selective`` for layers compiled by Inductor: the forward and backward run with torch's
    activation memory budget (``torch._functorch.config.activation_memory_budget``, the
    compile-time form of selective checkpointing), so the layers compiled on the first step are
    partitioned to keep at most ``budget`` of their activations, recomputing the cheapest ops.
    Scoped to the micro-batch: nothing else in the process compiles under it.

    hone's own ops (the grouped expert projections, the 4-bit linear) are opaque to the
    partitioner: its min-cut stages took them for free to recompute, like a pointwise op, and
    recomputed a layer's grouped GEMMs in the backward before anything else (a probe at a budget
    of 0.25: both projections of an MoE block run again; tests/kernels/moe_lora_checks.py).
    ``is_non_builtin_to_include`` keeps them out of the min-cut's free recomputation, as torch's
    own matmuls are, and leaves them to the budget's knapsack, which weighs them by the FLOPs
    their formulas count (:func:`hone.kernels.moe_lora.projection_flops`)."""
    import torch._functorch.config as functorch_config

    return functorch_config.patch(activation_memory_budget=budget, is_non_builtin_to_include=True)


def offloader_for(model: nn.Module) -> OffloadActivations | None:
    """The offloader :func:`apply_activation_checkpointing` attached to ``model``, if any."""
    return _OFFLOADERS.get(model)


def offload_step_context(model: nn.Module) -> AbstractContextManager[None]:
    """The context around one micro-batch's forward and backward: offloads the layer inputs
    when ``model`` was checkpointed with ``offload``, does nothing otherwise; where another
    transform took the saved-tensor hooks over (layer runs, which chain the offloader), its own."""
    hooks = _STEP_HOOKS.get(model)
    if hooks is not None:
        return hooks()
    offloader = offloader_for(model)
    return offloader.step_context() if offloader is not None else nullcontext()


_STEP_HOOKS: weakref.WeakKeyDictionary[nn.Module, Callable[[], AbstractContextManager[None]]] = weakref.WeakKeyDictionary()


def take_over_step_hooks(model: nn.Module, context: Callable[[], AbstractContextManager[None]]) -> None:
    """Make ``context`` the micro-batch context of ``model`` (and of the model inside its PEFT
    wrapper) in place of the offloader's: only one pair of saved-tensor hooks is active at a time,
    so a transform that needs its own (layer runs) installs them and hands tensors on to the
    offloader itself."""
    _STEP_HOOKS[model] = context
    _STEP_HOOKS[unwrap_peft(model)] = context


_SAVES = {
    "full": "each layer's input",
    "selective": "each layer's input and its matmul and attention outputs",
    "offload": "each layer's input, in pinned host memory",
}
_RECOMPUTES = {
    "full": "the whole layer",
    "selective": "norms, activations, RoPE and other elementwise ops",
    "offload": "the whole layer",
}


def _after_last_layer(base: nn.Module) -> tuple[nn.Module, str]:
    """The module that runs first after the decoder layers: the final norm where the decoder has
    one (``norm``, as in every transformers decoder-only model hone supports), else the output
    head. What is saved from there on is needed first by the backward: it stays on the device."""
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else None
    module = getattr(decoder, "norm", None) if decoder is not None else None
    if not isinstance(module, nn.Module):
        module = base.get_output_embeddings()
    if module is None:
        raise CheckpointingError(
            f"memory.activation_checkpointing: offload: {type(base).__name__} has neither a final norm nor an "
            "output head to stop offloading at; use full"
        )
    name = next((n for n, m in base.named_modules() if m is module), type(module).__name__)
    return module, name


#: What ``selective`` is under Inductor, for the record.
COMPILER_BUDGET = (
    "Inductor's partitioner under an activation memory budget (each compiled layer recomputes its cheapest ops first)"
)


def _check(ctx: PlanContext) -> list[str]:
    perf = ctx.cfg.performance
    if ctx.decided.checkpointing == "offload" and ctx.decided.compile and perf.torch_compile_scope == "model":
        return [
            "memory.activation_checkpointing: offload needs torch_compile_scope: regional (a whole-model graph saves "
            "the layers' inputs inside itself, out of the offload hooks' reach)"
        ]
    return []


def _apply(model: nn.Module, ctx: PlanContext) -> dict[str, Any]:
    decided = ctx.decided
    policy = decided.checkpointing
    use_streams = ctx.facts.device.type == "cuda"
    if decided.compiler_memory_budget is not None:
        # the same choice as selective (keep what is expensive, recompute what is cheap), made
        # by the partitioner inside each compiled layer
        details = {
            "policy": "selective",
            "mechanism": COMPILER_BUDGET,
            "activation_memory_budget": decided.compiler_memory_budget,
        }
    elif policy == "offload":
        details = apply_activation_checkpointing(model, policy, use_streams=use_streams, offload_layers=decided.offload_layers)
        details["offload"]["why"] = decided.offload_why
    else:
        details = apply_activation_checkpointing(model, policy, use_streams=use_streams)
    details["why"] = decided.checkpointing_why
    if ctx.cfg.memory.alias_note:
        details["note"] = ctx.cfg.memory.alias_note
    return details


def _step_context(model: nn.Module, ctx: PlanContext) -> StepContext:
    budget = ctx.decided.compiler_memory_budget
    if budget is not None:
        return lambda batch: memory_budget_context(budget)
    return lambda batch: offload_step_context(model)


def _skipped(ctx: PlanContext) -> str | None:
    """``auto`` written in the config that picked ``none``: why (the run fits without
    checkpointing). The default ``auto`` is no request to skip: its choice is in the record's
    decisions and the run's ``auto`` lines."""
    memory = ctx.cfg.memory
    return (
        ctx.decided.checkpointing_why
        if memory.checkpointing == "auto" and memory.explicitly_set("activation_checkpointing")
        else None
    )


def _label(d: dict[str, Any]) -> str:
    auto = f"; {d['why']}" if str(d.get("why", "")).startswith("activation_checkpointing: auto") else ""
    return f"activation checkpointing ({d.get('policy', 'full')}{auto})"


CHECKPOINTING = Transform(
    name="activation_checkpointing",
    switch="memory.activation_checkpointing",
    wanted=lambda ctx: ctx.decided.checkpointing != "none",
    why=lambda ctx: ctx.decided.checkpointing_why,
    check=_check,
    skipped_because=_skipped,
    model=_apply,
    step_context=_step_context,
    label=_label,
)
