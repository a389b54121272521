"""The training loss, computed by hone rather than by the model.

Models average their loss over the tokens of *one* forward call; with gradient accumulation
that weights a short micro-batch's tokens more than a long one's, so ``4 x 1`` and ``1 x 4``
would give different updates. hone takes the **sum** of per-token losses of each micro-batch
and divides it by the trained tokens of the whole accumulation window, counted before the
first backward pass (the training loop, :mod:`hone.train`).

The forward stops at the decoder's last hidden states (:func:`hone.runtime.step.forward_hidden`);
the run's loss function (:data:`~hone.runtime.step.LossFn`, supplied by the loss transform)
takes them with the output head. The standard one here computes the logits and upcasts them to
float32 (bf16 log-softmax over a large vocabulary loses digits that matter at the end of
training); a fused one (:mod:`hone.kernels.cross_entropy`) gives the same numbers without ever
holding them.
"""

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hone.data.collate import IGNORE_INDEX, MicroBatch
from hone.models.structure import causal_lm_parts
from hone.runtime.step import forward_hidden


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross entropies over positions whose target is not -100.

    ``logits`` [B, T, V] and ``targets`` [B, T] are aligned (targets already shifted, see
    :mod:`hone.data.collate`).
    """
    vocab = logits.shape[-1]
    return F.cross_entropy(
        logits.float().reshape(-1, vocab),
        targets.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def logit_postprocess(config: Any) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """What a causal LM does to ``head(hidden)`` before its loss, read from its config; None
    for the plain projection (Llama, Qwen, Mistral, ...). Gemma 2 soft-caps the logits, Cohere
    scales them, Granite divides them: a loss that starts from the hidden states must do the same."""
    cap = getattr(config, "final_logit_softcapping", None)
    scale = getattr(config, "logit_scale", None)
    divide = getattr(config, "logits_scaling", None)
    if cap is None and scale in (None, 1.0) and divide in (None, 1.0):
        return None

    def post(logits: torch.Tensor) -> torch.Tensor:
        if scale not in (None, 1.0):
            logits = logits * scale
        if divide not in (None, 1.0):
            logits = logits / divide
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    return post


def standard_loss(
    post: Callable[[torch.Tensor], torch.Tensor] | None = None,
    compile_fn: Callable[[Callable], Callable] | None = None,
):
    """The plain loss: logits from the head, upcast to float32, summed cross entropy.
    ``compile_fn`` compiles its tensor part (``torch.compile``: the logits never written out whole)."""

    def token_loss(hidden: torch.Tensor, head: nn.Module, targets: torch.Tensor) -> torch.Tensor:
        logits = head(hidden)
        if post is not None:
            logits = post(logits)
        return token_loss_sum(logits, targets)

    inner = compile_fn(token_loss) if compile_fn is not None else token_loss

    def loss_fn(hidden: torch.Tensor, head: nn.Module, batch: MicroBatch) -> torch.Tensor:
        return inner(hidden, head, batch.targets)

    return loss_fn


def forward_logits(model: nn.Module, batch: MicroBatch, autocast_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The model's logits for ``batch`` (tests and tools that need them whole; training and
    eval go through :func:`hone.runtime.step.micro_batch_loss`). A packed batch without
    attention inputs gets those of the model's current kernel."""
    if batch.packed and not batch.attention_inputs:
        from hone.models.attention.layout import layout_for

        batch = batch.with_attention(layout_for(model))
    decoder, head = causal_lm_parts(model)
    hidden = forward_hidden(decoder, batch, autocast_dtype)
    post = logit_postprocess(getattr(model, "config", None))
    logits = head(hidden)
    return post(logits) if post is not None else logits
