"""hone's experts backend: transformers' experts interface, running hone's grouped kernels.

transformers 5 routes every ``@use_experts_implementation`` experts module's forward through
``ExpertsInterface`` by the name in ``config._experts_implementation``. hone registers
:func:`hone_experts_forward` there under ``"hone"`` and selects it with the model's own
``set_experts_implementation``: the model code stays untouched (DESIGN.md, principle 2).

The module's flags (``is_transposed``, ``is_concatenated``, ``has_bias``, ``has_gate``,
``has_post_expert_norm``), its activation and its gate function are turned into an
:class:`~hone.kernels.moe_lora_reference.ExpertsLayout`; what the kernels do not cover
(ungated experts, a post-expert norm, transformers' own expert parallelism, an activation
other than SiLU or gpt_oss' clamped SwiGLU) is refused by :func:`experts_problems` before
training, naming the module and the alternatives. hone's own expert parallelism runs here: a
module split by it (:data:`EXPERT_SHARD_ATTR`) exchanges its tokens with the other ranks
(:func:`expert_parallel_forward`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers.integrations.moe import ExpertsInterface, _default_apply_gate

from hone.kernels.moe_lora import moe_experts, moe_triton_available
from hone.kernels.moe_lora_reference import ExpertsLayout, LoraFactors
from hone.kernels.moe_mxfp4 import moe_mxfp4_experts
from hone.kernels.moe_mxfp4_reference import moe_mxfp4_experts_reference
from hone.models.errors import ModelError
from hone.models.experts.mxfp4 import EXPERT_PROJECTIONS, has_mxfp4_experts, mxfp4_weights
from hone.parallel.expert_parallel import ExpertShard, expert_parallel_experts

HONE = "hone"
#: The attribute an experts module carries under hone's expert parallelism: its
#: :class:`~hone.parallel.expert_parallel.ExpertShard` (its parameters then hold that block only).
EXPERT_SHARD_ATTR = "hone_expert_shard"
#: The most tokens one forward of an expert-parallel module routes on a rank (micro-batch size x
#: sequence length): every rank sizes its exchange buffers from it, so they agree whatever each
#: rank's micro-batch holds.
EXPERT_TOKENS_ATTR = "hone_expert_max_tokens"
#: The pair rows a rank's experts hold per layer, set by ``distributed.expert_capacity_factor`` (an
#: int, computed once: no float reaches a compiled forward); None: the worst case, no overflow.
EXPERT_CAPACITY_ATTR = "hone_expert_capacity"
#: The consecutive token chunks its exchanges run in (``distributed.expert_parallel_chunks``; 1: one).
EXPERT_CHUNKS_ATTR = "hone_expert_chunks"
#: Whether its local experts are recomputed in the backward (``distributed.expert_parallel_recompute``).
EXPERT_RECOMPUTE_ATTR = "hone_expert_recompute"
#: With a capacity factor: the module's buffer counting the pairs over capacity on the device,
#: summed over its forwards until the run reads and clears it (once per micro-batch).
EXPERT_OVERFLOW_BUFFER = "hone_expert_overflow"
#: ``model.experts_implementation`` values: hone's kernels, or transformers' own two.
EXPERTS_IMPLEMENTATIONS = (HONE, "grouped_mm", "eager")


def is_experts_module(module: nn.Module) -> bool:
    """An experts module transformers dispatches through its experts interface."""
    return (
        hasattr(module, "is_transposed")
        and hasattr(module, "has_gate")
        and isinstance(getattr(module, "down_proj", None), (nn.Parameter, torch.Tensor))
    )


def experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, module) for name, module in model.named_modules() if is_experts_module(module)]


def _uses_default_gate(module: nn.Module) -> bool:
    return getattr(type(module), "_apply_gate", None) is _default_apply_gate


def layout_of(module: nn.Module) -> ExpertsLayout:
    """The kernels' description of ``module``'s weights and gate; ModelError where they cannot run it."""
    problem = layout_problem(module)
    if problem:
        raise ModelError(f"model.experts_implementation: hone cannot run {type(module).__name__}: {problem}")
    transposed = bool(module.is_transposed)
    interleaved = not bool(getattr(module, "is_concatenated", True))
    if _uses_default_gate(module):
        return ExpertsLayout(transposed=transposed, interleaved=interleaved, activation="silu")
    return ExpertsLayout(
        transposed=transposed,
        interleaved=interleaved,
        activation="clamped_swiglu",
        swiglu_alpha=float(module.alpha),
        swiglu_limit=float(module.limit),
    )


def layout_problem(module: nn.Module) -> str | None:
    """Why hone's kernels cannot compute ``module``'s experts (None: they can). Reads only the
    module's flags and classes, so it works on a meta-device model before any weight loads."""
    if not getattr(module, "has_gate", False):
        return "its experts have no gate (up_proj only); the kernels compute gated experts"
    if getattr(module, "has_post_expert_norm", False):
        return "it normalises each expert's output (has_post_expert_norm), which the kernels do not"
    if getattr(module, "_is_expert_parallel", False):
        return "it is expert-parallel; the kernels run all experts on one device"
    if _uses_default_gate(module):
        act = getattr(module, "act_fn", None)
        if not isinstance(act, nn.SiLU) and type(act).__name__ != "SiLUActivation":
            return f"its activation is {type(act).__name__}; the kernels' default gate is SiLU(gate) * up"
        return None
    if type(module).__name__ == "GptOssExperts" and hasattr(module, "alpha") and hasattr(module, "limit"):
        return None
    return f"its gate function {type(module).__name__}._apply_gate is not one the kernels know (SiLU, gpt_oss' clamped SwiGLU)"


