"""Attention backends: what each one can do (``hone.config.attention``, import-free, owned by the config),
how a loaded model is fitted to the machine (``setup``), and how packed rows reach it.

Every backend plugs in through transformers' ``AttentionInterface`` / ``AttentionMaskInterface``
registries, selected by ``attn_implementation``; hone patches no model code. Packed
micro-batches carry ``position_ids`` that restart at 0 for every document and the documents'
boundaries (``cu_seqlens``). Varlen kernels take the boundaries: hone's own ``sdpa`` variant
(``varlen``, torch's per-document kernel, chosen for packed sdpa runs where it can run) and
flash attention (hone's variant also takes shared-prompt preference pairs, as segments with
their keys gathered: ``layout``'s ``tree_boundaries``). For sdpa elsewhere and flex_attention
hone builds the document mask itself,
once per micro-batch (``packed_mask``); eager and sliding-window models get their mask from
transformers, which reads it from the positions. Under context parallelism (``ulysses``) a
backend wraps the model's kernel, trading a slice of the positions for a share of the heads
around it; the kernel inside decides what packed rows carry (``wrapped``).
"""
