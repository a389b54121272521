"""Context parallelism inside attention: the model's own kernel over the whole sequence, for
``H / N`` of the heads on each of ``N`` ranks (DeepSpeed-Ulysses).

Under context parallelism every rank runs the decoder on its contiguous ``T / N`` positions of
each row (:func:`hone.parallel.context_parallel.shard_micro_batch`); the projections, RoPE (on
the rank's own global positions), norms and MLP need nothing else. The attention function does:
q, k, v arrive as ``[B, H, T/N, D]``; :func:`~hone.parallel.context_parallel.seq_to_heads`
trades them for ``[B, H/N, T, D]`` (block ``j`` of the query heads and block ``j`` of the key /
value heads on rank ``j``: with grouped-query attention the query heads of a block read exactly
its key/value heads); the wrapped kernel attends over the whole sequence with the mask or the
document boundaries the batch carries (hone's packed-row inputs, built over the whole sequence
before the batch was sharded; none for padded rows: right padding under causal attention needs
no mask); :func:`~hone.parallel.context_parallel.heads_to_seq` trades the output back to
``[B, T/N, H, D]``. Heads are independent, so the result is the one-process result.

:func:`enable_context_parallel` marks each attention module with its :class:`ContextShard`
(:data:`CONTEXT_SHARD_ATTR`) and switches the model to the wrapping backend registered with
transformers' ``AttentionInterface`` under a name of :data:`~hone.models.attention.wrapped.ULYSSES_NAMES`.
It registers no mask function, so transformers prepares no mask from the rank's local length.
No transformers code is patched.

What the wrapper cannot keep exact is refused by :func:`context_parallel_problems`: head counts
``N`` does not divide; masks transformers would build from the local length (eager, flex
attention's ``BlockMask``, sliding windows, chunked or bidirectional attention, sinks); the
flash backends (transformers picks the flash kernel by the backend's name, which a wrapper
cannot carry; hone's varlen sdpa runs torch's FlashAttention-2 for packed rows instead); tiled
decoder layers (their attention goes chunk by chunk of the rank's slice).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from hone.models.attention.causal import CAUSAL_SDPA, causal_sdpa_attention
from hone.models.attention.setup import causal_blockers
from hone.models.attention.varlen import VARLEN_SDPA, varlen_sdpa_attention
from hone.models.attention.wrapped import ULYSSES_NAMES, inner_implementation
from hone.models.errors import ModelError
from hone.models.structure import decoder_layers, unwrap_peft
from hone.parallel.context_parallel import ContextShard, heads_to_seq, seq_to_heads, seqs_to_heads

__all__ = [
    "CONTEXT_SHARD_ATTR",
    "ContextParallelError",
    "context_parallel_problems",
    "enable_context_parallel",
    "register_ulysses",
    "ulysses_attention",
]

#: The attribute of each attention module that holds its :class:`ContextShard`.
CONTEXT_SHARD_ATTR = "hone_context_shard"

#: The kernels the wrapper calls, by the backend name a model had before it was wrapped.
INNER_FUNCTIONS: dict[str, Callable[..., tuple[torch.Tensor, Any]]] = {
    "sdpa": sdpa_attention_forward,
    CAUSAL_SDPA: causal_sdpa_attention,
    VARLEN_SDPA: varlen_sdpa_attention,
}

#: Why a backend cannot be wrapped (the model's, or hone's config's ``model.attn_implementation``).
REFUSED_BACKENDS = {
    "eager": "eager attention adds a mask transformers builds from the rank's own slice of the sequence",
    "flex_attention": "flex attention's BlockMask is built by transformers from the rank's own slice of the sequence",
    "flash_attention_2": "transformers picks the flash kernel by the backend's name, which a wrapper cannot carry",
    "flash_attention_3": "transformers picks the flash kernel by the backend's name, which a wrapper cannot carry",
    "hone_sdpa_tiled": "tiled decoder layers attend chunk by chunk of the rank's slice (set memory.tiled_layers: off)",
    "hone_flex_sinks": "attention sinks go through hone's flex attention, whose mask follows the rank's slice",
}


class ContextParallelError(ModelError):
    """A model or an attention call that context parallelism cannot run exactly."""


def context_parallel_problems(model_config: Any, size: int, attn_implementation: str | None = None) -> list[str]:
    """Why a model with (transformers) ``model_config`` cannot split its sequences over ``size``
    ranks (empty: it can). ``attn_implementation``: the backend to check (hone's
    ``model.attn_implementation`` before the model is built); by default the model's current one."""
    key = f"distributed.context_parallel: {size}"
    if size < 1:
        return [f"{key} must be at least 1 (1: off; N > 1: each sequence split over N ranks)"]
    if size == 1:
        return []
    problems = []
    heads = getattr(model_config, "num_attention_heads", None)
    kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
    if not heads:
        problems.append(f"{key}: the model's config gives no num_attention_heads to split over the ranks")
    else:
        for what, count in (
            ("attention heads (num_attention_heads)", heads),
            ("key/value heads (num_key_value_heads)", kv_heads),
        ):
            if count % size:
                divisors = [d for d in range(1, count + 1) if count % d == 0]
                problems.append(
                    f"{key}: each rank attends with an equal share of the heads, and the model has {count} {what}, "
                    f"which {size} ranks cannot split evenly: use one of {divisors}"
                )
    blockers = causal_blockers(model_config)
    if blockers:
        problems.append(
            f"{key}: the model has {', '.join(blockers)}, whose masks transformers builds from the rank's own slice of "
            "the sequence; context parallelism runs models whose layers all attend causally to the whole sequence"
        )
    name = inner_implementation(attn_implementation or getattr(model_config, "_attn_implementation", None))
    if name is not None and name not in INNER_FUNCTIONS:
        why = REFUSED_BACKENDS.get(name, "hone cannot wrap it")
        problems.append(
            f"{key}: attention through '{name}' cannot be split: {why}; allowed: sdpa (hone's causal and varlen "
            "sdpa kernels included)"
        )
    return problems


