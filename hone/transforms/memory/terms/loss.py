"""The loss's bytes at its peak. The standard loss upcasts the [tokens x vocab] logits to float32;
at its peak the logits, the float32 log-softmax, its incoming gradient and its input gradient are
alive (``compute + 12`` bytes per logit). The fused linear cross-entropy holds one chunk of tokens.
"""

from hone.transforms.memory.facts import ModelFacts
from hone.transforms.memory.knobs import LossKind


def fused_chunk_tokens(tokens: int, vocab: int, sequences: bool = False, head_trained: bool = True) -> int:
    """Tokens per chunk of the fused linear cross-entropy, or (``sequences``: a preference
    objective's per-sequence log-probs, :mod:`hone.kernels.sequence_logprobs`) of its sibling,
    whose chunk is half as large under a frozen head: each kernel's own choice."""
    if sequences:
        from hone.kernels.sequence_logprobs import default_sequence_chunk_tokens

        return default_sequence_chunk_tokens(tokens, vocab, head_trained)
    from hone.kernels.cross_entropy import default_chunk_tokens

    return default_chunk_tokens(tokens, vocab)


def loss_bytes(m: ModelFacts, tokens: int, kind: LossKind, device: str = "cuda", sequences: bool = False) -> int:
    """Bytes the loss holds at its peak, beyond the layers' activations (``sequences``: a
    preference objective, whose per-sequence log-probs chunk as :func:`fused_chunk_tokens` says)."""
    c, v, h = m.compute_bytes, m.vocab, m.hidden
    if kind == "standard":
        # logits (compute dtype) + float32 log-softmax + its incoming and outgoing gradients
        # (in float32 runs the upcast is the logits themselves: 4 + 12 either way)
        return tokens * v * (c + 12) + (c * tokens * h if m.head_trainable else 0)
    # hone.kernels.cross_entropy, inside its forward: the hidden states it reads and the
    # gradient it writes for them ([tokens x hidden] each), one chunk's logits -- overwritten in
    # place by their gradient with the Triton step (CUDA); with the torch step a float32 copy
    # and a downcast gradient beside them -- and a trained head's float32 gradient and its cast
    chunk = fused_chunk_tokens(tokens, v, sequences, m.head_trainable)
    per_chunk = chunk * v * (c if device == "cuda" else 2 * c + 4)
    head_grad = (4 + c) * v * h if m.head_trainable else 0
    return 2 * c * tokens * h + per_chunk + head_grad
