"""FSDP's term (``param_shards``): weights, gradients and optimizer state divided over the
processes, plus two layers' weights gathered whole (FSDP2 unshards one layer while it computes and
prefetches the next)."""

from hone.transforms.memory.facts import ModelFacts


def sharded_state(
    m: ModelFacts, weights: int, grads: int, optimizer: int, param_shards: int, gathered_per_layer: int | None = None
) -> tuple[int, int, int]:
    """(weights, gradients, optimizer state) one of ``param_shards`` processes holds.
    ``gathered_per_layer``: the bytes of a layer FSDP2 gathers (default: all of its weights)."""
    if param_shards < 1:
        raise ValueError(f"param_shards must be >= 1, got {param_shards}")
    if param_shards == 1:
        return weights, grads, optimizer
    per_layer = gathered_per_layer
    if per_layer is None:
        per_layer = (m.frozen_bytes + m.trainable_bytes) // max(len(m.layers), 1)
    return -(-weights // param_shards) + 2 * per_layer, -(-grads // param_shards), -(-optimizer // param_shards)
