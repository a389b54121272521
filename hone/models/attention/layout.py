"""How packed micro-batches reach the attention of one loaded model, decided once.

The attention transform picks the kernel; this layout, derived from the model it leaves
behind, says what a packed micro-batch must carry for that kernel: the document boundaries
(varlen kernels), hone's own document mask (sdpa, flex), or nothing beyond restarting
``position_ids`` (backends that handle packing themselves, e.g. eager or sliding-window models).
Unpacked batches carry their padding mask, whatever the kernel. The loop attaches the layout's
inputs to each micro-batch after moving it to the device; the loss never sees attention.
"""

from dataclasses import dataclass
from typing import Any, Literal

import torch

from hone.models.attention.packed_mask import (
    document_block_mask,
    document_dense_mask,
    takes_document_boundaries,
    uses_own_document_mask,
)
from hone.models.attention.wrapped import inner_implementation

Kind = Literal["boundaries", "block_mask", "dense_mask", "transformers"]


@dataclass(frozen=True)
class AttentionLayout:
    kind: Kind
    """``boundaries``: ``cu_seq_lens``/``max_length`` kwargs; ``block_mask``: a flex BlockMask;
    ``dense_mask``: a [B, 1, T, T] boolean mask; ``transformers``: leave it to the model."""

    def packed_inputs(self, position_ids: torch.Tensor, boundaries: dict[str, Any]) -> dict[str, Any]:
        """The extra forward kwargs of a packed micro-batch under this layout."""
        if self.kind == "boundaries":
            return boundaries
        if self.kind == "block_mask":
            return {"attention_mask": document_block_mask(position_ids)}
        if self.kind == "dense_mask":
            return {"attention_mask": document_dense_mask(position_ids)}
        return {}


def layout_for(model: Any) -> AttentionLayout:
    """The layout of ``model`` as its attention backend now stands (after kernel selection)."""
    if takes_document_boundaries(model):
        return AttentionLayout("boundaries")
    if uses_own_document_mask(model):
        kind = "block_mask" if inner_implementation(model.config._attn_implementation) == "flex_attention" else "dense_mask"
        return AttentionLayout(kind)
    return AttentionLayout("transformers")
