"""The experts backend transform: which implementation computes the MoE experts.

``model.experts_implementation`` other than transformers' default (``grouped_mm``) is applied
to the base model, before the adapter: the adapter reads it to decide whether LoRA on the
experts runs inside hone's fused kernels (:mod:`hone.models.experts.lora`). Like the attention
backend, it goes through transformers' own registry and ``set_experts_implementation``; no
module is swapped. What the kernels cannot run (ungated experts, a post-expert norm, an unknown
gate function) is refused when the model is known, with the module named.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hone.models.errors import ModelError
from hone.models.experts.backend import experts_problems, set_experts_implementation
from hone.transforms.base import PlanContext, Transform


def _check(ctx: PlanContext) -> list[str]:
    """hone's kernels need CUDA (or Triton's interpreter, in tests) and triton. Not a validator:
    a CPU-only torch has no triton, yet ``hone plan`` there plans a run for a GPU machine that has
    it, so triton is required only where this process will run on a CUDA device itself."""
    facts = ctx.facts
    if ctx.cfg.model.experts_implementation != "hone":
        return []
    # the kernels' modules import triton where it is installed: only for a run that asks for them
    from hone.kernels.moe_lora import moe_triton_available
    from hone.kernels.moe_lora_triton import triton

    if facts.device.type == "cuda":
        if triton is None and torch.cuda.is_available():
            return [
                "model.experts_implementation: hone runs Triton kernels, but the Python package 'triton' "
                "is not installed (CUDA builds of torch bring it): install it, or use grouped_mm or eager"
            ]
        return []
    if moe_triton_available(facts.device):  # the interpreter (tests)
        return []
    return [
        "model.experts_implementation: hone runs Triton kernels on CUDA devices only "
        f"(this run is on {facts.device.type}); use grouped_mm or eager"
    ]


def _apply(model: nn.Module, ctx: PlanContext) -> dict[str, Any]:
    implementation = ctx.cfg.model.experts_implementation
    if implementation == "hone":
        problems = experts_problems(model, ctx.facts.device)
        if problems:
            raise ModelError("; ".join(problems))
    return set_experts_implementation(model, implementation)


EXPERTS = Transform(
    name="experts",
    switch="model.experts_implementation",
    wanted=lambda ctx: ctx.cfg.model.experts_implementation != "grouped_mm",
    check=_check,
    stage="base",
    model=_apply,
    label=lambda d: f"experts ({d['implementation']}, {d['experts_modules']} MoE layers)",
)