def experts_problems(model: nn.Module, device: torch.device, reference_ok: bool = False) -> list[str]:
    """Why ``experts_implementation: hone`` cannot run ``model`` on ``device`` (empty: it can).
    ``reference_ok``: the plain-PyTorch path may compute the experts off CUDA (expert parallelism)."""
    modules = experts_modules(model)
    if not modules:
        return [
            "model.experts_implementation: hone applies to mixture-of-experts models; "
            f"{type(model).__name__} has no experts module"
        ]
    problems = []
    # MXFP4 and expert parallelism: their plain-PyTorch references run where the kernels cannot
    if not moe_triton_available(device) and not has_mxfp4_experts(model) and not reference_ok:
        problems.append(
            f"model.experts_implementation: hone runs Triton kernels, which need triton and a CUDA device "
            f"(this run is on {device.type}); use grouped_mm or eager"
        )
    seen = set()
    for _, module in modules:
        problem = layout_problem(module)
        if problem and type(module) not in seen:
            seen.add(type(module))
            problems.append(
                f"model.experts_implementation: hone cannot run {type(module).__name__}: {problem}; use grouped_mm or eager"
            )
    return problems


def _routing_args(args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(top_k_index, top_k_weights) whether passed by position or by either model's names."""
    values = list(args)
    for names in (("top_k_index", "router_indices"), ("top_k_weights", "routing_weights")):
        for name in names:
            if name in kwargs:
                values.append(kwargs[name])
    if len(values) != 2:
        raise TypeError(
            "experts forward expects (hidden_states, top_k_index, top_k_weights), "
            f"got {len(args)} positional and {sorted(kwargs)}"
        )
    return values[0], values[1]


def hone_experts_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    *args: Any,
    lora: dict[str, LoraFactors] | None = None,
    lora_scaling: dict[str, float] | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """The experts forward transformers calls for ``experts_implementation: hone``: the module's
    weights through :func:`hone.kernels.moe_lora.moe_experts`. ``lora`` / ``lora_scaling``
    (keyed ``gate_up_proj`` / ``down_proj``) are passed by hone's expert-LoRA layer
    (:mod:`hone.models.experts.lora`), never by transformers."""
    top_k_index, top_k_weights = _routing_args(args, kwargs)
    lora = lora or {}
    lora_scaling = lora_scaling or {}
    if getattr(self, EXPERT_SHARD_ATTR, None) is not None:  # bf16 or MXFP4 experts, split over the ranks
        return expert_parallel_forward(self, hidden_states, top_k_index, top_k_weights, lora, lora_scaling)
    if mxfp4_weights(self):
        return mxfp4_experts_forward(self, hidden_states, top_k_index, top_k_weights, lora, lora_scaling)
    return moe_experts(
        hidden_states,
        top_k_index,
        top_k_weights,
        self.gate_up_proj,
        self.down_proj,
        layout_of(self),
        self.gate_up_proj_bias if self.has_bias else None,
        self.down_proj_bias if self.has_bias else None,
        lora.get("gate_up_proj"),
        lora.get("down_proj"),
        lora_scaling.get("gate_up_proj", 1.0),
        lora_scaling.get("down_proj", 1.0),
    )


def expert_parallel_forward(
    module: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    lora: dict[str, LoraFactors],
    lora_scaling: dict[str, float],
) -> torch.Tensor:
    """The experts of a module holding one rank's block (:data:`EXPERT_SHARD_ATTR`): tokens go to
    the ranks owning their experts and come back (:func:`~hone.parallel.expert_parallel.expert_parallel_experts`).
    The capacity follows from the largest ``T`` any rank routes (:data:`EXPERT_TOKENS_ATTR`), the
    same on every rank whatever its micro-batch holds; the experts' pair rows are the worst case by
    default (no pair can overflow), or :data:`EXPERT_CAPACITY_ATTR`, whose overflow count is added to
    :data:`EXPERT_OVERFLOW_BUFFER` on the device for the run to check. MXFP4 experts pass their
    block's blocks and scales (the grouped MXFP4 kernels, or the float32 reference off CUDA)."""
    shard: ExpertShard = getattr(module, EXPERT_SHARD_ATTR)
    n_tokens = top_k_index.shape[0]
    max_tokens = getattr(module, EXPERT_TOKENS_ATTR, None) or n_tokens
    if n_tokens > max_tokens:
        raise ModelError(
            f"expert parallel: a forward routed {n_tokens} tokens on rank {shard.rank}, more than the {max_tokens} "
            "(training.micro_batch_size x data.sequence_len) its exchange buffers were sized for"
        )
    has_bias = bool(getattr(module, "has_bias", False))
    capacity = getattr(module, EXPERT_CAPACITY_ATTR, None)
    mx = _both_mxfp4(module) if mxfp4_weights(module) else None
    out, overflow = expert_parallel_experts(
        hidden_states,
        top_k_index,
        top_k_weights,
        module.gate_up_proj if mx is None else mx["gate_up_proj"],
        module.down_proj if mx is None else mx["down_proj"],
        layout_of(module),
        shard,
        biases=(module.gate_up_proj_bias, module.down_proj_bias) if has_bias else None,
        lora=(lora.get("gate_up_proj"), lora.get("down_proj")),
        scaling=lora_scaling.get("gate_up_proj", 1.0),
        down_scaling=lora_scaling.get("down_proj", 1.0),
        capacity=capacity,
        max_tokens=max_tokens,
        chunks=getattr(module, EXPERT_CHUNKS_ATTR, 1),
        recompute=getattr(module, EXPERT_RECOMPUTE_ATTR, False),
    )
    if capacity is not None:
        # the largest overflow of one forward, not a sum: a forward run again in the backward
        # (full checkpointing) would otherwise count its pairs twice
        counter = getattr(module, EXPERT_OVERFLOW_BUFFER)
        counter.copy_(torch.maximum(counter, overflow))
    return out


def _both_mxfp4(module: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{projection: (blocks, scales)}`` of a module holding MXFP4 experts; both projections or an error."""
    weights = mxfp4_weights(module)
    if set(weights) != set(EXPERT_PROJECTIONS):
        raise ModelError(
            f"{type(module).__name__}: MXFP4 experts need both {' and '.join(EXPERT_PROJECTIONS)} in MXFP4, "
            f"found only {', '.join(weights)}"
        )
    return weights


def mxfp4_experts_forward(
    module: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    lora: dict[str, LoraFactors],
    lora_scaling: dict[str, float],
) -> torch.Tensor:
    """The experts of a module holding MXFP4 weights (:mod:`hone.models.experts.mxfp4`): hone's
    grouped kernels decode the weight tiles in registers where they run (CUDA with triton, or
    Triton's interpreter); elsewhere (a CPU run, the tests) the plain-PyTorch reference computes
    the same function on the float32-dequantized weights, slowly but exactly."""
    weights = _both_mxfp4(module)
    layout = layout_of(module)
    has_bias = bool(getattr(module, "has_bias", False))
    args = (
        hidden_states,
        top_k_index,
        top_k_weights,
        weights["gate_up_proj"],
        weights["down_proj"],
        layout,
        module.gate_up_proj_bias if has_bias else None,
        module.down_proj_bias if has_bias else None,
        lora.get("gate_up_proj"),
        lora.get("down_proj"),
        lora_scaling.get("gate_up_proj", 1.0),
        lora_scaling.get("down_proj", 1.0),
    )
    if moe_triton_available(hidden_states.device):
        return moe_mxfp4_experts(*args)
    return moe_mxfp4_experts_reference(*args)


def register_hone_experts() -> None:
    """Make ``"hone"`` a name transformers' experts interface knows (idempotent)."""
    ExpertsInterface.register(HONE, hone_experts_forward)


def set_experts_implementation(model: nn.Module, implementation: str) -> dict[str, Any]:
    """Select ``implementation`` for every experts module of ``model`` through transformers'
    ``set_experts_implementation``; returns what was applied (for the plan record)."""
    if implementation not in EXPERTS_IMPLEMENTATIONS:
        raise ModelError(f"model.experts_implementation: {implementation!r} is not one of: {', '.join(EXPERTS_IMPLEMENTATIONS)}")
    modules = experts_modules(model)
    if implementation == HONE:
        register_hone_experts()
        for _, module in modules:
            layout_of(module)  # refuses what the kernels cannot run, before any step
    setter = getattr(model, "set_experts_implementation", None)
    if setter is None:
        raise ModelError(
            f"model.experts_implementation: {type(model).__name__} does not let transformers choose its experts implementation"
        )
    setter(implementation)
    return {"implementation": implementation, "experts_modules": len(modules)}
