"""The loss as a transform: the fused linear cross-entropy where it applies, else the standard one.

Both take the decoder's last hidden states and the output head (see
:data:`~hone.transforms.base.LossFn`). The standard loss computes the [tokens x vocab] logits
and upcasts them to float32: at a 152K vocabulary that is 1.2 GiB per 2K tokens before its
gradient, and the largest single tensor of a long-context step. The fused loss
(:func:`hone.kernels.cross_entropy.fused_linear_cross_entropy`) walks the tokens in chunks and
produces the gradients of the hidden states and of the head chunk by chunk, so only one chunk's
logits ever exist; its value and gradients equal the standard loss within float rounding.

It applies to models whose logits are the plain output projection; models that scale or
soft-cap their logits (Gemma 2, Cohere, Granite) keep the standard loss (``auto``), or are
refused with ``performance.loss: fused_linear_ce``.

As a transform (:data:`LOSS`) it changes no module: it supplies the run's loss function once the
model is ready. It sits before compile in the plan, so a compiled run compiles the standard loss
along with the layers.
"""

from typing import Any

import torch
from torch import nn

from hone.config.root import HoneConfig
from hone.data.collate import IGNORE_INDEX, MicroBatch
from hone.errors import HoneError
from hone.models.structure import causal_lm_parts
from hone.runtime.loss import logit_postprocess, standard_loss
from hone.runtime.step import LossFn
from hone.transforms.base import PlanContext, RunFacts, Transform
from hone.transforms.memory.facts import transformers_config


def fused_linear_ce_loss() -> LossFn:
    """The fused loss over a [B, T, H] batch, flattened to tokens (under autocast a float32 head
    computes in bf16, as ``F.linear`` would; the cast's gradient flows back to the float32 weight)."""
    from hone.kernels.cross_entropy import fused_linear_cross_entropy

    def loss_fn(hidden: torch.Tensor, head: nn.Module, batch: MicroBatch) -> torch.Tensor:
        weight = head.weight
        if weight.dtype != hidden.dtype and not torch.is_autocast_enabled(hidden.device.type):
            weight = weight.to(hidden.dtype)  # (under autocast the kernel casts both itself)
        return fused_linear_cross_entropy(
            hidden.reshape(-1, hidden.shape[-1]), weight, batch.targets.reshape(-1), ignore_index=IGNORE_INDEX
        )

    return loss_fn


def fused_linear_ce_fp8_loss(head: nn.Module) -> LossFn:
    """The fused loss through ``head``'s frozen weight quantized to float8 once, now (rowwise:
    :mod:`hone.kernels.cross_entropy_fp8`); the hidden states are cast to the head's dtype, as
    the float8 base linears cast their inputs."""
    from hone.kernels.cross_entropy_fp8 import fused_linear_cross_entropy_fp8
    from hone.kernels.fp8_linear import quantize_frozen_weight

    if head.weight.requires_grad:
        raise LossError("performance.fp8_head: true needs a frozen output head (LoRA), but the head is trained")
    weight = quantize_frozen_weight(head.weight.detach(), "rowwise")
    dtype = head.weight.dtype

    def loss_fn(hidden: torch.Tensor, head: nn.Module, batch: MicroBatch) -> torch.Tensor:
        flat = hidden.reshape(-1, hidden.shape[-1]).to(dtype)
        return fused_linear_cross_entropy_fp8(flat, weight, batch.targets.reshape(-1), ignore_index=IGNORE_INDEX)

    return loss_fn


def fused_loss_blockers(model_config: Any, head: nn.Module | None) -> list[str]:
    """Why the fused loss cannot compute this model's loss exactly (empty: it can)."""
    blockers = []
    if logit_postprocess(model_config) is not None:
        blockers.append("the model scales or soft-caps its logits after the output projection")
    if head is not None and (getattr(head, "bias", None) is not None or not hasattr(head, "weight")):
        blockers.append(f"the model's output head ({type(head).__name__}) is not a plain linear projection without bias")
    return blockers


class LossError(HoneError):
    """``performance.loss: fused_linear_ce`` on a model whose loss it cannot compute exactly."""


def decide_loss(asked: str, blockers: list[str]) -> tuple[str, str]:
    """(``fused_linear_ce`` or ``standard``, why): the one rule, for the run (blockers read from
    the loaded model) and for ``hone plan`` and the memory estimate (read from its config)."""
    if asked == "standard":
        return "standard", "performance.loss: standard"
    if asked == "fused_linear_ce":
        return "fused_linear_ce", "performance.loss: fused_linear_ce"
    if not blockers:
        return "fused_linear_ce", "performance.loss: auto; the model's logits are the plain output projection"
    return "standard", f"performance.loss: auto, and the fused loss does not apply: {'; '.join(blockers)}"


def chosen_loss(cfg: HoneConfig, model_config: Any, head: nn.Module | None) -> tuple[str, str]:
    """(``fused_linear_ce`` or ``standard``, why) for ``cfg`` and the loaded model; refuses an
    explicit ``fused_linear_ce`` that cannot be exact."""
    asked = cfg.performance.loss
    blockers = fused_loss_blockers(model_config, head)
    if asked == "fused_linear_ce" and blockers:
        raise LossError(
            f"performance.loss: fused_linear_ce cannot compute this model's loss exactly: {'; '.join(blockers)}. "
            "Use performance.loss: auto or standard"
        )
    return decide_loss(asked, blockers)


