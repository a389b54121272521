"""The quantized-base transform: QLoRA's frozen base in NF4 (``model.quantize: nf4``).

It runs on the base model right after the attention kernel and before anything that wraps or
traces layers (experts backend, adapter, checkpointing, compile): it swaps every linear layer
but the output head for an :class:`~hone.models.nf4.NF4Linear`, which the adapter then wraps
with LoRA (PEFT's custom-module mapping) and the compiler traces through hone's dequantization
op without a graph break.

The full-precision model never exists whole. A big preset arrives already quantized: the
loader draws it on the device one module at a time and this transform's ``as_drawn`` hook
quantizes each linear layer as soon as it is drawn (:func:`hone.models.nf4.quantize_as_drawn`),
so its ``model`` hook only records it. A tiny
preset or a model directory arrives on the CPU (:func:`hone.models.loader.load_model`): this
transform moves one full-precision weight at a time to the device, quantizes it there and drops
it, and the rest of the model (embedding, norms, head) follows once the adapter is attached.

Checkpoints need no state-dict hook: the 4-bit weights are buffers, not trainable parameters,
and hone's step checkpoints hold only the trainable weights and the optimizer (LoRA), never the
base. A full fine-tune of a 4-bit base and FSDP2 sharding of it are refused by the config
(:class:`hone.config.root.HoneConfig`); ``distributed.strategy: auto`` choosing FSDP2 is refused here.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from hone.transforms.base import PlanContext, Transform


def _check(ctx: PlanContext) -> list[str]:
    # hone.models.nf4 imports torchao and PEFT: only for a run that quantizes
    from hone.models.nf4 import INSTALL_HINT, torchao_installed

    problems = []
    if not torchao_installed():
        problems.append(f"model.quantize: nf4 needs the Python package 'torchao': {INSTALL_HINT}, or set model.quantize: none")
    if ctx.decided.strategy == "fsdp":
        problems.append(
            f"model.quantize: nf4 does not work with FSDP2 ({ctx.decided.strategy_why}); set distributed.strategy: ddp "
            "(every GPU holds the 4-bit model), or model.quantize: none"
        )
    return problems


def _apply(model: nn.Module, ctx: PlanContext) -> dict[str, Any]:
    from hone.models.nf4 import quantize_linears  # torchao and PEFT: see _check

    model_cfg = ctx.cfg.model
    details = quantize_linears(model, ctx.facts.device)
    return {"format": model_cfg.quantize, "compute_dtype": model_cfg.dtype, **details}


def _as_drawn(skeleton: nn.Module, ctx: PlanContext):
    from hone.models.nf4 import quantize_as_drawn  # torchao and PEFT: see _check

    return quantize_as_drawn(skeleton)


def _size(mib: float) -> str:
    return f"{mib / 1024:.2f} GiB" if mib >= 1024 else f"{mib:.1f} MiB"


def _label(details: dict[str, Any]) -> str:
    kept = f", {len(details['kept_layers'])} kept in {details['compute_dtype']}" if details.get("kept_layers") else ""
    return (
        f"quantize ({details['format']}: {details['quantized_layers']} linear layers, "
        f"{_size(details['weights_mib'])} -> {_size(details['nf4_mib'])}{kept})"
    )


QUANTIZE = Transform(
    name="quantize",
    switch="model.quantize",
    wanted=lambda ctx: ctx.cfg.model.quantize != "none",
    check=_check,
    stage="base",
    model=_apply,
    as_drawn=_as_drawn,
    label=_label,
    why=lambda ctx: f"model.quantize: {ctx.cfg.model.quantize} (QLoRA: frozen 4-bit base, LoRA in full precision)",
)
