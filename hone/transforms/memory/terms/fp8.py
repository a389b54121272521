"""The float8 copies of a LoRA run on a float8 base (``performance.fp8``)."""

from hone.config.root import HoneConfig
from hone.transforms.memory.facts import ModelFacts


def fp8_copies_bytes(cfg: HoneConfig, m: ModelFacts) -> int:
    """The float8 copies a LoRA run on a float8 base keeps beside each converted bf16 weight (the
    weight per output row and its transpose per input column: 2 bytes a weight, hone.transforms.fp8);
    a full fine-tune's float8 casts are per step and transient. Layers the shape rule keeps in bf16
    (hone.transforms.fp8_sizes) have no copies."""
    from hone.transforms.fp8_sizes import converts_to_fp8

    perf = cfg.performance
    if perf.fp8 == "off" or not cfg.adapter.is_lora:
        return 0
    shapes = m.lora_base_shapes if perf.fp8_base_linears == "lora_targets" else m.frozen_layer_linear_shapes
    return 2 * sum(k * n for k, n in shapes if converts_to_fp8(k, n, perf.fp8, perf.fp8_small_linears))
