"""Which linear layers compute in float8, decided from their shapes alone, and which scaling
``performance.fp8: auto`` takes: the fp8 transform asks it of each module, the memory estimate of
each weight shape of a model it never builds (no torch here beyond the kernel's alignment)."""

from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from hone.config.root import HoneConfig

from hone.kernels.fp8_linear import ALIGN

SmallLinears = Literal["bf16", "fp8"]


def fits_fp8(in_features: int, out_features: int) -> bool:
    """Whether a ``[out_features, in_features]`` weight can be a float8 matmul operand at all."""
    return in_features % ALIGN == 0 and out_features % ALIGN == 0


def too_small_for_fp8(in_features: int, out_features: int, mode: str) -> bool:
    """Whether a linear layer's matmuls are too narrow for float8 to beat the per-call scaling it
    adds (``performance.fp8_small_linears: bf16`` keeps these in bf16).

    A float8 matmul saves time in proportion to its FLOPs, while quantizing its input and output
    gradient costs time in proportion to their sizes, so narrow layers lose. The thresholds are the
    break-even points of torchao's published H100 microbenchmarks of its two recipes (rowwise
    scaling costs more per call, so its threshold is higher); ``K`` is the input width, ``N`` the
    output width. A key or value projection of a 3B or 8B model (K 3072 or 4096, N 1024) is small
    for both."""
    k, n = in_features, out_features
    if mode == "tensorwise":
        return k <= 4096 and n <= 1024
    return n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048)


def converts_to_fp8(in_features: int, out_features: int, mode: str, small: SmallLinears) -> bool:
    """The shape rule of ``performance.fp8``: aligned, and not too small unless asked."""
    return fits_fp8(in_features, out_features) and not (small == "bf16" and too_small_for_fp8(in_features, out_features, mode))


def float8_lora_base(cfg: "HoneConfig") -> bool:
    """Whether the run trains LoRA on a frozen float8 base (``performance.fp8`` with an adapter),
    whose frozen linears ``fp8_base_linears`` picks; with fp8 on and no adapter, the run is a
    float8 full fine-tune (torchao's)."""
    return cfg.performance.fp8 != "off" and cfg.adapter.is_lora


def with_fp8_base_linears(cfg: "HoneConfig", which: str) -> "HoneConfig":
    """``cfg`` with ``performance.fp8_base_linears`` as the plan decided it (``cfg`` itself where
    it already says so): the memory estimates read it from the config."""
    if cfg.performance.fp8_base_linears == which:
        return cfg
    return cfg.model_copy(update={"performance": cfg.performance.model_copy(update={"fp8_base_linears": which})})


def fp8_scaling(cfg: "HoneConfig", fsdp: bool) -> tuple[str, str]:
    """(``off``, ``rowwise`` or ``tensorwise``, why): ``performance.fp8`` as the run uses it.

    ``auto`` asks for float8 with the scaling measured faster for the run's case
    (docs/quantization.md): ``tensorwise`` on one process, under DDP and under FSDP2 (LoRA
    llama3-8b 1.21x bf16 against rowwise 1.17x; full fine-tune llama3.2-3b 1.197x against 1.00x;
    under FSDP2 on 2 H200, with the shards cast once a step, 1.13x the bf16 FSDP2 row against
    rowwise's 0.97x), ``rowwise`` for a LoRA base under context parallelism (per-token scales are
    the only ones that do not depend on how the sequence is split). ``fsdp`` only changes the
    reason given."""
    asked = cfg.performance.fp8
    if asked != "auto":
        return asked, f"performance.fp8: {asked}"
    if cfg.adapter.is_lora and cfg.distributed.context_parallel > 1:
        return "rowwise", "performance.fp8: auto: rowwise, the per-token scaling context parallelism allows"
    if not cfg.adapter.is_lora and fsdp:
        return "tensorwise", "performance.fp8: auto: tensorwise, measured faster than rowwise under FSDP2 (1.13x vs 0.97x bf16)"
    what = "a LoRA base" if cfg.adapter.is_lora else "a full fine-tune"
    return "tensorwise", f"performance.fp8: auto: tensorwise, measured faster than rowwise for {what} on one GPU"
