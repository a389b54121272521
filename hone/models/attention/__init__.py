"""Attention backends: what each one can do (``capabilities``, import-free, read by the config)
and how a loaded model is set up to use it (``setup``).

Every backend is transformers' own implementation selected through ``attn_implementation``
(its ``AttentionInterface`` / ``AttentionMaskInterface`` registries); hone patches no model
code. Packed micro-batches reach them through the official packed-sequence path: the model is
called with ``position_ids`` that restart at 0 for every document and no 2D ``attention_mask``,
from which transformers builds, once per forward and shared by every layer, a block-diagonal
causal mask (eager, sdpa), a document + causal ``BlockMask`` (flex_attention) or varlen
boundaries (flash attention).
"""
