"""The weights a checkpoint has to carry: the trainable ones, by parameter name.

Frozen base weights are never written to checkpoints (they are reloaded from the model
source), which keeps a LoRA checkpoint a few MB. What "trainable weights" means is decided by
:mod:`hone.models.save` (it knows about PEFT and compiled wrappers); this module only makes
CPU copies for safetensors and keeps a plain fallback so checkpoints work without it.
"""

import torch
from torch import nn


def trainable_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Contiguous CPU copies of every trainable weight, keyed by parameter name.

    Copies, not views: the next optimizer step must not change what is being written.
    """
    try:
        from hone.models.save import trainable_state_dict as views
    except ImportError:  # hone.models not installed alongside: same rule, inline
        views = lambda m: {n: p.detach() for n, p in m.named_parameters() if p.requires_grad}  # noqa: E731
    return {name: t.to("cpu", copy=True).contiguous() for name, t in views(model).items()}


def load_trainable_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy ``state`` into the model's trainable weights; the names must match both ways
    (a :class:`hone.errors.HoneError` says which do not)."""
    from hone.models.save import load_trainable_state_dict as load

    load(model, state)
