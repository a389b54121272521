"""The attention kernel as a transform: the backend the config names, fitted to this device.

``model.attn_implementation`` is registered with transformers on the base model (its
``AttentionInterface``; no model code is touched), with packed ``sdpa`` rows switched to torch's
varlen kernel where it runs (:func:`hone.models.attention.setup.select_attention_kernel`). It
also decides once, for the loaded model, how packed micro-batches reach the attention
(``attention_layout``: document boundaries, hone's mask, or transformers' own handling), so the
loss and the loop know nothing about attention.
"""

from typing import Any

from torch import nn

from hone.config.model import ModelConfig
from hone.config.root import HoneConfig
from hone.models.attention.layout import AttentionLayout, layout_for
from hone.models.attention.setup import FLEX_MIN_HEAD_DIM, attention_problems, select_attention_kernel
from hone.models.attention.sinks import has_attention_sinks
from hone.models.hub import local_model_dir
from hone.models.model_dir import attention_head_dim, read_causal_lm_config
from hone.models.precision import precision_for
from hone.models.presets import get_preset
from hone.transforms.base import Decisions, PlanContext, Transform
from hone.transforms.prompt_sharing import model_config_of, sharing_problems


def _narrow_flex_problems(ctx: PlanContext) -> list[str]:
    """flex_attention compiled by Inductor on a GPU with heads narrower than it takes: refused
    here, before the model loads, rather than inside the first compiled layer."""
    cfg = ctx.cfg
    compiles_flex = ctx.decided.compile and cfg.performance.torch_compile_backend == "inductor"
    if cfg.model.attn_implementation != "flex_attention" or ctx.facts.device.type != "cuda" or not compiles_flex:
        return []
    config = model_config_of(cfg)
    head_dim = None if config is None else attention_head_dim(config)
    if head_dim is None or head_dim >= FLEX_MIN_HEAD_DIM:
        return []
    return [
        f"model.attn_implementation: flex_attention compiled by Inductor needs heads of at least {FLEX_MIN_HEAD_DIM}, "
        f"but this model's are {head_dim} wide: use sdpa, or performance.torch_compile: false"
    ]


def _check(ctx: PlanContext) -> list[str]:
    return attention_problems(ctx.cfg.model, ctx.facts.device) + sharing_problems(ctx.cfg) + _narrow_flex_problems(ctx)


def _apply(model: nn.Module, ctx: PlanContext) -> dict[str, Any]:
    cfg = ctx.cfg
    compute = precision_for(cfg.model.dtype, full_finetune=not cfg.adapter.is_lora).compute
    kernel = select_attention_kernel(model, cfg, ctx.facts.device, compute, shared_prompt=ctx.decided.share_prompt_kernel)
    return {"implementation": cfg.model.attn_implementation, "kernel": kernel}


def _layout(model: nn.Module, ctx: PlanContext) -> AttentionLayout:
    return layout_for(model, shares_prompt=ctx.decided.share_prompt)


def _label(details: dict[str, Any]) -> str:
    extra = f", {details['kernel']}" if details.get("kernel") else ""
    return f"attention ({details['implementation']}{extra})"


def has_sinks(model: ModelConfig) -> bool:
    """Whether the configured model has attention sinks (gpt-oss); False where its config cannot
    be read here (the loader then says why)."""
    try:
        if model.preset is not None:  # the preset's config class names its model type
            return has_attention_sinks(get_preset(model.preset).config_class)
        return has_attention_sinks(read_causal_lm_config(local_model_dir(model.path), model.trust_remote_code))
    except Exception:  # noqa: BLE001 -- a reason line never fails the plan
        return False


def attention_why(cfg: HoneConfig, decided: Decisions | None = None) -> str:
    """The attention line of ``hone plan``: the backend, and what hone does with packed rows
    (preference pairs: whether they share their prompt, as ``decided``)."""
    model = cfg.model
    why = f"model.attn_implementation: {model.attn_implementation}"
    if model.attn_implementation in ("sdpa", "flex_attention") and has_sinks(model):
        return why + "; the model has attention sinks: hone's flex sink backend (sdpa would drop them)"
    if decided is not None and cfg.training.is_preference:
        why += f"; {decided.share_prompt_why}"
        if decided.share_prompt:
            return why
    if model.attn_implementation == "sdpa" and cfg.packs_documents:
        why += f"; packed rows through torch's varlen kernel where it runs (model.sdpa_varlen: {model.sdpa_varlen})"
    if model.attn_implementation == "sdpa":
        why += "; causal rows without a prepared mask where the model attends to the whole row"
    return why


ATTENTION = Transform(
    name="attention",
    switch="model.attn_implementation",
    wanted=lambda ctx: True,
    why=lambda ctx: attention_why(ctx.cfg, ctx.decided),
    check=_check,
    stage="base",
    model=_apply,
    attention_layout=_layout,
    label=_label,
)
