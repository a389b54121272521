"""The model's load: what a rank holds before FSDP2 has sharded the weights.

A model directory loads sharded under FSDP2 (:mod:`hone.models.sharded_load`: built on the meta
device, sharded, then each rank reads only its rows), but a preset (``model.preset``: random
weights, what ``hone bench`` rows train) has no files to read its rows from: the loader draws the
whole base on the device and the FSDP2 transform shards it afterwards (the experts already split
as drawn under expert parallelism, a quantized base already quantized as drawn). Until then the
rank holds one unsharded process's weights: measured 59.9 and 59.6 GiB for FSDP2 alone on 2 and 4
H100s with the whole qwen3-30b-a3b preset (59.3 GiB of weights; the sharded step needs 57 and 41
GiB: benchmarks/2026-11-27-h100-expert-parallel.md).
"""

from hone.config.root import HoneConfig


def drawn_whole_bytes(cfg: HoneConfig, unsharded_weights: int, param_shards: int) -> int:
    """Bytes of weights a rank holds while its model loads, where that is more than the step's
    sharded weights: ``unsharded_weights`` (one process's, the experts at ``E / N``) for a preset
    under FSDP2, else 0 (nothing sharded, or a model directory loaded sharded)."""
    if param_shards <= 1 or cfg.model.path is not None:
        return 0
    return unsharded_weights
