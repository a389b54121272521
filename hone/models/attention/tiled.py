"""Causal attention for one chunk of a decoder layer's queries, against all earlier keys.

A tiled decoder layer (:mod:`hone.transforms.tiled_layers`) runs the layer on one chunk of the
sequence at a time. Everything in the layer but the attention is token-wise; the attention of
chunk ``[s, e)`` needs the keys and values of every position before ``e``. This backend gives
it exactly that, so the chunked layer computes the same function as the whole one:

- ``forward`` (the tiled forward, and the backward's no-grad pass that rebuilds the keys): the
  chunk's post-RoPE keys and values are written into full-length buffers ``[B, Hk, T, D]`` as
  the chunks go, and the chunk's queries attend to ``keys[:, :, :e]`` with the causal mask
  aligned to the lower right (query ``s + i`` sees keys ``0 .. s + i``).
- ``collect`` (the backward's first pass): the chunk's keys and values are written into the
  buffers and the layer is stopped right there (:class:`KeysCollected`), since nothing after
  the attention is needed to rebuild the keys.
- ``backward`` (a chunk's recompute with grad): the chunk attends to ``cat(prefix, k)`` where
  ``prefix`` is a leaf cut from the rebuilt buffers (its gradient goes to the earlier chunks'
  keys), and the chunk's own live ``k``, ``v`` are handed back to the caller, which feeds them
  the gradient the later chunks sent them.

Why a backend of its own (``hone_sdpa_tiled``) rather than a branch in hone's causal sdpa: the
check "is a chunk being computed?" must run outside Dynamo's tracing (a traced read of the state
object would guard on its identity and recompile every call), which costs a graph break at the
attention. Only tiled models should pay for it; untiled layers keep one compiled graph through
:data:`~hone.models.attention.causal.CAUSAL_SDPA`. Outside a chunk (eval, generation without
grad) this backend *is* hone's causal sdpa. Like it, it is registered with ``AttentionInterface``
only, so transformers prepares no mask for it: tiled rows are causal rows, never packed.

The state travels through a module-level variable set by the tiled layer around each call of the
inner layer (never through the layer's keyword arguments: a Python object passed into compiled
code would be guarded on by identity too). Grouped keys (GQA) are never repeated to the query
heads (:func:`causal_chunk_attention` says how they are attended). On CUDA in bf16/fp16 the
lower-right causal mask runs in torch's flash kernel; elsewhere (CPU, float32) torch
materialises the ``[chunk x keys]`` mask, which is fine for tests and small shapes.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from transformers import AttentionInterface

from hone.errors import HoneError
from hone.models.attention.causal import causal_sdpa_attention

#: The name the backend is registered under with transformers.
TILED_SDPA = "hone_sdpa_tiled"

Mode = Literal["forward", "collect", "backward"]


class TiledAttentionError(HoneError):
    """A tiled decoder layer's attention was called in a way chunks cannot reproduce."""


class KeysCollected(Exception):  # noqa: N818 -- a signal, not an error
    """Raised by the attention in ``collect`` mode once the chunk's keys and values are stored:
    the rest of the layer is not needed to rebuild them, so the caller stops the layer here."""


@dataclass
class ChunkAttention:
    """What the attention of the layer being tiled does for the current chunk ``[start, end)``
    of a sequence of ``total`` positions (one instance per tiled call of one layer)."""

    mode: Mode
    total: int
    start: int = 0
    end: int = 0
    keys: torch.Tensor | None = None  # [B, Hk, total, D], post-RoPE, written chunk by chunk
    values: torch.Tensor | None = None
    prefix_keys: torch.Tensor | None = None  # backward: leaves over keys[:, :, :start]
    prefix_values: torch.Tensor | None = None
    live_keys: torch.Tensor | None = None  # backward: the chunk's own k, v, in the graph
    live_values: torch.Tensor | None = None
    calls: int = 0

    def at(self, start: int, end: int, mode: Mode | None = None) -> ChunkAttention:
        """Move to chunk ``[start, end)`` (and ``mode``); forgets the previous chunk's tensors."""
        self.start, self.end, self.calls = start, end, 0
        if mode is not None:
            self.mode = mode
        self.prefix_keys = self.prefix_values = self.live_keys = self.live_values = None
        return self

    def _store(self, key: torch.Tensor, value: torch.Tensor) -> None:
        if self.keys is None:
            batch, heads, _, dim = key.shape
            self.keys = key.new_empty(batch, heads, self.total, dim)
            self.values = value.new_empty(batch, value.shape[1], self.total, value.shape[3])
        assert self.values is not None
        self.keys[:, :, self.start : self.end].copy_(key.detach())
        self.values[:, :, self.start : self.end].copy_(value.detach())

    def attend(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout: float, scaling: float | None
    ) -> torch.Tensor:
        """The chunk's attention output ``[B, Hq, chunk, D]`` (see the module docstring)."""
        self.calls += 1
        if self.calls > 1:
            raise TiledAttentionError(
                "memory.tiled_layers: the decoder layer called its attention twice for one chunk; tiled layers handle "
                "layers with one causal self-attention. Set memory.tiled_layers: off for this model"
            )
        if key.shape[2] != self.end - self.start or query.shape[2] != self.end - self.start:
            raise TiledAttentionError(
                f"memory.tiled_layers: the attention got {query.shape[2]} queries and {key.shape[2]} keys for a chunk of "
                f"{self.end - self.start} tokens (a KV cache?); tiled layers train without a cache. Set "
                "memory.tiled_layers: off for this model"
            )
        if self.mode == "collect":
            self._store(key, value)
            raise KeysCollected
        if self.mode == "forward":
            self._store(key, value)
            assert self.keys is not None and self.values is not None
            return causal_chunk_attention(query, self.keys[:, :, : self.end], self.values[:, :, : self.end], dropout, scaling)
        # backward: the earlier chunks' keys are leaves whose gradient the caller collects
        self.live_keys, self.live_values = key, value
        if self.start == 0:
            return causal_chunk_attention(query, key, value, dropout, scaling)
        assert self.keys is not None and self.values is not None, "the backward rebuilds the keys first"
        self.prefix_keys = self.keys[:, :, : self.start].detach().requires_grad_(key.requires_grad)
        self.prefix_values = self.values[:, :, : self.start].detach().requires_grad_(value.requires_grad)
        keys = torch.cat([self.prefix_keys, key], dim=2)
        values = torch.cat([self.prefix_values, value], dim=2)
        return causal_chunk_attention(query, keys, values, dropout, scaling)


