"""Expert parallelism's term (``distributed.expert_parallel: N``): what one of the ``N`` ranks holds.

* **Training state.** Each rank holds ``E / N`` of every MoE layer's routed experts: the experts'
  weights and biases, the LoRA factors on them, their gradients and their optimizer moments are
  divided by ``N``; everything else (attention, router, embeddings) stays whole on every rank.
* **Beside FSDP2** (``distributed.strategy: fsdp``): FSDP2 shards everything outside the
  experts over the ranks (and gathers a layer's non-expert weights at a time); each rank's block
  of the experts, with its gradients and moments, stays whole on it (``fully_shard`` leaves it out).
* **Activations.** The dispatch sends each token once to each rank holding one of its experts,
  in a buffer of ``S`` token slots per pair of ranks (``S = T``, the micro-batch's tokens), so a
  rank receives ``N x T`` rows of ``hidden`` per MoE layer, with their routing weights and local
  expert ids: all fixed sizes, sentinel slots included, whatever the routing. Its grouped kernels
  then compute ``R`` pair rows (gate/up output, activation, expert output), ``R = N x T x
  min(k, E / N)`` by default (the worst case: nothing can overflow), ``f x T x k`` with
  ``distributed.expert_capacity_factor f`` (:func:`hone.parallel.expert_parallel.expert_capacity`);
  sentinel rows are skipped by the kernels' compute, not their storage, so the buffers are ``R``
  rows whatever the routing (the estimate is the code's worst case, not a bound on the data).
  What a layer **keeps** for its backward is the received rows (with their weights and ids, and
  the pair rows' int64 indices), not the pair rows: one process keeps its ``T x k`` pair rows,
  but measured H100/H200 peaks of compiled expert-parallel layers (qwen3-30b-a3b, 48 layers,
  seq 4096: 42.5 GiB at N = 2 and 28.7 GiB at N = 4 under selective 0.95 / 0.8, 45.4 GiB at
  N = 2 without checkpointing, benchmarks/2026-11-27-h*-expert-parallel.md) leave no room for
  ``R`` rows per layer (the expert outputs alone would add 12 GiB at N = 2 and 24 GiB at N = 4),
  so the term counts what the experts can be rebuilt from: the received rows. The ``R`` rows of
  one layer are a transient (:func:`pair_rows_transient`): alive while that layer's forward or
  backward runs, once, not per layer. **Caveat**: tracing the compiled layer's partition on the
  CPU (torch 2.13, where the exchange's gradient flows) keeps the expert outputs, ``R`` rows per
  layer; peaks this low are also what a compiled exchange whose gradient is lost would give (an
  autograd Function filling ``torch.empty_like`` with ``all_to_all_single``, as
  :mod:`hone.parallel.exchange` does, differentiated as zero by Dynamo: DeepSpeed PR 8491). The
  GPU test ``test_two_gpus_compiled_through_the_grouped_kernels_equal_eager`` checks it; if it
  fails, the measured peaks are of steps without expert gradients and the pair rows must count
  per layer again (:func:`dispatch_bytes_per_token`).
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


def _per_pair(layer: LayerFacts, m: ModelFacts) -> int:
    """Bytes of one pair row of the grouped kernels: gate/up output, activation, expert output
    (trained experts: their inputs too, as one process's term counts them)."""
    c, h, im = m.compute_bytes, m.hidden, m.expert_intermediate
    return c * (3 * im + h) + (c * (h + im) if layer.experts_trainable else 0)


def dispatch_bytes_per_token(layer: LayerFacts, m: ModelFacts, size: int) -> int:
    """Bytes per token of the micro-batch that one MoE layer keeps under expert parallelism over
    ``size`` ranks beyond one process's (negative: less). It keeps the ``N`` received token rows
    per token (hidden, compute dtype), their routing weights (float32) and local expert ids
    (int64) and the pair rows' indices (two int64 and a mask per pair, ``N x k`` pairs per token),
    and not the ``k`` pair rows per token one process keeps (see the module doc)."""
    if size <= 1 or not layer.moe:
        return 0
    c, k, h = m.compute_bytes, m.top_k, m.hidden
    received = size * (c * h + k * (4 + 8))
    indices = size * k * (8 + 8 + 1)
    return received + indices - k * _per_pair(layer, m)


def pair_rows_transient(m: ModelFacts, tokens: int, size: int, capacity_factor: float | None = None) -> int:
    """Bytes of one MoE layer's ``R`` pair rows (:func:`hone.parallel.expert_parallel.expert_capacity`:
    the worst case ``N x T x min(k, E / N)`` by default, ``f x T x k`` rounded up with a factor
    ``f``), alive while that layer's forward or backward runs: 0 when off."""
    moe = [layer for layer in m.layers if layer.moe]
    if size <= 1 or not moe:
        return 0
    from hone.parallel.expert_parallel import expert_capacity

    rows = expert_capacity(tokens, m.top_k, size, capacity_factor, max(m.experts // size, 1))
    return rows * max(_per_pair(layer, m) for layer in moe)


def expert_parallel_note(m: ModelFacts, size: int) -> str | None:
    """The plan's line about it (None when off)."""
    if size <= 1 or not m.expert_params:
        return None
    return (
        f"expert parallel over {size} ranks: each holds {m.experts // size} of {m.experts} experts per MoE layer "
        f"(their weights, LoRA factors, gradients and optimizer state / {size}); each MoE layer keeps its received "
        f"token rows ({size} x T x {m.hidden}); one layer at a time holds the experts' pair rows"
    )
