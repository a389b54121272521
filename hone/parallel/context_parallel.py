"""Context parallelism: one sequence split along its length over ``N`` ranks (DeepSpeed-Ulysses).

Each rank of a context-parallel group holds the same micro-batch and computes a contiguous
``T / N`` slice of every row (:func:`shard_micro_batch`): embeddings, projections, RoPE (on the
slice's own global positions), MLP, norms and the loss all run on that slice alone. Attention is
the only step that needs the whole sequence; around it two all-to-alls trade the sequence split
for a head split (:func:`seq_to_heads` on q, k and v: ``[B, H, T/N, D] -> [B, H/N, T, D]``), so
each rank attends over the WHOLE sequence for ``H / N`` of the heads, with whatever kernel the
model uses and the whole-sequence mask or document boundaries the batch carries, and
:func:`heads_to_seq` trades back (``[B, T, H/N, D] -> [B, T/N, H, D]``). Attention heads are
independent, so this computes exactly what one process computes (docs/context_parallel.md).

Heads go out in ``N`` contiguous blocks, rank ``j`` receiving block ``j`` of the query heads and
block ``j`` of the key/value heads: with grouped-query attention (``Hq / Hkv`` query heads per
key/value head, ``N`` dividing ``Hkv``) the query heads of a block are exactly those that read
the block's key/value heads. The exchanges are :func:`hone.parallel.exchange.exchange`
(differentiable; Dynamo traces it into the graph of a compiled layer).

This module sits below :mod:`hone.data`, so it names the micro-batch's fields, not its class.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist

from hone.parallel.exchange import exchange

__all__ = ["ContextShard", "heads_to_seq", "seq_to_heads", "seqs_to_heads", "shard_micro_batch"]

#: The targets' "no loss" label (``hone.data.collate.IGNORE_INDEX``; this lower layer cannot import it).
IGNORE_INDEX = -100


@dataclass(frozen=True)
class ContextShard:
    """This rank's place in a context-parallel group of ``size`` (``N``) ranks of ``group``
    (None: the default group): it holds positions ``[rank * T / N, (rank + 1) * T / N)`` of every
    row of ``T`` tokens, and heads ``[rank * H / N, (rank + 1) * H / N)`` inside attention."""

    size: int
    rank: int
    group: dist.ProcessGroup | None = None

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"context parallel size {self.size} must be at least 1")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"context parallel rank {self.rank} is not in 0..{self.size - 1} (size {self.size})")

    @classmethod
    def of_group(cls, group: dist.ProcessGroup | None = None) -> ContextShard:
        """This process's shard over ``group`` (which must be initialised; None: the default group)."""
        return cls(dist.get_world_size(group), dist.get_rank(group), group)

    def part(self, length: int, what: str = "length") -> int:
        """``length / N``: the slice each rank holds (a ValueError naming both where ``N`` does not divide it)."""
        if length % self.size:
            raise ValueError(
                f"context parallelism splits the {what} evenly over its ranks, but {length} is not a multiple of "
                f"context_parallel {self.size}: use a sequence length (or head count) that is"
            )
        return length // self.size

    def local(self, t: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's contiguous slice of ``t`` along ``dim`` (a view)."""
        part = self.part(t.shape[dim], f"length of dim {dim} ({tuple(t.shape)})")
        return t.narrow(dim, self.rank * part, part)


def seq_to_heads(x: torch.Tensor, shard: ContextShard) -> torch.Tensor:
    """``[B, H, T/N, D]`` (this rank's positions, every head) -> ``[B, H/N, T, D]`` (every
    position, this rank's heads): block ``j`` of the heads goes to rank ``j``; what comes back
    from rank ``i`` is its positions, laid out in rank order. Differentiable."""
    if shard.size == 1:
        return x
    batch, heads, part, dim = x.shape
    n = shard.size
    local = shard.part(heads, f"{heads} heads")
    send = x.reshape(batch, n, local, part, dim).transpose(0, 1)  # [N, B, H/N, T/N, D]: block j for rank j
    got = exchange(send, n, shard.group)  # [N, B, H/N, T/N, D]: block i = rank i's positions
    return got.permute(1, 2, 0, 3, 4).reshape(batch, local, n * part, dim)


def seqs_to_heads(xs: tuple[torch.Tensor, ...], shard: ContextShard) -> tuple[torch.Tensor, ...]:
    """:func:`seq_to_heads` of each of ``xs`` (q, k, v: any head counts ``N`` divides, one
    batch, length and head size) in ONE all-to-all: each rank's blocks of all of them travel
    together (one collective per layer instead of three; the copy into the send buffer is the
    one each exchange makes anyway). Differentiable."""
    if shard.size == 1:
        return xs
    n = shard.size
    batch, _, part, dim = xs[0].shape
    locals_ = [shard.part(x.shape[1], f"{x.shape[1]} heads") for x in xs]
    if any(x.shape[0] != batch or x.shape[2:] != (part, dim) for x in xs):
        raise ValueError(
            f"seqs_to_heads exchanges tensors of one batch, length and head size, not {[tuple(x.shape) for x in xs]}"
        )
    send = torch.cat([x.reshape(batch, n, h, part, dim).transpose(0, 1) for x, h in zip(xs, locals_)], dim=2)
    got = exchange(send, n, shard.group)  # [N, B, sum(H/N), T/N, D]: block i = rank i's positions
    out = got.permute(1, 2, 0, 3, 4).reshape(batch, sum(locals_), n * part, dim)
    return tuple(out.split(locals_, dim=1))


def heads_to_seq(x: torch.Tensor, shard: ContextShard) -> torch.Tensor:
    """``[B, T, H/N, D]`` (every position, this rank's heads; the layout transformers' attention
    functions return) -> ``[B, T/N, H, D]`` (this rank's positions, every head): the inverse
    trade of :func:`seq_to_heads`. Differentiable."""
    if shard.size == 1:
        return x
    batch, length, local, dim = x.shape
    n = shard.size
    part = shard.part(length, "sequence length")
    send = x.reshape(batch, n, part, local, dim).transpose(0, 1)  # [N, B, T/N, H/N, D]: rank j's positions
    got = exchange(send, n, shard.group)  # [N, B, T/N, H/N, D]: block i = rank i's heads
    return got.permute(1, 2, 0, 3, 4).reshape(batch, part, n * local, dim)


class MicroBatchLike(Protocol):
    """The fields of :class:`hone.data.collate.MicroBatch` that sharding reads (a dataclass)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    targets: torch.Tensor
    trained_tokens: int
    tokens: int
    position_ids: torch.Tensor | None
    cu_seqlens: torch.Tensor | None
    attention_inputs: dict[str, Any]


Batch = TypeVar("Batch", bound=MicroBatchLike)


def shard_micro_batch(batch: Batch, shard: ContextShard, counted: Batch | None = None) -> Batch:
    """This rank's shard of ``batch`` (a :class:`hone.data.collate.MicroBatch`, targets already
    shifted, the same on every rank of the group): ``input_ids``, ``targets`` and ``position_ids``
    sliced to the rank's ``T / N`` positions; global positions (``0..T-1`` where the batch has
    none; a packed row's per-document positions as they are), so RoPE on the shard is RoPE on
    the whole row. Kept whole: ``attention_inputs`` (a packed batch's document mask or boundaries
    over the WHOLE sequence, attached by ``with_attention`` before sharding: attention sees the
    whole sequence) and ``cu_seqlens``. The padding mask is dropped: exact where every row is
    padded on the right only (causal attention: no real token sees a later pad; pads carry no
    target), refused otherwise. ``trained_tokens`` and ``tokens`` are the shard's (they add up
    over the group to the batch's; a packed batch's padding tails are not located row by row,
    so its ``tokens`` are split evenly, exact in sum). ``counted``: the same micro-batch as it was
    on the host before ``batch`` was copied to the device: the padding check and the counts read
    it there, so sharding never waits for the device (None: they read ``batch``, one host sync)."""
    if shard.size == 1:
        return batch
    host = counted if counted is not None else batch
    width = batch.input_ids.shape[1]
    shard.part(width, f"micro-batch width {width} (its sequence length)")
    if batch.cu_seqlens is not None and not batch.attention_inputs:
        raise ValueError(
            "shard_micro_batch: a packed micro-batch must carry its attention inputs (document mask or "
            "boundaries over the whole sequence) before it is sharded: call batch.with_attention(layout) first"
        )
    mask = host.attention_mask
    padded = mask is not None and batch.tokens < batch.input_ids.numel()
    if padded:
        holes = (mask[:, 1:] > mask[:, :-1]).any(dim=1)  # a pad before a real token
        if bool(holes.any()):
            rows = holes.nonzero().flatten().tolist()
            raise ValueError(
                f"shard_micro_batch: row(s) {rows} of the micro-batch have padding before real tokens (left padding); "
                "context parallelism drops the padding mask, which is exact only for rows padded on the right "
                "(hone.data.collate pads on the right)"
            )
    positions = batch.position_ids
    if positions is None:
        positions = torch.arange(width, device=batch.input_ids.device).expand(batch.input_ids.shape[0], -1)
    targets = shard.local(batch.targets)
    counts = [(shard.local(host.targets) != IGNORE_INDEX).sum()]
    if padded:
        counts.append(shard.local(mask).sum())
    counts = torch.stack(counts).tolist()  # one host read for both
    if padded:
        tokens = counts[1]
    elif batch.tokens == batch.input_ids.numel():
        tokens = targets.numel()
    else:  # a packed batch's padding tails: the even share, the shares adding up to the batch's count
        tokens = batch.tokens * (shard.rank + 1) // shard.size - batch.tokens * shard.rank // shard.size
    return dataclasses.replace(
        batch,
        input_ids=shard.local(batch.input_ids),
        attention_mask=None,
        targets=targets,
        trained_tokens=int(counts[0]),
        tokens=int(tokens),
        position_ids=shard.local(positions),
    )
