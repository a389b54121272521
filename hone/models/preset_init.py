"""How a preset's random weights are drawn beyond transformers' own initialisation.

transformers' init (every weight ~ N(0, initializer_range)) gives attention logits of about
unit spread, so at a few thousand tokens each position's attention is nearly flat: its output
is close to the mean of its prefix, the same vector for every token. After one or two layers the
tokens' hidden states point the same way (cosine to their batch mean 0.89-0.95 from the second
layer of qwen3-30b-a3b, measured by ``scripts/routing_balance.py``), so a MoE router sends
almost every token to the same few experts -- which experts depends on the batch. Nothing in a
trained model behaves so: its heads attend to particular tokens and its router, trained with a
load-balancing loss, spreads them. The kernels' speed does not care, but expert parallelism
does (each layer waits for the rank holding the busy experts), so a benchmark of it on
transformers' init measures a router no one trains.

``sharp_attention`` multiplies every attention's logits by :data:`LOGIT_SCALE` (the query and
key each by its square root: the q/k norms' gains where the model has them, else the q/k
projections), so attention picks tokens instead of averaging them; the tokens' hidden states then
stay apart (cosine to the batch mean 0.07-0.17 over the first six layers) and the router spreads
them (busiest of 4 expert-parallel ranks 1.05x the mean rank, against 1.66x). Only a preset's
draws change; the architecture, its code path and its cost per token are the same.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from hone.config.model import PresetInit
from hone.models.errors import ModelError

#: What ``sharp_attention`` multiplies the attention logits by.
LOGIT_SCALE = 16.0


@torch.no_grad()
def sharpen_attention(model: nn.Module, logit_scale: float = LOGIT_SCALE) -> int:
    """Multiply every attention's logits by ``logit_scale``, in place; returns how many attention
    modules changed. A module with ``q_proj`` and ``k_proj`` is an attention; with ``q_norm`` and
    ``k_norm`` (Qwen3) the norms' gains carry the factor, since the norms undo any scale of the
    projections; otherwise the projections' weights and biases do."""
    factor = math.sqrt(logit_scale)
    changed = 0
    for module in model.modules():
        if not (hasattr(module, "q_proj") and hasattr(module, "k_proj")):
            continue
        norms = [getattr(module, name, None) for name in ("q_norm", "k_norm")]
        scaled = norms if all(getattr(n, "weight", None) is not None for n in norms) else [module.q_proj, module.k_proj]
        for part in scaled:
            for tensor in (part.weight, getattr(part, "bias", None)):
                if tensor is None:
                    continue
                if not tensor.is_floating_point():
                    raise ModelError(
                        f"model.preset_init: sharp_attention: {type(model).__name__}'s attention has no q/k norms and its "
                        f"projections were replaced as drawn ({type(part).__name__}, {tensor.dtype} weights: a quantized "
                        "base), so their logits cannot be scaled; use model.preset_init: transformers with model.quantize"
                    )
                tensor.mul_(factor)
        changed += 1
    if not changed:
        raise ModelError(
            f"model.preset_init: sharp_attention: {type(model).__name__} has no attention module with "
            "q_proj and k_proj to sharpen; use model.preset_init: transformers"
        )
    return changed


def apply_preset_init(model: nn.Module, init: PresetInit) -> None:
    """What ``model.preset_init`` asks for, on a preset freshly drawn by transformers' init."""
    if init == "sharp_attention":
        sharpen_attention(model)
