"""Fits a chosen attention backend to the machine: checks it before a model is built, and
picks the packed-row kernel once the model is there.

The config already refused what is impossible anywhere (a missing package, float32 flash);
what depends on the device (CUDA-only kernels, flex_attention's forward-only CPU path, the
varlen kernel's CUDA + half-precision needs) can only be decided here, once the device is known.
"""

from typing import Any

import torch

from hone.config import HoneConfig
from hone.config.model import ModelConfig
from hone.models.attention.causal import register_causal_sdpa
from hone.models.attention.packed_mask import all_layers_attend_fully
from hone.models.attention.sinks import SINK_ATTENTION, has_attention_sinks, sink_backend_for
from hone.models.attention.varlen import fused_kernel_runs, grouped_heads_native, register_varlen_sdpa
from hone.models.errors import ModelError
from hone.models.model_dir import attention_groups

#: Inductor's flex attention kernels refuse heads narrower than this ("embedding dimension of
#: the query, key, and value must be at least 16").
FLEX_MIN_HEAD_DIM = 16


def attention_problems(model_cfg: ModelConfig, device: torch.device, training: bool = True) -> list[str]:
    """Why ``model.attn_implementation`` cannot run (or train) on ``device`` (empty: it can)."""
    backend = model_cfg.attention
    name = model_cfg.attn_implementation
    if backend.needs_cuda and device.type != "cuda":
        return [
            f"model.attn_implementation: '{name}' runs on CUDA GPUs only, but the device is {device.type}: "
            "use sdpa (or flex_attention on a GPU)"
        ]
    if training and not backend.trains_on_cpu and device.type == "cpu":
        return [
            f"model.attn_implementation: '{name}' has no backward pass on the CPU (forward only): "
            "train with sdpa on the CPU, or train on a GPU"
        ]
    return []


def select_attention_kernel(
    model: Any, cfg: HoneConfig, device: torch.device, compute: torch.dtype, shared_prompt: str | None = None
) -> str | None:
    """The kernel an ``sdpa`` training run uses, in one line (None: transformers' sdpa as it is).

    Packed rows go through the varlen kernel where it runs (:func:`select_packed_kernel`);
    otherwise a model whose layers all attend causally to the whole row trains through
    :data:`~hone.models.attention.causal.CAUSAL_SDPA`: the same sdpa kernel, with no mask
    prepared by transformers and so no host sync in the forward. Shared-prompt pairs
    (``shared_prompt``, the plan's kernel for them: :mod:`hone.transforms.prompt_sharing`) need
    the varlen kernel with their tree boundaries (``varlen``) or hone's tree mask: flex attention
    (``flex``) or sdpa with a dense mask (``mask``).
    """
    if has_attention_sinks(model.config):
        return select_sink_kernel(model, cfg)
    if shared_prompt == "varlen":
        if select_packed_kernel(model, cfg, device, compute) is None:
            raise ModelError(
                "training.preference.share_prompt: the plan chose torch's varlen kernel for shared prompts, but it cannot "
                f"run this model here: {'; '.join(varlen_blockers(model.config, device, compute))}. Set "
                "model.sdpa_varlen: false (sdpa with a tree mask) or training.preference.share_prompt: false"
            )
        return "pairs share their prompt: torch's varlen kernel, the prompt's keys gathered for each rejected branch"
    if shared_prompt == "flex":
        if model.config._attn_implementation != "flex_attention":
            model.set_attn_implementation("flex_attention")
        return "pairs share their prompt: flex attention with a tree block mask"
    if shared_prompt == "mask":
        return "pairs share their prompt: sdpa with a tree mask"
    packed = select_packed_kernel(model, cfg, device, compute)
    if packed is not None or cfg.model.attn_implementation != "sdpa":
        return packed
    if causal_blockers(model.config):
        return None
    model.set_attn_implementation(register_causal_sdpa())
    return "causal, no mask prepared"


def select_sink_kernel(model: Any, cfg: HoneConfig) -> str | None:
    """A model with attention sinks (gpt_oss) trains through hone's flex attention with sinks
    (:mod:`hone.models.attention.sinks`) for ``sdpa`` and ``flex_attention``, or eager; never
    through the causal / varlen sdpa kernels, which would drop the sinks. The loader already
    built it with the backend :func:`~hone.models.attention.sinks.sink_backend_for` chose."""
    name = sink_backend_for(model.config, cfg.model.attn_implementation)
    if name != model.config._attn_implementation:
        model.set_attn_implementation(name)
    return "attention sinks through hone's flex attention" if name == SINK_ATTENTION else None


def causal_blockers(config: Any) -> list[str]:
    """What a model's attention needs beyond causality over the whole row (empty: nothing), for
    which transformers' own mask must stay."""
    blockers = []
    if not all_layers_attend_fully(config):
        blockers.append("sliding-window layers")
    if has_attention_sinks(config):
        blockers.append("attention sinks")
    if getattr(config, "attention_chunk_size", None):
        blockers.append("chunked attention")
    if getattr(config, "use_bidirectional_attention", False):
        blockers.append("bidirectional attention")
    return blockers


def select_packed_kernel(model: Any, cfg: HoneConfig, device: torch.device, compute: torch.dtype) -> str | None:
    """Switch a packed ``sdpa`` run to per-document varlen attention (``model.sdpa_varlen``),
    and say so in one line; None when the run keeps sdpa with hone's document mask.

    The varlen kernel is torch's FlashAttention-2 (CUDA, bf16/fp16) and computes plain causal
    attention per document, so models with sliding-window layers, attention dropout or logit
    soft-capping keep the mask, which expresses all of those. ``auto`` falls back quietly;
    ``true`` stops with the reasons.
    """
    choice = cfg.model.sdpa_varlen
    packs = cfg.packs_documents  # packed rows, or preference pairs packed per micro-batch
    if cfg.model.attn_implementation != "sdpa" or not packs or choice is False:
        return None
    blockers = varlen_blockers(model.config, device, compute)
    if blockers:
        if choice is True:
            raise ModelError(
                "model.sdpa_varlen: true, but the varlen kernel cannot run here: "
                + "; ".join(blockers)
                + ". Set sdpa_varlen: auto (hone's document mask instead) or false"
            )
        return None
    model.set_attn_implementation(register_varlen_sdpa())
    if attention_groups(model.config) > 1 and not grouped_heads_native(device):
        return "packed rows through torch's varlen kernel (key/value heads repeated for it)"
    return "packed rows through torch's varlen kernel"


def varlen_blockers(config: Any, device: torch.device, compute: torch.dtype) -> list[str]:
    """Why the varlen kernel cannot run a model with ``config`` on ``device`` (empty: it can)."""
    blockers = []
    if not fused_kernel_runs(device, compute):
        blockers.append(
            f"it needs CUDA and bfloat16/float16 with torch >= 2.10 (here: {device.type}, "
            f"{str(compute).removeprefix('torch.')}, torch {torch.__version__})"
        )
    if not all_layers_attend_fully(config):
        blockers.append("the model has sliding-window layers")
    if has_attention_sinks(config):
        blockers.append("the model has attention sinks")
    if getattr(config, "attention_dropout", 0.0):
        blockers.append(f"the model uses attention dropout ({config.attention_dropout})")
    if getattr(config, "attn_logit_softcapping", None) is not None:
        blockers.append("the model soft-caps attention logits")
    return blockers
