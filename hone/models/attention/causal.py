"""sdpa for training batches whose only mask is causality: transformers builds no mask at all.

Given no ``attention_mask``, transformers still prepares one for sdpa on every forward: it reads
the ``position_ids`` on the host to find out whether the batch is packed (``.all()`` on a device
tensor: the host waits for the embedding kernel before it can launch the first layer), and with
a padding mask it checks on the host whether the mask may be dropped. For hone's micro-batches
the answer is known before the forward: an unpacked row's tokens attend to every earlier token
of the row, and padding only ever follows a row's real tokens (``hone.data.collate`` pads on the
right), so causal attention alone gives every real token the attention it would get under the
padding mask; padded positions carry no loss. Packed rows reach this backend with hone's own 4D
document mask, which transformers passes through unchanged.

hone registers :data:`CAUSAL_SDPA` with ``AttentionInterface`` only: a backend without a mask
function is one transformers prepares no mask for (its documented path for custom kernels), so
each layer gets ``attention_mask=None`` (or hone's 4D mask) and calls sdpa with ``is_causal``,
the same kernel (cuDNN / flash) transformers' sdpa picks for an unmasked batch. Nothing else
changes, so the backend is chosen for training runs only, on models whose layers all attend
causally to the whole row (no sliding windows, chunked or bidirectional attention): see
:func:`hone.models.attention.setup.select_attention_kernel`.
"""

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

#: The name the backend is registered under with transformers.
CAUSAL_SDPA = "hone_sdpa_causal"


def causal_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: [B, H, T, D] in, ([B, T, H, D], None) out.

    ``attention_mask`` is None (causal) or a ready 4D mask (hone's packed document mask). A
    query shorter than its keys means a KV cache, i.e. generation, which needs transformers'
    own masks (left padding, offsets): refused rather than computed without them.
    """
    if query.shape[2] != key.shape[2]:
        raise ValueError(
            f"{CAUSAL_SDPA} is hone's training attention (no mask is prepared for it): it takes no KV "
            f"cache (query length {query.shape[2]}, key length {key.shape[2]}); generate with "
            "attn_implementation 'sdpa'"
        )
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def register_causal_sdpa() -> str:
    """Make :data:`CAUSAL_SDPA` a valid ``attn_implementation`` (idempotent); returns the name.
    No ``AttentionMaskInterface`` entry, on purpose (module docstring)."""
    AttentionInterface.register(CAUSAL_SDPA, causal_sdpa_attention)
    return CAUSAL_SDPA
