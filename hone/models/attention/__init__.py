"""Attention backends: what each one can do (``capabilities``, import-free, read by the config)
and how a loaded model is set up to use it (``setup``).

Every backend is transformers' own implementation selected through ``attn_implementation``
(its ``AttentionInterface`` / ``AttentionMaskInterface`` registries); hone patches no model
code. Packed micro-batches carry ``position_ids`` that restart at 0 for every document. For
sdpa and flex_attention hone builds the document mask itself, once per micro-batch
(``packed_mask``), and passes it as ``attention_mask``; for eager and sliding-window models the
model gets no 2D mask and transformers builds it from the positions; flash attention gets
varlen boundaries (``cu_seq_lens_*``).
"""
