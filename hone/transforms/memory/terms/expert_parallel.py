"""Expert parallelism's term (``distributed.expert_parallel: N``): what one of the ``N`` ranks holds.

* **Training state.** Each rank holds ``E / N`` of every MoE layer's routed experts: the experts'
  weights and biases, the LoRA factors on them, their gradients and their optimizer moments are
  divided by ``N``; everything else (attention, router, embeddings) stays whole on every rank.
* **Beside FSDP2** (``distributed.strategy: fsdp``): FSDP2 shards everything outside the
  experts over the ranks (and gathers a layer's non-expert weights at a time); each rank's block
  of the experts, with its gradients and moments, stays whole on it (``fully_shard`` leaves it out).
* **Activations.** The dispatch sends a fixed-capacity buffer: ``C`` slots per pair of ranks,
  ``C = T * k`` by default (nothing can overflow; :func:`hone.parallel.expert_parallel.expert_capacity`),
  so each rank sends and receives ``N * C`` rows of ``hidden`` per MoE layer and direction (the
  dispatch and the combine), sentinel rows included. The local experts run on those ``N * C``
  rows: the routed rows they keep for the backward (gate/up output, activation, expert output)
  are ``N`` times those of one process, which routes ``T * k``. Sentinel rows are skipped by the
  kernels' compute, not their storage.
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


def dispatch_bytes_per_token(layer: LayerFacts, m: ModelFacts, size: int) -> int:
    """Bytes per token of the micro-batch that one MoE layer keeps beyond one process's under
    expert parallelism over ``size`` ranks (default capacity ``T * k``): the two exchanged
    buffers (``N * T * k`` rows of ``hidden`` each) and ``N - 1`` more times the routed rows."""
    if size <= 1 or not layer.moe:
        return 0
    c, k, h, im = m.compute_bytes, m.top_k, m.hidden, m.expert_intermediate
    buffers = 2 * c * size * k * h
    routed = c * k * (3 * im + h) + (c * k * (h + im) if layer.experts_trainable else 0)
    return buffers + (size - 1) * routed


def expert_parallel_note(m: ModelFacts, size: int) -> str | None:
    """The plan's line about it (None when off)."""
    if size <= 1 or not m.expert_params:
        return None
    return (
        f"expert parallel over {size} ranks: each holds {m.experts // size} of {m.experts} experts per MoE layer "
        f"(their weights, LoRA factors, gradients and optimizer state / {size}); dispatch buffers of "
        f"{size} x T x {m.top_k} rows x {m.hidden} per MoE layer and direction count as activations"
    )
