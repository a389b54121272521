"""The quantized-base transform: QLoRA's frozen base in NF4 (``model.quantize: nf4``), or the
experts of a MoE base in MXFP4 (``model.quantize: mxfp4``, or a checkpoint that ships them so).

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

MXFP4 (:mod:`hone.models.experts.mxfp4_quantize`) follows the same two paths for the experts
modules only; attention and dense layers stay in ``model.dtype``. An MXFP4 checkpoint arrives with
its experts already in MXFP4 (the loader keeps blocks and scales as shipped): this transform then
only records them, and refuses here what the config validators refuse for ``model.quantize:
mxfp4`` (the config alone cannot know the checkpoint's format) and ``nf4`` on top of it.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from hone.models.model_dir import ships_mxfp4
from hone.transforms.base import PlanContext, Transform
from hone.transforms.memory.facts import model_facts, mxfp4_experts


def _format(ctx: PlanContext) -> str:
    """The 4-bit format of the base: ``mxfp4`` for an MXFP4 checkpoint whatever model.quantize says."""
    return "mxfp4" if mxfp4_experts(ctx.cfg) is not None else ctx.cfg.model.quantize


def _wanted(ctx: PlanContext) -> bool:
    return ctx.cfg.model.quantize != "none" or ships_mxfp4(ctx.cfg.model)


def _checkpoint_problems(ctx: PlanContext) -> list[str]:
    """What the config validators refuse for ``model.quantize: mxfp4``, for an MXFP4 checkpoint
    (known only once its config.json is read)."""
    cfg = ctx.cfg
    where = f"{cfg.model.path} ships its experts in MXFP4 (config.json quantization_config.quant_method: mxfp4)"
    problems = []
    if cfg.model.quantize == "nf4":
        problems.append(
            f"model.quantize: nf4 cannot quantize this base: {where}, which hone keeps as it is (its attention "
            "stays in model.dtype); set model.quantize: none or mxfp4"
        )
    if not cfg.adapter.is_lora:
        problems.append(
            f"{where}: 4-bit experts cannot be trained, but adapter.type is 'none' (full fine-tune): set adapter.type: lora"
        )
    if cfg.performance.fp8 != "off":
        problems.append(f"{where}: not with performance.fp8: {cfg.performance.fp8}; set performance.fp8: off")
    return problems


def _no_experts_problem(ctx: PlanContext) -> list[str]:
    """``model.quantize: mxfp4`` on a model without MoE layers (a dense model directory; the config
    refuses a dense preset by name), known once the model is read on the meta device."""
    try:
        layers = model_facts(ctx.cfg).layers
    except Exception:  # noqa: BLE001 -- an unreadable model is the loader's error to report
        return []
    if any(layer.moe for layer in layers):
        return []
    return [
        f"model.quantize: mxfp4 stores the experts of a mixture-of-experts model, but {ctx.cfg.model.source} has no "
        "MoE layers: use model.quantize: nf4 for a dense model, or none"
    ]


def _check(ctx: PlanContext) -> list[str]:
    fmt = _format(ctx)
    problems = _checkpoint_problems(ctx) if ships_mxfp4(ctx.cfg.model) else []
    if ctx.cfg.model.quantize == "mxfp4":
        problems += _no_experts_problem(ctx)
    if fmt == "nf4":
        # hone.models.nf4 imports torchao and PEFT: only for a run that quantizes
        from hone.models.nf4 import INSTALL_HINT, torchao_installed

        if not torchao_installed():
            problems.append(
                f"model.quantize: nf4 needs the Python package 'torchao': {INSTALL_HINT}, or set model.quantize: none"
            )
    if ctx.decided.strategy == "fsdp":
        fix = "(every GPU holds the model with 4-bit experts)" if fmt == "mxfp4" else "(every GPU holds the 4-bit model)"
        problems.append(
            f"{mxfp4_experts(ctx.cfg) or 'model.quantize: nf4'}: does not work with FSDP2 ({ctx.decided.strategy_why}); "
            f"set distributed.strategy: ddp {fix}" + ("" if ships_mxfp4(ctx.cfg.model) else ", or model.quantize: none")
        )
    return problems


def _apply(model: nn.Module, ctx: PlanContext) -> dict[str, Any]:
    model_cfg = ctx.cfg.model
    if _format(ctx) == "mxfp4":
        from hone.models.experts.mxfp4_quantize import quantize_model_experts

        as_shipped = ships_mxfp4(model_cfg)
        details = quantize_model_experts(model, ctx.facts.device)
        return {"format": "mxfp4", "compute_dtype": model_cfg.dtype, "as_shipped": as_shipped, **details}
    from hone.models.nf4 import quantize_linears  # torchao and PEFT: see _check

    details = quantize_linears(model, ctx.facts.device)
    return {"format": model_cfg.quantize, "compute_dtype": model_cfg.dtype, **details}


def _as_drawn(skeleton: nn.Module, ctx: PlanContext):
    if _format(ctx) == "mxfp4":
        from hone.models.experts.mxfp4_quantize import quantize_experts_as_drawn

        return quantize_experts_as_drawn(skeleton)
    from hone.models.nf4 import quantize_as_drawn  # torchao and PEFT: see _check

    return quantize_as_drawn(skeleton)


def _size(mib: float) -> str:
    return f"{mib / 1024:.2f} GiB" if mib >= 1024 else f"{mib:.1f} MiB"


def _label(details: dict[str, Any]) -> str:
    from hone.models.loader import format_count

    if details.get("format") == "mxfp4":
        source = "experts as shipped" if details.get("as_shipped") else "experts"
        return (
            f"quantize (mxfp4: {details['experts_modules']} {source} modules, "
            f"{format_count(details['experts_weights'])} weights, "
            f"{_size(details['weights_mib'])} -> {_size(details['mxfp4_mib'])}; the rest in {details['compute_dtype']})"
        )
    kept = f", {len(details['kept_layers'])} kept in {details['compute_dtype']}" if details.get("kept_layers") else ""
    return (
        f"quantize ({details['format']}: {details['quantized_layers']} linear layers, "
        f"{_size(details['weights_mib'])} -> {_size(details['nf4_mib'])}{kept})"
    )


def _why(ctx: PlanContext) -> str:
    mxfp4 = mxfp4_experts(ctx.cfg)
    if mxfp4 is not None:
        return f"{mxfp4}: the experts in MXFP4 (4-bit, 0.53 bytes a weight), LoRA in full precision"
    return f"model.quantize: {ctx.cfg.model.quantize} (QLoRA: frozen 4-bit base, LoRA in full precision)"


QUANTIZE = Transform(
    name="quantize",
    switch="model.quantize",
    wanted=_wanted,
    check=_check,
    stage="base",
    model=_apply,
    as_drawn=_as_drawn,
    label=_label,
    why=_why,
)