def causal_chunk_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout: float = 0.0, scaling: float | None = None
) -> torch.Tensor:
    """sdpa of ``query [B, Hq, Lq, D]`` against ``key``/``value [B, Hk, Lk, D]`` (``Lk >= Lq``),
    the queries being the last ``Lq`` positions: causal, aligned to the lower right.

    With grouped keys (``Hk`` divides ``Hq``, query head ``i`` reading key head ``i // (Hq/Hk)``)
    the query heads are taken one per group at a time: ``Hq/Hk`` calls of ``Hk`` heads each against
    the keys as they are, never repeated. Why not one sdpa call with ``enable_gqa``: its flash
    backward allocates the key and value gradients expanded to ``Hq`` heads over all ``Lk`` keys
    before summing them (8 GiB for qwen3-8b's last chunk at 512K tokens); per group they are
    ``Hk`` heads. The same FLOPs and the same key reads per query head."""
    groups = query.shape[1] // key.shape[1]
    if groups == 1:
        return _lower_right_causal(query, key, value, dropout, scaling)
    per_group = query.unflatten(1, (key.shape[1], groups)).unbind(2)
    outs = [_lower_right_causal(q, key, value, dropout, scaling) for q in per_group]
    return torch.stack(outs, dim=2).flatten(1, 2)


def _lower_right_causal(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout: float, scaling: float | None
) -> torch.Tensor:
    lq, lk = query.shape[2], key.shape[2]
    if lq == lk:
        return F.scaled_dot_product_attention(query, key, value, dropout_p=dropout, is_causal=True, scale=scaling)
    mask = causal_lower_right(lq, lk)  # flash on CUDA (bf16/fp16); elsewhere the [Lq x Lk] mask
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling)


_CURRENT: ChunkAttention | None = None


@contextmanager
def computing_chunk(state: ChunkAttention) -> Iterator[ChunkAttention]:
    """Make ``state`` the chunk every tiled attention call serves until the block exits."""
    global _CURRENT
    previous, _CURRENT = _CURRENT, state
    try:
        yield state
    finally:
        _CURRENT = previous


@torch.compiler.disable
def tiled_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract ([B, H, T, D] in, ([B, T, H, D], None) out).
    Inside a chunk of a tiled layer: the chunk's attention (:class:`ChunkAttention`); outside:
    hone's causal sdpa, unchanged. A graph boundary for ``torch.compile`` (module docstring)."""
    state = _CURRENT
    if state is None:
        return causal_sdpa_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if attention_mask is not None:
        raise TiledAttentionError(
            "memory.tiled_layers: the attention got a mask (packed rows or a padding mask); tiled layers compute causal "
            "rows without one. Set data.sample_packing: false, or memory.tiled_layers: off"
        )
    if kwargs.get("sliding_window") is not None:
        raise TiledAttentionError(
            "memory.tiled_layers: the layer attends through a sliding window, which chunks do not reproduce; set "
            "memory.tiled_layers: off for this model"
        )
    out = state.attend(query, key, value, dropout, scaling if scaling is not None else query.shape[-1] ** -0.5)
    return out.transpose(1, 2).contiguous(), None


def register_tiled_sdpa() -> str:
    """Make :data:`TILED_SDPA` a valid ``attn_implementation`` (idempotent); returns the name.
    No ``AttentionMaskInterface`` entry, on purpose (module docstring)."""
    AttentionInterface.register(TILED_SDPA, tiled_sdpa_attention)
    return TILED_SDPA
