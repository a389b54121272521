"""The module the training loop calls once per micro-batch: the model together with its loss.

hone's loss starts from the decoder's last hidden states (the loss transform's function takes
them with the output head), so the model's own ``forward`` is never called in training. A
data-parallel engine, though, acts on a module's ``forward``: DDP prepares its gradient
reduction there, FSDP2's root gathers its parameters there. :class:`MicroBatchLoss` gives them
one: its ``forward(batch)`` is the micro-batch's sum of token losses. It owns no parameters of
its own (``model`` is registered as its only child), so wrapping it changes nothing in the
numbers, and the plain loop calls it exactly as it called :func:`micro_batch_loss`.
"""

import torch
from torch import nn

from hone.train.collate import MicroBatch
from hone.train.loss import micro_batch_loss


class MicroBatchLoss(nn.Module):
    """``MicroBatchLoss(model, loss_fn, autocast_dtype)(batch) -> sum of the token losses``
    (a float32 scalar on the device, no host sync)."""

    def __init__(self, model: nn.Module, loss_fn, autocast_dtype: torch.dtype | None = None):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.autocast_dtype = autocast_dtype

    def forward(self, batch: MicroBatch) -> torch.Tensor:
        return micro_batch_loss(self.model, batch, self.loss_fn, self.autocast_dtype)
