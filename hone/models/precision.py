"""The mixed-precision convention: which weights live in which dtype, and when to autocast.

``model.dtype`` names the dtype of compute and of frozen weights. Trainable weights are the
master copy the optimizer updates, and small updates vanish when added to a low-precision
weight, so:

* ``float32``: everything float32, no autocast.
* LoRA in ``bfloat16``/``float16``: the frozen base stays in that dtype (half the memory);
  adapter weights and ``modules_to_save`` copies are float32. The loop runs the forward under
  ``torch.autocast(dtype)`` so an fp32 trainable module (say a saved ``lm_head``) can take a
  bf16 activation; PEFT's LoRA layers cast on their own either way.
* full fine-tune in ``bfloat16``: every weight is trainable and stays bf16 (pure bf16
  training, no autocast). bf16 has float32's range, and an fp32 master copy of every weight
  would double weight memory, the very thing a full fine-tune runs out of first.
* full fine-tune in ``float16``: float16 overflows and underflows where bf16 does not, so the
  weights are float32 and the loop autocasts to float16 (and should scale the loss).
"""

from dataclasses import dataclass

import torch

from hone.config.model import Dtype

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass(frozen=True)
class Precision:
    compute: torch.dtype
    """Dtype of activations and matmuls (what ``model.dtype`` names)."""

    weights: torch.dtype
    """Dtype the model is loaded in: frozen weights, and all weights of a full fine-tune."""

    trainable: torch.dtype
    """Dtype of the weights the optimizer updates."""

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """Dtype for ``torch.autocast`` around the forward, or None when no autocast is needed."""
        if self.compute == torch.float32:
            return None
        return self.compute if self.trainable != self.compute else None


def precision_for(dtype: Dtype, full_finetune: bool) -> Precision:
    compute = DTYPES[dtype]
    if compute == torch.float32:
        return Precision(compute, compute, compute)
    if full_finetune:
        master = torch.float32 if compute == torch.float16 else compute
        return Precision(compute, weights=master, trainable=master)
    return Precision(compute, weights=compute, trainable=torch.float32)


def cast_trainable(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Store every trainable parameter in ``dtype`` (frozen ones are left alone)."""
    for param in model.parameters():
        if param.requires_grad and param.dtype != dtype and param.is_floating_point():
            param.data = param.data.to(dtype)
