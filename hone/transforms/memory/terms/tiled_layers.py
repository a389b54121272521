"""Tiled layers (``memory.tiled_layers``, under ``full`` or ``offload``): the layer rebuilt in
the backward holds one chunk's activations plus the whole sequence's key/value state."""

from typing import Literal

from hone.config.memory import INPUT_ONLY_POLICIES
from hone.transforms.memory.facts import ModelFacts
from hone.transforms.memory.layers import step_layer_bytes
from hone.transforms.memory.step import Step

#: ``memory.tiled_layers: auto``'s chunk: about this many tokens per chunk of a tiled layer
#: (large enough that each chunk's matmuls and attention run at full speed, small enough that one
#: chunk's activations are a few GiB for an 8B model).
TILED_LAYER_CHUNK_TOKENS = 32_768


def auto_layer_chunks(sequence_len: int) -> int:
    """``memory.tiled_layers: auto``'s chunk count: about :data:`TILED_LAYER_CHUNK_TOKENS` tokens
    of each row per chunk; at least 2."""
    return max(2, -(-sequence_len // TILED_LAYER_CHUNK_TOKENS))


def tiled_layer_state_bytes(m: ModelFacts, tokens: int) -> int:
    """What a tiled layer (:mod:`hone.transforms.tiled_layers`) holds for the whole sequence while
    its backward walks the chunks: the keys and values of every position ([tokens x kv width],
    compute dtype), their gradient sums (float32), the prefix of keys and values each chunk
    attends to (copied together with the chunk's own) and its gradient, once per group of query
    heads sharing a key head (they are attended one group at a time) plus the running sum. The
    layer's input gradient it fills chunk by chunk is the one any layer's backward produces
    (counted with the residual stream's gradient). Measured: qwen3-8b at 256K tokens in 8 chunks
    peaked at 41.6 GiB against 39.1 GiB estimated (H100)."""
    c, kv = m.compute_bytes, m.kv_heads * m.head_dim
    groups = max(1, m.heads // max(m.kv_heads, 1))
    return tokens * 2 * kv * (c + 4 + c + (groups + 1) * c)


def layer_chunks(asked: int | Literal["auto"], policy: str, sequence_len: int) -> int:
    """The chunks each layer is computed in: ``asked``, or :func:`auto_layer_chunks` for ``auto``;
    0 (whole) below 2 and under any policy but ``full`` and ``offload`` (tiled layers are a form
    of full checkpointing)."""
    chunks = auto_layer_chunks(sequence_len) if asked == "auto" else int(asked)
    return 0 if chunks < 2 or policy not in INPUT_ONLY_POLICIES else chunks


def rebuilt_chunk_bytes(m: ModelFacts, step: Step) -> int:
    """The term (replaces the policy's recompute when the layers are tiled): the layer rebuilt in
    the backward holds one chunk's activations and the whole sequence's key/value state
    (:func:`tiled_layer_state_bytes`)."""
    chunk = max(step_layer_bytes(step, layer, m).at(step.piece, step.sequence_len) for layer in m.distinct_layers)
    return chunk + tiled_layer_state_bytes(m, step.tokens)
