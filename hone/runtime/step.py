"""The module the training loop calls once per micro-batch, and the contracts around it.

hone's loss starts from the decoder's last hidden states (the loss transform's :data:`LossFn`
takes them with the output head), so the model's own ``forward`` is never called in training. A
data-parallel engine, though, acts on a module's ``forward``: DDP prepares its gradient
reduction there, FSDP2's root gathers its parameters there. :class:`MicroBatchLoss` gives them
one: its ``forward(batch)`` is the micro-batch's sum of token losses. It owns no parameters of
its own (``model`` is registered as its only child), so wrapping it changes nothing in the
numbers. A ``wrap_step`` transform returns a :class:`StepModule` around it.

Preference pairs: the loss function returns a vector of sums (:mod:`hone.runtime.pair_loss`),
and where it has a reference (DPO, IPO under LoRA: :class:`ReferencePass`) the reference's
log-probabilities are computed first, in the same micro-batch, by the same model with its
adapter(s) switched off and without gradients (:func:`with_reference`).
"""

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from hone.data.collate import MicroBatch
from hone.models.structure import causal_lm_parts

#: ``loss_fn(hidden [B, T, H], head, batch) -> sums``: float32, the sum of the token losses (a
#: scalar) for SFT rows, or a preference micro-batch's vector of sums (:mod:`hone.runtime.pair_loss`);
#: the loop divides them by the window's counts. ``head`` is the model's output projection module;
#: ``batch.targets`` are already shifted, -100 where there is no loss.
LossFn = Callable[[torch.Tensor, nn.Module, MicroBatch], torch.Tensor]


@runtime_checkable
class ReferencePass(Protocol):
    """A loss function that needs the reference model's log-probabilities of each pair micro-batch."""

    reference_off: Callable[[], AbstractContextManager] | None
    """Switches the model's adapter(s) off (None: the batches bring precomputed ones, or none are needed)."""

    def reference_logps(self, hidden: torch.Tensor, head: nn.Module, batch: MicroBatch) -> torch.Tensor: ...


#: ``step_context(batch)`` returns the context manager one micro-batch's forward+backward runs in.
StepContext = Callable[[MicroBatch], AbstractContextManager]


def begin_pass() -> None:
    """Tell Inductor's CUDA graphs that a new pass over the layers starts (harmless without them).

    Left to itself, cudagraph trees start a new generation at every entry into a compiled region
    that has no backward pending. A pass without grad (the reference's forward, eval) through
    regionally compiled layers therefore starts one per layer. The next layer's replay may then
    overwrite the output it is reading: an H200 DPO step failed so. With a mark per pass, a
    generation is one pass. Training passes change nothing: their generation already starts at
    their first layer, a backward pending after it."""
    torch.compiler.cudagraph_mark_step_begin()


def forward_hidden(decoder: nn.Module, batch: MicroBatch, autocast_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The decoder's last hidden states [B, T, H] for ``batch`` (its attention inputs attached),
    under ``torch.autocast`` when the precision needs it (float32 trainable weights beside
    bf16/fp16 compute, see :mod:`hone.models.precision`)."""
    inputs = batch.model_inputs()
    if not torch.compiler.is_compiling():
        begin_pass()
    if autocast_dtype is None:
        return decoder(**inputs, use_cache=False).last_hidden_state
    with torch.autocast(batch.input_ids.device.type, dtype=autocast_dtype):
        return decoder(**inputs, use_cache=False).last_hidden_state


def _head_context(batch: MicroBatch, autocast_dtype: torch.dtype | None) -> AbstractContextManager:
    """The head's matmul in the compute dtype under autocast, as the model's own forward does."""
    if autocast_dtype is None:
        return nullcontext()
    return torch.autocast(batch.input_ids.device.type, dtype=autocast_dtype)


def with_reference(
    decoder: nn.Module, head: nn.Module, batch: MicroBatch, loss_fn: LossFn, autocast_dtype: torch.dtype | None = None
) -> MicroBatch:
    """``batch`` with the reference's completion log-probs attached, where ``loss_fn`` needs them
    and the batch does not bring them: one forward of the same model with its adapter(s) switched
    off, under ``torch.no_grad`` (nothing of it is kept for the backward)."""
    if not batch.pairs or batch.reference_logps is not None or not isinstance(loss_fn, ReferencePass):
        return batch
    if loss_fn.reference_off is None:
        return batch
    with torch.no_grad(), loss_fn.reference_off():
        hidden = forward_hidden(decoder, batch, autocast_dtype)
        with _head_context(batch, autocast_dtype):
            logps = loss_fn.reference_logps(hidden, head, batch)
    return replace(batch, reference_logps=logps)


def decoder_head_loss(
    decoder: nn.Module, head: nn.Module, batch: MicroBatch, loss_fn: LossFn, autocast_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """The loss sums of ``batch`` (see :data:`LossFn`) through ``decoder`` and ``head``: the
    reference pass first where the loss needs one, then the policy's forward."""
    batch = with_reference(decoder, head, batch, loss_fn, autocast_dtype)
    hidden = forward_hidden(decoder, batch, autocast_dtype)
    with _head_context(batch, autocast_dtype):
        return loss_fn(hidden, head, batch)


def micro_batch_loss(
    model: nn.Module, batch: MicroBatch, loss_fn: LossFn, autocast_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """The loss sums of ``batch``: the sum of its token losses (float32 scalar on the device; no
    host sync), or a pair micro-batch's vector of sums."""
    decoder, head = causal_lm_parts(model)
    return decoder_head_loss(decoder, head, batch, loss_fn, autocast_dtype)


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
