"""How a packed micro-batch reaches the attention: boundaries for varlen kernels, else the
document mask built by hone once per micro-batch (sdpa and flex).

Varlen kernels (hone's :data:`~hone.models.attention.varlen.VARLEN_SDPA`, flash attention)
take the documents' boundaries (``cu_seqlens``) and need no mask at all.

transformers can derive a document mask from restarting ``position_ids`` itself, but it
decides per batch whether a batch is packed at all: a packed row that one document fills
exactly looks unpacked and gets a plain causal mask of another kind (for sdpa none at all),
and every compiled attention layer recompiles (seen on the GPU: 7-9 s inside a timed window
with flex). Handing the model a mask of hone's own keeps one mask kind for every batch:
transformers passes a ready 4D tensor or ``BlockMask`` ``attention_mask`` through unchanged
(its documented behaviour in ``masking_utils``). Models with sliding-window layers keep
transformers' own path, which combines the document mask with each layer's window; eager
keeps it too (it wants an additive float mask, and is not the backend to compile).
"""

from typing import Any

import torch

from hone.models.attention.causal import CAUSAL_SDPA
from hone.models.attention.varlen import VARLEN_SDPA
from hone.models.attention.wrapped import inner_implementation

#: Backends that get hone's mask on packed batches.
OWN_MASK_BACKENDS = ("sdpa", CAUSAL_SDPA, "flex_attention")
#: Backends that get the document boundaries instead of a mask.
BOUNDARY_BACKENDS = (VARLEN_SDPA, "flash_attention_2", "flash_attention_3")


def takes_document_boundaries(model: Any) -> bool:
    """Whether packed batches for ``model`` go in as boundaries (varlen kernels), not a mask
    (read through a context-parallel wrapper: the kernel inside decides)."""
    return inner_implementation(getattr(getattr(model, "config", None), "_attn_implementation", None)) in BOUNDARY_BACKENDS


def uses_own_document_mask(model: Any) -> bool:
    """Whether packed batches for ``model`` get hone's mask: sdpa or flex attention, and no
    sliding windows (one mask serves every layer only when all layers attend the same way)."""
    config = getattr(model, "config", None)
    if config is None or inner_implementation(getattr(config, "_attn_implementation", None)) not in OWN_MASK_BACKENDS:
        return False
    return all_layers_attend_fully(config)


def all_layers_attend_fully(config: Any) -> bool:
    """Whether every layer of a model with ``config`` attends to all earlier tokens (no
    sliding-window layers), so one document mask or one set of boundaries serves them all."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return all(kind == "full_attention" for kind in layer_types)
    return getattr(config, "sliding_window", None) is None or not getattr(config, "use_sliding_window", True)


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """[B, T] index of the document each token belongs to (a new one wherever positions restart
    at 0; a row's padding tail is one more document that no real token sees)."""
    return torch.cumsum((position_ids == 0).to(torch.int32), dim=1)


def document_block_mask(position_ids: torch.Tensor, branches: torch.Tensor | None = None):
    """A causal, document-isolating flex ``BlockMask`` for packed rows; with ``branches``
    (shared-prompt pairs, :mod:`hone.data.pairs`) a branch also never sees the other branch:
    a token attends to an earlier key of its document that is in the trunk (0) or its own branch."""
    from torch.nn.attention.flex_attention import create_block_mask

    docs = document_ids(position_ids)
    batch, width = docs.shape

    def same_document_causal(b, h, q, kv):
        return (docs[b, q] == docs[b, kv]) & (q >= kv)

    def same_branch_causal(b, h, q, kv):
        return same_document_causal(b, h, q, kv) & ((branches[b, kv] == 0) | (branches[b, kv] == branches[b, q]))

    mask_mod = same_document_causal if branches is None else same_branch_causal
    return create_block_mask(mask_mod, batch, None, width, width, device=position_ids.device)


def document_dense_mask(position_ids: torch.Tensor, branches: torch.Tensor | None = None) -> torch.Tensor:
    """The same mask as a [B, 1, T, T] boolean tensor (True = attend), as sdpa takes it."""
    docs = document_ids(position_ids)
    width = docs.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool, device=docs.device).tril()
    mask = (docs[:, :, None] == docs[:, None, :]) & causal
    if branches is not None:
        mask &= (branches[:, None, :] == 0) | (branches[:, None, :] == branches[:, :, None])
    return mask[:, None]
