"""What float8 (``performance.fp8``) changes in the memory: the float8 copies of a LoRA run on a
float8 base, and what a compiled float8 full fine-tune keeps of its projections' inputs."""

from hone.config.root import HoneConfig
from hone.transforms.memory.facts import LinearFacts, ModelFacts


def fp8_copies_bytes(cfg: HoneConfig, m: ModelFacts, float8: tuple[str, str] | None = None, param_shards: int = 1) -> int:
    """The float8 copies a LoRA run on a float8 base keeps beside each converted bf16 weight (the
    weight per output row and its transpose per input column: 2 bytes a weight, hone.transforms.fp8).
    A full fine-tune (``float8 = (mode, small)``, :func:`~hone.transforms.memory.estimate.float8_of`)
    casts per step, transiently, except under FSDP2 with tensorwise scaling: each weight's shard is
    cast once per step and kept for the step's all-gathers (1 byte a weight, counted whole here and
    sharded with the weights; hone.transforms.fp8_cast_once). Layers the shape rule keeps in bf16
    (hone.transforms.fp8_sizes) have no copies. ``fp8_head`` adds the output head's two copies
    (hone.transforms.loss)."""
    from hone.transforms.fp8_sizes import converts_to_fp8, float8_lora_base, fp8_scaling

    perf = cfg.performance
    if float8 is not None and param_shards > 1 and float8[0] == "tensorwise":
        linears = [lf for layer in m.layers for lf in layer.linears if lf.trainable and not lf.lora_rank]
        return sum(
            lf.in_features * lf.out_features for lf in linears if converts_to_fp8(lf.in_features, lf.out_features, *float8)
        )
    if not float8_lora_base(cfg):
        return 0
    mode = fp8_scaling(cfg, fsdp=False)[0]  # (a LoRA base refuses FSDP2)
    # "auto" is resolved by the plan before any estimate it makes (hone.transforms.decide.as_decided);
    # a config estimated as written counts the LoRA targets, the choice without CUDA graphs
    shapes = m.frozen_layer_linear_shapes if perf.fp8_base_linears == "all" else m.lora_base_shapes
    head = 2 * m.vocab * m.hidden if perf.fp8_head else 0  # the frozen head's two rowwise copies
    return head + 2 * sum(k * n for k, n in shapes if converts_to_fp8(k, n, mode, perf.fp8_small_linears))


def float8_site_bytes(linears: list[LinearFacts], width: int, site: str, float8: tuple[str, str] | None) -> int | None:
    """Per-token bytes the compiled projections reading one input keep for their backward when
    every one of them is torchao's ``Float8Linear`` (a full fine-tune, ``float8 = (mode, small)``);
    None where that is not so (the bf16 rule applies).

    torchao's autograd function saves the bf16 input and casts it again in the backward (eager:
    as much as bf16). Compiled, the min-cut partitioner sees that the backward's float8 operands
    are pointwise casts (the amax reduction is saved as a scalar scale) of tensors the layer keeps
    anyway, and recomputes them: the norm output that q/k/v and gate/up read comes back from the
    norm's saved input and inverse RMS, the down projection's input from the saved gate and up.
    Only the attention output's 2-D copy, the output projection's input, is kept, in float8 (one
    byte an element). Counted with ``aot_eager_decomp_partition`` on a tiny llama
    (tests/unit/test_estimate.py); on llama3.2-3b at 8K tokens it is the 6.1 GiB the H100's
    float8 row peaks below the bf16 one (benchmarks/2026-11-26-h100-quantization.md, session 8)."""
    from hone.transforms.fp8_sizes import converts_to_fp8

    if float8 is None or not linears:
        return None
    mode, small = float8
    for lf in linears:
        if lf.lora_rank or not lf.trainable or not converts_to_fp8(lf.in_features, lf.out_features, mode, small):
            return None
    return width if site == "o_in" else 0
