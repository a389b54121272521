"""Expert parallelism's term (``distributed.expert_parallel: N``): what one of the ``N`` ranks holds.

* **Training state.** Each rank holds ``E / N`` of every MoE layer's routed experts: the experts'
  weights and biases, the LoRA factors on them, their gradients and their optimizer moments are
  divided by ``N``; everything else (attention, router, embeddings) stays whole on every rank.
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
