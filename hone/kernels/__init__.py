"""Pure kernels: functions on tensors, each beside a plain-PyTorch reference it is tested against.

Nothing here knows about models, configs or the training loop (DESIGN.md, "Kernels are pure"):
the transforms decide where a kernel is used. Ops that ``torch.compile`` must trace through are
``torch.library`` custom ops with fake implementations and autograd formulas.
"""

from hone.kernels.cross_entropy import (
    DEFAULT_LOGITS_BUDGET_BYTES,
    KernelUnavailableError,
    default_chunk_tokens,
    fused_linear_cross_entropy,
    linear_cross_entropy_reference,
)
from hone.kernels.cross_entropy_triton import triton_available
from hone.kernels.sequence_logprobs import segment_token_counts, sequence_logprobs, sequence_logprobs_reference

__all__ = [
    "DEFAULT_LOGITS_BUDGET_BYTES",
    "KernelUnavailableError",
    "default_chunk_tokens",
    "fused_linear_cross_entropy",
    "linear_cross_entropy_reference",
    "segment_token_counts",
    "sequence_logprobs",
    "sequence_logprobs_reference",
    "triton_available",
]
