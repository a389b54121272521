"""The training loss, computed by hone rather than by the model.

Models average their loss over the tokens of *one* forward call; with gradient accumulation
that weights a short micro-batch's tokens more than a long one's, so ``4 x 1`` and ``1 x 4``
would give different updates. hone takes the **sum** of per-token losses of each micro-batch
and divides it by the trained tokens of the whole accumulation window, counted before the
first backward pass. Logits are upcast to float32 first: bf16 log-softmax over a large
vocabulary loses digits that matter at the end of training.
"""

import torch
import torch.nn.functional as F
from torch import nn

from hone.models.attention.packed_mask import packed_attention_mask, takes_document_boundaries
from hone.train.collate import IGNORE_INDEX, MicroBatch


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross entropies over positions whose target is not -100.

    ``logits`` [B, T, V] and ``targets`` [B, T] are aligned (targets already shifted, see
    :mod:`hone.train.collate`).
    """
    vocab = logits.shape[-1]
    return F.cross_entropy(
        logits.float().reshape(-1, vocab),
        targets.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def forward_logits(model: nn.Module, batch: MicroBatch, autocast_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The model's logits for ``batch``, under ``torch.autocast`` when the precision needs it
    (float32 trainable weights beside bf16/fp16 compute, see :mod:`hone.models.precision`)."""
    inputs = batch.model_inputs()
    if batch.packed and takes_document_boundaries(model):
        inputs.update(batch.boundaries())
    elif batch.packed and batch.position_ids is not None:
        mask = packed_attention_mask(model, batch.position_ids)  # once per micro-batch, all layers
        if mask is not None:
            inputs["attention_mask"] = mask
    if autocast_dtype is None:
        return model(**inputs, use_cache=False).logits
    with torch.autocast(batch.input_ids.device.type, dtype=autocast_dtype):
        return model(**inputs, use_cache=False).logits