def preference_loss(cfg: HoneConfig, model: nn.Module) -> tuple[LossFn, dict[str, Any]]:
    """A preference objective as the run's loss (:class:`hone.runtime.pair_loss.PairLoss`): the
    sequences' log-probabilities from the hidden states chunk by chunk (never the logits), the
    reference (DPO, IPO) the same model with its adapter(s) switched off."""
    from hone.models.adapters import adapters_off
    from hone.runtime.pair_loss import PairLoss

    t = cfg.training
    objective, pref = t.objective, t.preference
    blockers = fused_loss_blockers(getattr(model, "config", None), causal_lm_parts(model)[1])
    if blockers:
        raise LossError(
            f"training.objective: {objective} sums log-probabilities from the hidden states and the output head, "
            f"which cannot be exact for this model: {'; '.join(blockers)}"
        )
    source = cfg.preference_reference
    reference_off = adapters_off(model) if source == "adapter_disabled" else None
    loss = PairLoss(objective, pref.beta, pref.label_smoothing, reference_off)
    reference = {
        None: "none (reference-free)",
        "adapter_disabled": "the model with its adapter(s) switched off, in each micro-batch",
        "precomputed": "precomputed once with the initial weights before the first step",
    }[source]
    if pref.reference == "auto" and source == "precomputed" and cfg.adapter.is_lora:
        reference += f" (auto: num_epochs {t.num_epochs:g}, computed once instead of every epoch)"
    why = f"training.objective: {objective}, beta {pref.beta:g}; reference: {reference}"
    return loss, {"loss": f"{objective}, per-sequence log-probs", "why": why, "objective": objective}


def build_loss(cfg: HoneConfig, facts: RunFacts, model: nn.Module, float8: bool = False) -> tuple[LossFn, dict[str, Any]]:
    """The run's loss function and its record. The standard loss is compiled with the model
    when the run compiles (Inductor then never writes the float32 logits out whole); the fused
    one is an opaque custom op that compiled code calls as it is. A preference objective is a
    loss too (:func:`preference_loss`). ``float8``: the run's base is float8 (the plan decided
    ``fp8`` on), so ``fp8_head`` takes the fused loss's float8 head (the plan has checked it applies)."""
    if cfg.training.is_preference:
        return preference_loss(cfg, model)
    config = getattr(model, "config", None)
    head = causal_lm_parts(model)[1]
    kind, why = chosen_loss(cfg, config, head)
    if kind == "fused_linear_ce" and float8 and cfg.performance.fp8_head:
        return fused_linear_ce_fp8_loss(head), {"loss": kind, "why": why, "head": "float8 rowwise (performance.fp8_head)"}
    if kind == "fused_linear_ce":
        return fused_linear_ce_loss(), {"loss": kind, "why": why}
    compiled = cfg.performance.compiles_on(facts.device.type)
    compile_fn = None
    if compiled:
        backend, dynamic = cfg.performance.torch_compile_backend, True if facts.lengths_vary else None

        def compile_fn(fn):
            return torch.compile(fn, backend=backend, dynamic=dynamic)

    return standard_loss(logit_postprocess(config), compile_fn), {"loss": kind, "why": why, "compiled": compiled}


def loss_decision(cfg: HoneConfig) -> tuple[str, str]:
    """(the loss the run will use, why), by :func:`decide_loss` with what the model's config
    shows before it loads (a bias on the head is only known once it has): what the plan and the
    memory estimate count on. A preference objective's per-sequence log-probs walk the tokens in
    chunks as the fused loss does (never the logits)."""
    if cfg.training.is_preference:
        return "fused_linear_ce", f"training.objective: {cfg.training.objective} (per-sequence log-probs, chunked)"
    return decide_loss(cfg.performance.loss, fused_loss_blockers(transformers_config(cfg.model), None))


def _why(ctx: PlanContext) -> str:
    if ctx.cfg.training.is_preference:
        return f"{ctx.cfg.training.objective} (training.objective; per-sequence log-probs from the hidden states)"
    kind, why = loss_decision(ctx.cfg)
    return f"{kind} ({why})"


def _check(ctx: PlanContext) -> list[str]:
    """What a preference objective cannot run with that only the plan's decisions show."""
    objective = ctx.cfg.training.objective
    if objective == "sft":
        return []
    problems = []
    if ctx.decided.expert_parallel > 1:
        problems.append(
            f"training.objective: {objective} does not run with expert parallelism yet (distributed.expert_parallel "
            f"resolves to {ctx.decided.expert_parallel}): set distributed.expert_parallel: 1"
        )
    blockers = fused_loss_blockers(transformers_config(ctx.cfg.model), None)
    if blockers:
        problems.append(
            f"training.objective: {objective} sums log-probabilities from the hidden states and the output head, "
            f"which cannot be exact for this model: {'; '.join(blockers)}"
        )
    return problems


LOSS = Transform(
    name="loss",
    switch="performance.loss",
    wanted=lambda ctx: True,
    check=_check,
    why=_why,
    loss=lambda model, ctx: build_loss(ctx.cfg, ctx.facts, model, float8=ctx.decided.fp8 != "off"),
    label=lambda d: f"loss ({d['loss']}{', float8 head' if 'head' in d else ''})",
)
