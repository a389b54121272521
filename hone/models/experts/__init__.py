"""Mixture-of-experts backends: hone's fused grouped-GEMM experts registered with transformers'
experts interface (``backend``), and LoRA on the experts computed inside those kernels and
saved in PEFT's ``target_parameters`` layout (``lora``). See docs/moe.md."""

from hone.models.experts.backend import (
    EXPERTS_IMPLEMENTATIONS,
    HONE,
    experts_modules,
    experts_problems,
    hone_experts_forward,
    layout_of,
    register_hone_experts,
    set_experts_implementation,
)

__all__ = [
    "EXPERTS_IMPLEMENTATIONS",
    "HONE",
    "experts_modules",
    "experts_problems",
    "hone_experts_forward",
    "layout_of",
    "register_hone_experts",
    "set_experts_implementation",
]