def ulysses_attention(
    inner: Callable[..., tuple[torch.Tensor, Any]],
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``inner`` over the whole sequence for this rank's heads: [B, H, T/N, D] in, ([B, T/N, H, D], None) out.

    ``attention_mask`` is None (causal) or a whole-sequence 4D mask; document boundaries come in
    ``kwargs`` as they are. The rank's own ``position_ids`` are not passed on: they describe its
    slice, not the sequence the kernel sees (packed rows carry their mask or boundaries instead).
    """
    shard: ContextShard | None = getattr(module, CONTEXT_SHARD_ATTR, None)
    if shard is None:
        raise ContextParallelError(
            f"{type(module).__name__} attends through context parallelism's backend but carries no {CONTEXT_SHARD_ATTR}: "
            "switch the model with enable_context_parallel, which marks every attention module"
        )
    if query.shape[2] != key.shape[2]:
        raise ContextParallelError(
            f"context parallelism is for training: it takes no KV cache (query length {query.shape[2]}, key length "
            f"{key.shape[2]})"
        )
    kwargs.pop("position_ids", None)
    if query.shape[-1] == key.shape[-1] == value.shape[-1]:
        query, key, value = seqs_to_heads((query, key, value), shard)  # one all-to-all for the three
    else:  # a value head size of its own (multi-head latent attention)
        query, key, value = (seq_to_heads(t, shard) for t in (query, key, value))
    length = key.shape[2]
    if attention_mask is not None and (attention_mask.dim() != 4 or attention_mask.shape[-1] != length):
        raise ContextParallelError(
            f"context parallelism attends over the whole sequence of {length} positions, but the attention mask has "
            f"shape {tuple(attention_mask.shape)}: attach the whole-sequence mask (MicroBatch.with_attention) before "
            "sharding the batch, and drop the padding mask (shard_micro_batch does)"
        )
    out, _ = inner(module, query, key, value, attention_mask, **kwargs)
    return heads_to_seq(out, shard), None


def _wrapping(inner: Callable[..., tuple[torch.Tensor, Any]]) -> Callable[..., tuple[torch.Tensor, None]]:
    def attention(module, query, key, value, attention_mask, **kwargs):
        return ulysses_attention(inner, module, query, key, value, attention_mask, **kwargs)

    return attention


def register_ulysses(inner: str) -> str:
    """Register the backend that wraps ``inner`` with ``AttentionInterface`` (idempotent; no
    ``AttentionMaskInterface`` entry, on purpose: no mask from the local length); returns its name."""
    if inner not in INNER_FUNCTIONS:
        raise ContextParallelError(f"context parallelism cannot wrap attention '{inner}': allowed: {sorted(INNER_FUNCTIONS)}")
    name = ULYSSES_NAMES[inner]
    AttentionInterface.register(name, _wrapping(INNER_FUNCTIONS[inner]))
    return name


def enable_context_parallel(model: nn.Module, shard: ContextShard) -> dict[str, Any]:
    """Split ``model``'s sequences over ``shard``'s group (a transformers causal LM, through a
    PEFT wrapper): marks every decoder layer's attention module with ``shard`` and switches the
    model to the backend that wraps its current attention. Call it after the attention kernel
    (and anything that changes it) is chosen. Idempotent. Returns what was done, for the record."""
    base = unwrap_peft(model)
    config = base.config
    if shard.size == 1:
        return {"size": 1}
    problems = context_parallel_problems(config, shard.size)
    if problems:
        raise ContextParallelError("; ".join(problems))
    inner = inner_implementation(config._attn_implementation)
    modules = [getattr(layer, "self_attn", None) for layer in decoder_layers(base)]
    if not modules or any(m is None for m in modules):
        raise ContextParallelError(
            f"distributed.context_parallel: {shard.size}: found no attention module (self_attn) in every decoder layer "
            f"of {type(base).__name__}"
        )
    name = register_ulysses(inner)
    for module in modules:
        setattr(module, CONTEXT_SHARD_ATTR, shard)
    if config._attn_implementation != name:
        base.set_attn_implementation(name)
    return {"size": shard.size, "rank": shard.rank, "attention": name, "wraps": inner, "layers": len(modules)}
