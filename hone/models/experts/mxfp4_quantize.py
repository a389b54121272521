"""``model.quantize: mxfp4``: the experts of a mixture-of-experts base stored in MXFP4.

Only the experts modules change (:func:`hone.models.experts.mxfp4.quantize_experts`: blocks and
scales as buffers, a placeholder parameter); attention, dense MLPs, norms, the embedding and the
head stay in ``model.dtype``. The experts hold nearly all of a MoE model's weights (gpt-oss-20b:
19.1 of 20.9 billion), so this is where 4 bits pay.

Two ways in, as for NF4 (:mod:`hone.models.nf4`): a model that arrives whole on the CPU (a model
directory, a tiny preset) has each experts module quantized onto the run's device one module at a
time (:func:`quantize_model_experts`), so the device never holds more than one layer's experts in
full precision; a big preset drawn on the device one module at a time has each experts module
quantized in place as soon as it is drawn (:func:`quantize_experts_as_drawn`), so its
full-precision experts never exist whole.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hone.models.errors import ModelError
from hone.models.experts.backend import experts_modules, is_experts_module
from hone.models.experts.mxfp4 import EXPERT_PROJECTIONS, mxfp4_bytes, mxfp4_weights, quantize_experts

_MIB = 2**20


def _no_experts(model: nn.Module) -> ModelError:
    return ModelError(
        f"model.quantize: mxfp4 stores the experts of a mixture-of-experts model in MXFP4, but "
        f"{type(model).__name__} has no experts module (no MoE layer): use model.quantize: nf4 for a dense "
        "model, or none"
    )


def mxfp4_record(model: nn.Module) -> dict[str, Any]:
    """What the experts of ``model`` hold in MXFP4, whoever quantized them (this run, the loader of
    an MXFP4 checkpoint, or the as-drawn hook): modules, weights, MiB in ``model.dtype`` and in MXFP4."""
    modules = weights = full_bytes = 0
    for _, module in experts_modules(model):
        held = mxfp4_weights(module)
        if not held:
            continue
        modules += 1
        for name in held:
            placeholder = getattr(module, name)
            weights += placeholder.numel()
            full_bytes += placeholder.numel() * placeholder.element_size()
    return {
        "experts_modules": modules,
        "experts_weights": weights,
        "weights_mib": round(full_bytes / _MIB, 1),
        "mxfp4_mib": round(mxfp4_bytes(model) / _MIB, 1),
    }


def quantize_model_experts(model: nn.Module, device: torch.device | str) -> dict[str, Any]:
    """Quantize every experts module of ``model`` to MXFP4 on ``device``, one module at a time
    (modules already in MXFP4 stay as they are); returns :func:`mxfp4_record`. A model without
    experts is an error naming the key."""
    modules = experts_modules(model)
    if not modules:
        raise _no_experts(model)
    device = torch.device(device)
    for _, module in modules:
        quantize_experts(module, device)
    return mxfp4_record(model)


def quantize_experts_as_drawn(skeleton: nn.Module):
    """The :data:`hone.models.materialize.Replace` that quantizes each experts module of
    ``skeleton`` (a meta skeleton) in place, on the device it was drawn on, as soon as it is
    drawn (returns None: the module stays, its storage changes)."""
    if not experts_modules(skeleton):
        raise _no_experts(skeleton)

    def replace(module: nn.Module) -> nn.Module | None:
        if is_experts_module(module):
            quantize_experts(module, getattr(module, EXPERT_PROJECTIONS[0]).device)
        return None

    return replace
