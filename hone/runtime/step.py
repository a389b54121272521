"""The module the training loop calls once per micro-batch, and the contracts around it.

hone's loss starts from the decoder's last hidden states (the loss transform's :data:`LossFn`
takes them with the output head), so the model's own ``forward`` is never called in training. A
data-parallel engine, though, acts on a module's ``forward``: DDP prepares its gradient
reduction there, FSDP2's root gathers its parameters there. :class:`MicroBatchLoss` gives them
one: its ``forward(batch)`` is the micro-batch's sum of token losses. It owns no parameters of
its own (``model`` is registered as its only child), so wrapping it changes nothing in the
numbers. A ``wrap_step`` transform returns a :class:`StepModule` around it.
"""

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from hone.data.collate import MicroBatch
from hone.models.structure import causal_lm_parts

#: ``loss_fn(hidden [B, T, H], head, targets [B, T]) -> (sum of token losses, float32 scalar;
#: trained tokens, a scalar tensor)``. ``head`` is the model's output projection module; targets
#: are already shifted, -100 where there is no loss.
LossFn = Callable[[torch.Tensor, nn.Module, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]

#: ``step_context(batch)`` returns the context manager one micro-batch's forward+backward runs in.
StepContext = Callable[[MicroBatch], AbstractContextManager]


def forward_hidden(decoder: nn.Module, batch: MicroBatch, autocast_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The decoder's last hidden states [B, T, H] for ``batch`` (its attention inputs attached),
    under ``torch.autocast`` when the precision needs it (float32 trainable weights beside
    bf16/fp16 compute, see :mod:`hone.models.precision`)."""
    inputs = batch.model_inputs()
    if autocast_dtype is None:
        return decoder(**inputs, use_cache=False).last_hidden_state
    with torch.autocast(batch.input_ids.device.type, dtype=autocast_dtype):
        return decoder(**inputs, use_cache=False).last_hidden_state


def micro_batch_loss(
    model: nn.Module, batch: MicroBatch, loss_fn: LossFn, autocast_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Sum of the token losses of ``batch`` (float32 scalar on the device; no host sync)."""
    decoder, head = causal_lm_parts(model)
    hidden = forward_hidden(decoder, batch, autocast_dtype)
    if autocast_dtype is None:
        loss_sum, _ = loss_fn(hidden, head, batch.targets)
    else:  # the head's matmul in the compute dtype, as the model's own forward does
        with torch.autocast(batch.input_ids.device.type, dtype=autocast_dtype):
            loss_sum, _ = loss_fn(hidden, head, batch.targets)
    return loss_sum


class MicroBatchLoss(nn.Module):
    """``MicroBatchLoss(model, loss_fn, autocast_dtype)(batch) -> sum of the token losses``
    (a float32 scalar on the device, no host sync)."""

    def __init__(self, model: nn.Module, loss_fn: LossFn, autocast_dtype: torch.dtype | None = None):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.autocast_dtype = autocast_dtype

    def forward(self, batch: MicroBatch) -> torch.Tensor:
        return micro_batch_loss(self.model, batch, self.loss_fn, self.autocast_dtype)


@dataclass(frozen=True)
class StepModule:
    """What the loop calls once per micro-batch: ``module(batch) -> sum of its token losses``.

    Without data parallelism ``module`` is :class:`MicroBatchLoss` (the model and the run's
    loss). A ``wrap_step`` transform returns a new one around it (e.g. DDP), whose gradients
    after the window's last backward are the **sum** over all ranks (each rank's loss is already
    divided by the global token count, so the sum is the global mean's gradient).
    """

    module: nn.Module
    no_sync: Callable[[], AbstractContextManager] = nullcontext
    """Entered around the forward and backward of every micro-batch of a window but the last:
    gradients accumulate on each rank and are reduced once per optimizer step."""
