"""Activation checkpointing as a transform: recompute each decoder layer in the backward."""

from typing import Any

from peft import PeftModel
from torch import nn

from hone.errors import HoneError


class CheckpointingError(HoneError):
    """The model cannot be checkpointed the way the config asks."""


def apply_activation_checkpointing(model: nn.Module, policy: str) -> dict[str, Any]:
    """Recompute each decoder layer in the backward (non-reentrant checkpointing).

    With LoRA the embedding output gets ``requires_grad`` (PEFT's convention), so a checkpointed
    block whose inputs come straight from frozen weights still reaches the adapters.
    """
    base = model.get_base_model() if isinstance(model, PeftModel) else model
    if not getattr(base, "supports_gradient_checkpointing", False):
        raise CheckpointingError(
            f"memory.gradient_checkpointing: {type(base).__name__} does not support activation "
            "checkpointing; set it to false"
        )
    kwargs = {"use_reentrant": False}
    if hasattr(base, "activation_checkpointing_enable"):  # transformers >= 5.2x name
        base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if isinstance(model, PeftModel):
        base.enable_input_require_grads()
    return {"policy": policy}
