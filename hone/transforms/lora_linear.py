"""The fused LoRA linear: every PEFT LoRA linear layer runs hone's forward (``performance.lora_linear``).

PEFT computes a LoRA linear as three separate results (the base's output, the LoRA output, their
scaled sum) and the same again for the input gradient; hone's layer
(:class:`hone.models.lora_linear.HoneLoraLinear`, its kernel :mod:`hone.kernels.lora_linear`)
accumulates the LoRA product inside the base's matmuls and scales the rank-wide tensors, which
spares every LoRA layer two passes over ``[tokens, features]`` tensors each way. The adapter
stays PEFT's: only the layer instances change (sharing their submodules and parameters), so
files, merging and adapter switching are PEFT's own.

It runs on the adapted model after the float8 base (which swaps the ``base_layer`` instances
the fused layer reads at each call, so either order works) and before the tiled MLP,
checkpointing and compile, which wrap and trace the layers as they are.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from hone.config.root import HoneConfig
from hone.transforms.base import PlanContext, Transform

__all__ = ["LORA_LINEAR", "fused_lora_layers"]


def fused_lora_layers(cfg: HoneConfig) -> bool:
    """Whether the run's LoRA linear layers run hone's fused layer (what the memory estimate reads too)."""
    return cfg.adapter.is_lora and cfg.performance.lora_linear != "peft" and cfg.model.quantize != "nf4"


def _wanted(ctx: PlanContext) -> bool:
    return fused_lora_layers(ctx.cfg)


def _skipped_because(ctx: PlanContext) -> str | None:
    if ctx.cfg.performance.lora_linear == "fused" and ctx.cfg.model.quantize == "nf4":
        return "model.quantize: nf4: QLoRA's 4-bit base runs PEFT's forward"
    return None


def _why(ctx: PlanContext) -> str:
    setting = ctx.cfg.performance.lora_linear
    if not ctx.cfg.adapter.is_lora:
        return "adapter.type: none: no LoRA layers"
    if setting == "peft":
        return "performance.lora_linear: peft: PEFT's own LoRA forward"
    if ctx.cfg.model.quantize == "nf4":
        return f"performance.lora_linear: {setting}: QLoRA's 4-bit base runs PEFT's forward"
    return f"performance.lora_linear: {setting}: each LoRA product summed inside its base's matmuls"


def _apply(model: nn.Module, ctx: PlanContext) -> dict[str, Any]:
    from hone.models.lora_linear import use_fused_lora  # PEFT: only for a LoRA run

    return {"layers": use_fused_lora(model)}


LORA_LINEAR = Transform(
    name="fused_lora_linear",
    switch="performance.lora_linear",
    wanted=_wanted,
    skipped_because=_skipped_because,
    why=_why,
    model=_apply,
    label=lambda details: f"fused_lora_linear ({details.get('layers', 0)} layers)",
)
