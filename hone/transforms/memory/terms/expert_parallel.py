"""Expert parallelism's term (``distributed.expert_parallel: N``): what one of the ``N`` ranks holds.

* **Training state.** Each rank holds ``E / N`` of every MoE layer's routed experts: the experts'
  weights and biases, the LoRA factors on them, their gradients and their optimizer moments are
  divided by ``N``; everything else (attention, router, embeddings) stays whole on every rank.
* **Beside FSDP2** (``distributed.strategy: fsdp``): FSDP2 shards everything outside the
  experts over the ranks (and gathers a layer's non-expert weights at a time); each rank's block
  of the experts, with its gradients and moments, stays whole on it (``fully_shard`` leaves it out).
* **Activations.** The dispatch sends each token once to each rank holding one of its experts,
  in a buffer of ``S`` token slots per pair of ranks (``S = T``, the micro-batch's tokens), so a
  rank receives ``N x T`` rows of ``hidden`` per MoE layer, kept for the backward. Its grouped
  kernels then hold ``R`` pair rows (gate/up output, activation, expert output, kept for the
  backward) where one process holds ``T x k``: ``R = N x T x min(k, E / N)`` by default (nothing
  can overflow), ``f x T x k`` with ``distributed.expert_capacity_factor f``
  (:func:`hone.parallel.expert_parallel.expert_capacity`). Sentinel rows are skipped by the
  kernels' compute, not their storage. With ``distributed.expert_parallel_recompute`` the pair
  rows are not kept (the local experts run again in the backward), and one layer's pair rows
  exist at a time while its backward runs, except one hidden-wide row per pair row: measured on
  4 H200 (benchmarks/2026-11-28-h200x4-expert-parallel.md, qwen3-30b-a3b, 48 layers, CUDA graphs
  on), the peaks were 55.4 GiB at N = 4 and 56.8 at N = 2 where the pair rows alone gave 31.8 and
  45.1; an ``[R, hidden]`` buffer a layer (the size of the experts' output rows before their
  weighted sum) accounts for both within 0.5 GiB. Compiled on the CPU (the kernels under
  Triton's interpreter, Inductor's partitioner), the local step and the whole exchanged layer on
  2 gloo ranks keep only the received rows, so the GPU run keeps it for a reason not yet found
  (CUDA graphs, on for those rows, are the first suspect); the estimate counts what was measured.
"""

from typing import Any

from hone.transforms.memory.facts import LayerFacts, ModelFacts
from hone.transforms.memory.terms.fsdp import sharded_state


def expert_parallel_size(cfg: Any) -> int:
    """``distributed.expert_parallel`` as a number of ranks (1: off). Read with ``getattr`` so
    the estimate works on a config without the key."""
    size = getattr(cfg.distributed, "expert_parallel", 1)
    return size if isinstance(size, int) and size > 1 else 1


def expert_state_saved(m: ModelFacts, size: int) -> tuple[int, int, int]:
    """(weight bytes, gradient bytes, trainable parameters) a rank does not hold because the
    experts are split over ``size`` ranks: ``(N - 1) / N`` of the experts' share."""
    if size <= 1:
        return 0, 0, 0
    off = size - 1
    return m.expert_bytes * off // size, m.expert_trainable_bytes * off // size, m.expert_trainable_params * off // size


def expert_blocks_beside_fsdp(
    cfg: Any, m: ModelFacts, size: int, state: tuple[int, int, int], param_shards: int
) -> tuple[int, int, int]:
    """(weights, gradients, optimizer state) one rank holds when FSDP2 shards ``state`` (a rank's
    unsharded state, its block of the experts included) over ``param_shards`` processes beside
    expert parallelism over ``size``: the block is kept whole, the rest divided."""
    weights, grads, optimizer = state
    off_weights, off_grads, off_params = expert_state_saved(m, size)
    block_weights, block_grads = m.expert_bytes - off_weights, m.expert_trainable_bytes - off_grads
    block_optimizer = cfg.optimizer.state_bytes(m.expert_trainable_params - off_params, m.trainable_elem_bytes)
    gathered = (m.frozen_bytes + m.trainable_bytes - m.expert_bytes) // max(len(m.layers), 1)
    rest = sharded_state(m, weights - block_weights, grads - block_grads, optimizer - block_optimizer, param_shards, gathered)
    return rest[0] + block_weights, rest[1] + block_grads, rest[2] + block_optimizer


def expert_capacity_factor(cfg: Any) -> float | None:
    """``distributed.expert_capacity_factor`` (None: the worst case), read like the size."""
    return getattr(cfg.distributed, "expert_capacity_factor", None)


def expert_parallel_recompute(cfg: Any) -> bool:
    """``distributed.expert_parallel_recompute``, read like the size."""
    return bool(getattr(cfg.distributed, "expert_parallel_recompute", False))


def _pair_rows(m: ModelFacts, size: int, capacity_factor: float | None) -> float:
    """Pair rows per token a rank's grouped kernels hold (one process: ``k``)."""
    k = m.top_k
    return size * min(k, max(m.experts // size, 1)) if capacity_factor is None else capacity_factor * k


def _bytes_per_pair(layer: LayerFacts, m: ModelFacts) -> int:
    """What a pair row of the grouped path keeps for the backward (gate/up output, activation,
    expert output; the inputs too where the experts train)."""
    c, h, im = m.compute_bytes, m.hidden, m.expert_intermediate
    return c * (3 * im + h) + (c * (h + im) if layer.experts_trainable else 0)


def dispatch_bytes_per_token(
    layer: LayerFacts, m: ModelFacts, size: int, capacity_factor: float | None = None, recompute: bool = False
) -> int:
    """Bytes per token of the micro-batch that one MoE layer keeps beyond one process's under
    expert parallelism over ``size`` ranks: the received token rows (``N`` per token) and the
    pair rows past one process's ``k`` per token (``N x min(k, E / N)`` by default, ``f x k``
    with a capacity factor ``f``). With ``recompute`` no pair row is kept, not even one
    process's ``k`` (so the result can be negative), only a hidden-wide output row per pair row
    (module docstring: measured, not yet explained)."""
    if size <= 1 or not layer.moe:
        return 0
    received = m.compute_bytes * size * m.hidden
    pairs = _pair_rows(m, size, capacity_factor)
    if recompute:  # one process's k pair rows gone; the measured output row of each pair row kept
        return int(received - m.top_k * _bytes_per_pair(layer, m) + pairs * m.compute_bytes * m.hidden)
    return int(received + max(pairs - m.top_k, 0.0) * _bytes_per_pair(layer, m))


def recomputed_experts_bytes(m: ModelFacts, size: int, capacity_factor: float | None, recompute: bool, tokens: int) -> int:
    """With ``recompute`` (``expert_parallel_recompute``) over ``size`` ranks: the pair rows of the
    one layer whose local experts are rebuilt for its backward (0 without it, or without MoE layers)."""
    if size <= 1 or not recompute:
        return 0
    moe = [layer for layer in m.layers if layer.moe]
    return max((int(_pair_rows(m, size, capacity_factor) * _bytes_per_pair(layer, m)) * tokens for layer in moe), default=0)


def expert_parallel_note(m: ModelFacts, size: int) -> str | None:
    """The plan's line about it (None when off)."""
    if size <= 1 or not m.expert_params:
        return None
    return (
        f"expert parallel over {size} ranks: each holds {m.experts // size} of {m.experts} experts per MoE layer "
        f"(their weights, LoRA factors, gradients and optimizer state / {size}); the received token rows "
        f"({size} x T x {m.hidden} per MoE layer) and the experts' pair rows count as activations"
    )
