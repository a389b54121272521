"""The experts backend transform: which implementation computes the MoE experts.

``model.experts_implementation: auto`` (the default) is decided once per plan by
:func:`experts_choice`: hone's kernels where they run (CUDA, triton, an experts layout they
know), transformers' ``grouped_mm`` elsewhere; MXFP4 experts (an MXFP4 checkpoint or
``model.quantize: mxfp4``) run only in hone's (its float32 reference off CUDA). A choice other than transformers' default
(``grouped_mm``) is applied to the base model, before the adapter: the adapter reads it to decide whether LoRA on the
experts runs inside hone's fused kernels (:mod:`hone.models.experts.lora`). Like the attention
backend, it goes through transformers' own registry and ``set_experts_implementation``; no
module is swapped. What the kernels cannot run (ungated experts, a post-expert norm, an unknown
gate function) is refused when the model is known, with the module named.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hone.config.root import HoneConfig
from hone.models.errors import ModelError
from hone.models.experts.backend import experts_problems, set_experts_implementation
from hone.transforms.base import PlanContext, RunFacts, Transform
from hone.transforms.memory.facts import model_facts, mxfp4_experts

#: What ``auto`` gains, measured (benchmarks/2026-11-26-h100-moe-lora-model.md).
_MEASURED = "qwen3-30b-a3b 8 layers, expert LoRA, compiled, on an H100: 64 ms a step, 91 ms on grouped_mm; 36 ms with CUDA graphs"


def _triton_missing_here() -> bool:
    """triton is required only where this process will run on a CUDA device itself: a CPU-only
    torch has no triton, yet ``hone plan`` there plans a run for a GPU machine that has it."""
    # the kernels' modules import triton where it is installed: only for a run that asks for them
    from hone.kernels.moe_lora_triton import triton

    return triton is None and torch.cuda.is_available()


def experts_choice(cfg: HoneConfig, facts: RunFacts, expert_parallel: int | None = None) -> tuple[str, str]:
    """(implementation, why) of ``model.experts_implementation`` for this run: as written, or
    what ``auto`` decides from the device and the model's experts modules (read on the meta
    device). ``auto`` never fails a run: where the model cannot be read it keeps transformers'.
    ``expert_parallel``: the plan's decided size (over 1: hone, which holds the exchange; None: as
    written, ``auto`` counting as 1)."""
    asked = cfg.model.experts_implementation
    mxfp4 = mxfp4_experts(cfg)
    if mxfp4 is not None:
        return _mxfp4_choice(asked, mxfp4, facts)
    written = cfg.distributed.expert_parallel
    ep = expert_parallel if expert_parallel is not None else written if isinstance(written, int) else 1
    if ep > 1:  # the config's validator (or auto's rule) refused eager and grouped_mm
        return "hone", (
            f"experts_implementation: {asked}: hone, whose experts forward holds the exchange of "
            f"distributed.expert_parallel: {ep} (its kernels on CUDA, their float32 reference elsewhere)"
        )
    if asked != "auto":
        return asked, f"model.experts_implementation: {asked}"
    fallback = "experts_implementation: auto: grouped_mm (transformers' default)"
    if facts.device.type != "cuda":
        return "grouped_mm", f"{fallback}: hone's Triton kernels run on CUDA only (this run: {facts.device.type})"
    if _triton_missing_here():
        return "grouped_mm", f"{fallback}: hone's kernels need the Python package 'triton', which is not installed"
    try:
        model = model_facts(cfg)
    except Exception as exc:  # noqa: BLE001 -- auto falls back; the reason goes on record
        return "grouped_mm", f"{fallback}: the model could not be read ({type(exc).__name__}: {exc})"
    if not any(layer.moe for layer in model.layers):
        return "grouped_mm", f"{fallback}: no mixture-of-experts layers (nothing to compute)"
    if model.experts_layout_problems:
        return "grouped_mm", f"{fallback}: hone's kernels cannot run {model.experts_layout_problems[0]}"
    return "hone", f"experts_implementation: auto: hone, its kernels run this model's experts on CUDA ({_MEASURED})"


def _mxfp4_choice(asked: str, mxfp4: str, facts: RunFacts) -> tuple[str, str]:
    """MXFP4 experts run only in hone's experts forward: its kernels on CUDA, their float32
    reference elsewhere; transformers' implementations would read the placeholder weights."""
    if asked in ("eager", "grouped_mm"):
        raise ModelError(
            f"model.experts_implementation: '{asked}' cannot run MXFP4 experts ({mxfp4}): they run only in hone's "
            "kernels (their float32 reference off CUDA); allowed: auto, hone"
        )
    where = (
        "its MXFP4 kernels on CUDA"
        if facts.device.type == "cuda"
        else f"the float32 reference of its MXFP4 kernels on {facts.device.type} (slow; CUDA runs the kernels)"
    )
    return "hone", f"experts_implementation: {asked}: hone, the only one that runs MXFP4 experts ({mxfp4}): {where}"


def _check(ctx: PlanContext) -> list[str]:
    """hone's kernels need CUDA (or Triton's interpreter, in tests) and triton. Not a validator:
    the device and the installed packages are the run's (see :func:`_triton_missing_here`)."""
    facts = ctx.facts
    if ctx.decided.experts_implementation != "hone" or ctx.cfg.model.experts_implementation == "auto":
        return []  # auto chose hone only where it runs
    if ctx.decided.expert_parallel > 1:
        return []  # the expert-parallel path computes with the kernels' reference where they cannot run
    from hone.kernels.moe_lora import moe_triton_available

    if facts.device.type == "cuda":
        if _triton_missing_here():
            return [
                "model.experts_implementation: hone runs Triton kernels, but the Python package 'triton' "
                "is not installed (CUDA builds of torch bring it): install it, or use grouped_mm or eager"
            ]
        return []
    if moe_triton_available(facts.device):  # the interpreter (tests)
        return []
    if mxfp4_experts(ctx.cfg) is not None:  # MXFP4 experts off CUDA: the float32 reference computes them
        return []
    return [
        "model.experts_implementation: hone runs Triton kernels on CUDA devices only "
        f"(this run is on {facts.device.type}); use grouped_mm or eager"
    ]


def _apply(model: nn.Module, ctx: PlanContext) -> dict[str, Any]:
    implementation = ctx.decided.experts_implementation
    if implementation == "hone":
        problems = experts_problems(model, ctx.facts.device, reference_ok=ctx.decided.expert_parallel > 1)
        if problems:
            raise ModelError("; ".join(problems))
    details = set_experts_implementation(model, implementation)
    details["why"] = ctx.decided.experts_why
    return details


EXPERTS = Transform(
    name="experts",
    switch="model.experts_implementation",
    wanted=lambda ctx: ctx.decided.experts_implementation != "grouped_mm",
    why=lambda ctx: ctx.decided.experts_why,
    check=_check,
    stage="base",
    model=_apply,
    label=lambda d: f"experts ({d['implementation']}, {d['experts_modules']} MoE layers)",
)
