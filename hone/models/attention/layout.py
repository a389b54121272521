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
from hone.models.attention.varlen import TREE_KEYS, VARLEN_SDPA, boundaries_only_mask
from hone.models.attention.wrapped import inner_implementation

Kind = Literal["boundaries", "tree_boundaries", "block_mask", "dense_mask", "transformers"]
#: The layouts that can keep a shared prompt's branches apart: hone's masks, and hone's varlen
#: backend given the branches as segments with their keys' order (``tree_boundaries``).
SHARING_KINDS = ("tree_boundaries", "block_mask", "dense_mask")


@dataclass(frozen=True)
class AttentionLayout:
    kind: Kind
    """``boundaries``: ``cu_seq_lens``/``max_length`` kwargs; ``tree_boundaries``: the same for
    hone's varlen backend, shared-prompt pairs as segments with their gathered keys
    (:class:`~hone.data.collate.TreeBoundaries`); ``block_mask``: a flex BlockMask;
    ``dense_mask``: a [B, 1, T, T] boolean mask; ``transformers``: leave it to the model."""

    shares_prompt: bool = False
    """Preference pairs are built with each prompt once and two branches
    (:mod:`hone.data.pairs`), which only hone's masks and its varlen backend express."""

    boundaries_only: bool = False
    """The boundaries go with :func:`~hone.models.attention.varlen.boundaries_only_mask`: the
    model's backend is hone's varlen one itself (not wrapped), which reads that as no mask, so
    transformers skips its mask preparation and the host sync in it."""

    def __post_init__(self) -> None:
        if self.shares_prompt and self.kind not in SHARING_KINDS:
            raise ValueError(
                f"shared-prompt pairs need hone's mask (sdpa or flex attention) or its varlen backend, not the {self.kind} layout"
            )

    def packed_inputs(
        self, position_ids: torch.Tensor, boundaries: dict[str, Any], branches: torch.Tensor | None = None
    ) -> dict[str, Any]:
        """The extra forward kwargs of a packed micro-batch under this layout (``branches``: a
        shared-prompt batch's, which the masks keep apart)."""
        if branches is not None and self.kind not in SHARING_KINDS:
            raise ValueError(
                f"a shared-prompt micro-batch reached the {self.kind} attention layout, which cannot isolate its branches"
            )
        if self.kind == "tree_boundaries" and branches is not None and TREE_KEYS not in boundaries:
            raise ValueError("a shared-prompt micro-batch reached the varlen layout without its tree boundaries")
        if self.kind in ("boundaries", "tree_boundaries"):
            if self.boundaries_only:
                return {**boundaries, "attention_mask": boundaries_only_mask(position_ids.device)}
            return boundaries
        if self.kind == "block_mask":
            return {"attention_mask": document_block_mask(position_ids, branches)}
        if self.kind == "dense_mask":
            return {"attention_mask": document_dense_mask(position_ids, branches)}
        return {}


def layout_for(model: Any, shares_prompt: bool = False) -> AttentionLayout:
    """The layout of ``model`` as its attention backend now stands (after kernel selection);
    ``shares_prompt``: the plan builds shared-prompt pairs (it chose a backend with hone's mask)."""
    if takes_document_boundaries(model):
        hones = inner_implementation(model.config._attn_implementation) == VARLEN_SDPA
        kind = "tree_boundaries" if shares_prompt and hones else "boundaries"
        return AttentionLayout(kind, shares_prompt, boundaries_only=model.config._attn_implementation == VARLEN_SDPA)
    if uses_own_document_mask(model):
        kind = "block_mask" if inner_implementation(model.config._attn_implementation) == "flex_attention" else "dense_mask"
        return AttentionLayout(kind, shares_prompt)
    return AttentionLayout("transformers", shares_prompt)
