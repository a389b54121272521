"""The float8 transform: the base's linear layers compute in float8 (``performance.fp8``).

Two cases, one switch:

- **LoRA on a frozen base**: each targeted projection's base layer (and, with
  ``performance.fp8_base_linears: all``, every other frozen linear but the output head) is
  replaced by an :class:`Fp8FrozenLinear` instance -- the same weight, quantized once into the
  two float8 layouts its forward and input-gradient matmuls need (:mod:`hone.kernels.fp8_linear`).
  The LoRA path stays in bf16; no weight gradient is computed. This runs on the adapted model
  (PEFT's ``lora.Linear`` keeps calling its ``base_layer``; only that instance changes).
- **Full fine-tuning**: torchao's float8 training (``convert_to_float8_training``): every
  linear but the output head and those with a dimension not a multiple of 16 becomes torchao's
  ``Float8Linear``, which quantizes weight, input and output gradient per call (all three
  matmuls in float8). Under FSDP2 with tensorwise scaling, weights are all-gathered in float8
  and their scales computed for all layers at once after each optimizer step. torchao computes
  the amax of current scaling where the scale is computed (the FSDP pre-all-gather hook reduces
  it over the mesh it is handed), so a converted module holds no process group: it deep-copies
  and pickles. ``performance.fp8_emulate`` runs this case through torchao's emulation where the
  device has no float8 matmuls (the CPU tests of FSDP2 and resume). Context parallelism is
  refused wherever a scale spans a tensor's tokens (each rank holds part of the sequence).

Why the frozen base keeps its bf16 weight on the GPU: PEFT reads ``base_layer.weight`` outside
the forward (merging and unmerging adapters, dtype and device look-ups), hone's eval and
generation run the same modules, and a checkpoint of the base must stay loadable by anything
that does not know float8. An 8B base costs 16 GB more than bf16 alone; on an 80 GB card beside
LoRA activations that fits, and a later option can drop the bf16 copy once PEFT's merge is
routed through a dequantization. The float8 copies are non-persistent buffers: they follow the
module across devices and are never saved. DDP broadcasts every buffer once, when it wraps the
model (hone turns the per-forward broadcast off); collectives take no float8 on gloo, so the
copies are stored as their uint8 bytes and viewed as float8 in the forward.

Ordered after the quantized-base slot (an NF4 base cannot also be float8) and before tiled
MLP, checkpointing and compile, which wrap and trace the swapped modules as they are.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hone.config.root import HoneConfig
from hone.kernels.fp8_linear import FP8 as FLOAT8
from hone.kernels.fp8_linear import FrozenFp8Weight, Mode, fp8_frozen_linear, quantize_frozen_weight
from hone.transforms.base import Decisions, PlanContext, Transform
from hone.transforms.fp8_sizes import SmallLinears, converts_to_fp8, too_small_for_fp8
from hone.transforms.fp8_sizes import fits_fp8 as fits_fp8_shape

#: float8 matmuls (``torch._scaled_mm``) need compute capability 8.9 (Ada) or newer (Hopper: 9.0).
MIN_CAPABILITY = (8, 9)

# ---------------------------------------------------------------- the frozen-base layer


class Fp8FrozenLinear(nn.Linear):
    """An ``nn.Linear`` whose frozen weight is multiplied in float8 (its gradient is never
    computed). A subclass, so whatever checks for a linear layer (PEFT, hone's target checks)
    still sees one; the weight and bias are the original layer's parameters, shared."""

    w_q: torch.Tensor
    w_scale: torch.Tensor
    wt_q: torch.Tensor
    wt_scale: torch.Tensor

    def __init__(self, linear: nn.Linear, mode: Mode) -> None:
        super().__init__(linear.in_features, linear.out_features, bias=False, device="meta")
        self.weight = linear.weight
        self.bias = linear.bias
        self.mode = mode
        self.requantize()

    def requantize(self) -> None:
        """Quantize the weight again (after it was changed in place, e.g. loaded)."""
        if self.weight.requires_grad:
            raise ValueError("Fp8FrozenLinear takes a frozen weight (requires_grad=False)")
        q = quantize_frozen_weight(self.weight.detach(), self.mode)
        # not persistent: derived from the weight, so never written to a checkpoint. The float8
        # bytes are kept as uint8: DDP broadcasts every buffer from rank 0 when it wraps the
        # model, and collectives take uint8 on every backend (gloo has no float8 type).
        self.register_buffer("w_q", q.w_q.view(torch.uint8), persistent=False)
        self.register_buffer("w_scale", q.w_scale, persistent=False)
        self.register_buffer("wt_q", q.wt_q.view(torch.uint8), persistent=False)
        self.register_buffer("wt_scale", q.wt_scale, persistent=False)

    @property
    def fp8_weight(self) -> FrozenFp8Weight:
        """The quantized weight as the kernel takes it. ``float()`` is a no-op unless a
        ``model.to(dtype)`` cast the float32 scales (it leaves the uint8 bytes alone)."""
        return FrozenFp8Weight(self.w_q.view(FLOAT8), self.w_scale.float(), self.wt_q.view(FLOAT8), self.wt_scale.float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fp8_weight = self.fp8_weight
        # the matmul writes the weight's dtype (bf16): under autocast the input may be float32
        y = fp8_frozen_linear(x.to(self.weight.dtype), fp8_weight)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8={self.mode}"


def fits_fp8(linear: nn.Linear) -> bool:
    """``_scaled_mm`` needs both dimensions of the weight to be multiples of 16."""
    return fits_fp8_shape(linear.in_features, linear.out_features)


def too_small(linear: nn.Linear, mode: Mode) -> bool:
    """:func:`hone.transforms.fp8_sizes.too_small_for_fp8` of ``linear``'s shape."""
    return too_small_for_fp8(linear.in_features, linear.out_features, mode)


def _output_head(model: nn.Module) -> nn.Module | None:
    get = getattr(model, "get_output_embeddings", None)
    return get() if callable(get) else None


def convert_frozen_base(model: nn.Module, mode: Mode, scope: str = "lora_targets", small: SmallLinears = "fp8") -> dict[str, Any]:
    """Swap frozen base linears for :class:`Fp8FrozenLinear` in place; returns what it did.

    ``scope``: ``lora_targets`` -- the base layer of every LoRA-wrapped linear;
    ``all`` -- also every other frozen ``nn.Linear`` but the output head. Layers with a
    dimension that is not a multiple of 16 stay as they are (counted as skipped), and so, with
    ``small="bf16"``, do those :func:`too_small` (counted as kept small)."""
    from peft.tuners.lora import LoraLayer

    head = _output_head(model)
    converted, skipped, kept_small = 0, [], []

    def eligible(name: str, linear: nn.Linear) -> bool:
        if not fits_fp8(linear):
            skipped.append(name)
            return False
        if small == "bf16" and too_small(linear, mode):
            kept_small.append(name)
            return False
        return True

    lora_bases: set[int] = set()
    for name, module in list(model.named_modules()):
        if not isinstance(module, LoraLayer):
            continue
        base = module.get_base_layer()
        if type(base) is not nn.Linear:  # already converted, or not a plain linear (embedding, conv, experts)
            continue
        lora_bases.add(id(base))
        if not eligible(name, base):
            continue
        _replace_base_layer(module, Fp8FrozenLinear(base, mode))
        converted += 1
    if scope == "all":
        for name, parent, child_name, child in _linear_children(model):
            if id(child) in lora_bases or child is head or child.weight.requires_grad:
                continue
            if not eligible(name, child):
                continue
            setattr(parent, child_name, Fp8FrozenLinear(child, mode))
            converted += 1
    return {
        "mode": mode,
        "case": "frozen base (LoRA)",
        "scope": scope,
        "converted": converted,
        "skipped": skipped,
        "kept_bf16_small": kept_small,
    }


def _replace_base_layer(lora_layer: nn.Module, new: nn.Module) -> None:
    """PEFT's ``LoraLayer`` holds the original layer as its ``base_layer`` submodule (possibly
    nested); replace that instance at the innermost level."""
    holder = lora_layer
    while isinstance(getattr(holder, "base_layer", None), nn.Module) and hasattr(holder.base_layer, "base_layer"):
        holder = holder.base_layer
    holder.base_layer = new


def _linear_children(model: nn.Module):
    """(qualified name, parent, attribute, module) of every plain ``nn.Linear``."""
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                yield (f"{parent_name}.{child_name}" if parent_name else child_name), parent, child_name, child


# ---------------------------------------------------------------- full fine-tuning (torchao)


def float8_training_config(mode: Mode, fsdp_float8_all_gather: bool = False, emulate: bool = False):
    """torchao's recipe for ``mode``; float8 all-gather only with tensorwise scaling (torchao's
    rowwise weights are gathered in bf16 and scaled per row after the gather)."""
    from torchao.float8 import Float8LinearConfig

    config = Float8LinearConfig.from_recipe_name(mode)
    return dataclasses.replace(
        config, enable_fsdp_float8_all_gather=fsdp_float8_all_gather and mode == "tensorwise", emulate=emulate
    )


def full_finetune_filter(model: nn.Module, mode: Mode, small: SmallLinears = "fp8") -> Callable[[nn.Module, str], bool]:
    """torchao's ``module_filter_fn``: every linear but the output head (its vocabulary-wide
    logits feed the loss; float8 there costs accuracy for little time), those with a dimension
    that is not a multiple of 16 and, with ``small="bf16"``, those :func:`too_small`.
    Embeddings are not linears and stay as they are."""
    head = _output_head(model)

    def keep(module: nn.Module, fqn: str) -> bool:
        if module is head or fqn.split(".")[-1] == "lm_head":
            return False
        return isinstance(module, nn.Linear) and converts_to_fp8(module.in_features, module.out_features, mode, small)

    return keep


def convert_full_finetune(
    model: nn.Module, mode: Mode, fsdp_float8_all_gather: bool = False, emulate: bool = False, small: SmallLinears = "fp8"
) -> dict[str, Any]:
    """torchao's float8 training on every eligible linear (:func:`full_finetune_filter`), in
    place; returns what it did. ``emulate`` computes the float8 matmuls in high precision (CPU tests)."""
    from torchao.float8 import convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    config = float8_training_config(mode, fsdp_float8_all_gather, emulate)
    linears = sum(1 for m in model.modules() if type(m) is nn.Linear)
    convert_to_float8_training(model, config=config, module_filter_fn=full_finetune_filter(model, mode, small))
    cast_once = 0
    if config.enable_fsdp_float8_all_gather:
        from hone.transforms.fp8_cast_once import use_cast_once

        cast_once = use_cast_once(model)
    converted = sum(1 for m in model.modules() if isinstance(m, Float8Linear))
    head = _output_head(model)
    small_kept = 0
    if small == "bf16":
        small_kept = sum(
            1 for m in model.modules() if type(m) is nn.Linear and m is not head and fits_fp8(m) and too_small(m, mode)
        )
    return {
        "mode": mode,
        "case": "full fine-tune (torchao float8 training)",
        "converted": converted,
        "kept_high_precision": linears - converted,
        "kept_bf16_small": small_kept,
        "fsdp_float8_all_gather": config.enable_fsdp_float8_all_gather,
        "cast_once_per_step": cast_once,
        "emulated": emulate,
    }


def precompute_scales(model: nn.Module) -> None:
    """After each optimizer step: the float8 scales of every FSDP-sharded weight in one
    all-reduce, then each shard cast to float8 once with its scale
    (:func:`hone.transforms.fp8_cast_once.cast_shards`); tensorwise float8 all-gather only, a
    no-op for any other model."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    from hone.transforms.fp8_cast_once import cast_shards

    precompute_float8_dynamic_scale_for_fsdp(model)
    cast_shards(model)


# ---------------------------------------------------------------- the transform


def fp8_device_problems(device: torch.device, capability: tuple[int, int] | None = None) -> list[str]:
    """Whether ``device`` has float8 matmuls. ``capability`` overrides the device's own (tests);
    on a CUDA device this process cannot see (``hone plan`` for a GPU on a CPU machine) the
    check is left to the run."""
    if device.type != "cuda":
        return [
            f"performance.fp8 needs float8 matmuls, which this run's device ({device.type}) lacks: allowed only on "
            "CUDA GPUs of compute capability >= 8.9 (Ada, Hopper or newer); use fp8: off"
        ]
    if capability is None:
        if not torch.cuda.is_available():
            return []
        capability = torch.cuda.get_device_capability(device)
    if tuple(capability) < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device) if torch.cuda.is_available() else "this GPU"
        return [
            f"performance.fp8 needs float8 matmuls: {name} has compute capability {capability[0]}.{capability[1]}, "
            f"float8 needs >= {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} (Ada, Hopper or newer); use fp8: off"
        ]
    return []


def _check(ctx: PlanContext) -> list[str]:
    cfg = ctx.cfg
    emulated = cfg.performance.fp8_emulate and not cfg.adapter.is_lora
    problems = [] if emulated else fp8_device_problems(ctx.facts.device)
    if cfg.performance.fp8_emulate and cfg.adapter.is_lora:
        problems.append(
            "performance.fp8_emulate: true applies to a full fine-tune (torchao's emulated float8); a LoRA base "
            "computes through torch._scaled_mm, which has no emulation: set fp8_emulate: false, or adapter.type: none"
        )
    if not cfg.adapter.is_lora and importlib.util.find_spec("torchao") is None:
        problems.append(
            "performance.fp8 on a full fine-tune uses torchao's float8 training, but the package 'torchao' is not "
            "installed: pip install torchao, or fp8: off"
        )
    autotuned = _max_autotune_gemm_source(cfg)
    if autotuned:
        problems.append(
            f"performance.fp8 with Inductor's max-autotune matmul templates ({autotuned}) does not compile on an H100 "
            "with torch 2.11: for the frozen base Inductor finds no valid choice for the float8 matmul "
            "(NoValidChoicesError), and a float8 full fine-tune did not finish compiling in 500 s "
            "(docs/quantization.md); remove it, or use fp8: off"
        )
    problems += _context_parallel_problems(ctx)
    problems += _head_problems(ctx)
    if cfg.adapter.is_lora and ctx.decided.strategy == "fsdp":
        problems.append(
            "performance.fp8 on a frozen LoRA base quantizes each whole weight once, which FSDP2's sharded "
            "weights do not allow: use distributed.strategy: ddp with LoRA, or fp8: off"
        )
    return problems


def _head_problems(ctx: PlanContext) -> list[str]:
    """``fp8_head`` needs a frozen head (LoRA), the fused SFT loss it runs inside, and a head
    ``_scaled_mm`` can multiply (both dimensions multiples of 16)."""
    from hone.transforms.loss import loss_decision
    from hone.transforms.memory.facts import model_facts

    cfg = ctx.cfg
    if not cfg.performance.fp8_head:
        return []
    if not cfg.adapter.is_lora:
        return [
            "performance.fp8_head: true applies to a frozen output head (LoRA); a full fine-tune trains its head, which "
            "stays in bf16: set fp8_head: false, or adapter.type: lora"
        ]
    trained = [m for m in cfg.adapter.lora_modules_to_save if m in ("lm_head", "embed_tokens")]
    if trained:
        return [
            f"performance.fp8_head: true needs a frozen output head, but adapter.lora_modules_to_save trains "
            f"{', '.join(trained)} (the head, or the embedding a tied head shares): set fp8_head: false, or remove it"
        ]
    if cfg.training.is_preference:
        return [
            f"performance.fp8_head: true runs inside the fused SFT loss; training.objective: {cfg.training.objective} "
            "computes per-sequence log-probabilities with its own kernel: set fp8_head: false"
        ]
    kind, why = loss_decision(cfg)
    if kind != "fused_linear_ce":
        return [f"performance.fp8_head: true runs inside the fused loss, but the loss is {kind} ({why}): set fp8_head: false"]
    m = model_facts(cfg)  # the head the estimate counts the copies of
    vocab, hidden = m.vocab, m.hidden
    if not fits_fp8_shape(hidden, vocab):
        return [
            f"performance.fp8_head: true needs an output head whose dimensions are multiples of 16 for float8 "
            f"matmuls; this model's is {vocab} x {hidden}: set fp8_head: false"
        ]
    return []


def _context_parallel_problems(ctx: PlanContext) -> list[str]:
    """Context parallelism gives each rank part of every sequence. A scale taken over a whole
    tensor's tokens (tensorwise activations and output gradients; the weight gradient's per-column
    scales over the tokens in torchao's rowwise recipe) would then come from that part only: the
    run would quantize differently from one process on the whole sequence, which hone does not
    allow. Per-token scales (the frozen base's rowwise mode) do not depend on the split."""
    n = ctx.decided.context_parallel
    perf = ctx.cfg.performance
    if n <= 1 or (ctx.cfg.adapter.is_lora and ctx.decided.fp8 == "rowwise"):
        return []
    what = "a frozen LoRA base" if ctx.cfg.adapter.is_lora else "a full fine-tune"
    asked = perf.fp8 if perf.fp8 == ctx.decided.fp8 else f"{perf.fp8} ({ctx.decided.fp8})"
    return [
        f"performance.fp8: {asked} on {what} with distributed.context_parallel: {n}: each rank would scale its "
        "activations and gradients by the amax of its own part of the sequence, not of the whole, so the run would not "
        "compute what one process computes; allowed with context parallelism: fp8: rowwise with LoRA (per-token "
        "scales); else set distributed.context_parallel: 1 or performance.fp8: off"
    ]


def _max_autotune_gemm_source(cfg: HoneConfig) -> str | None:
    """The key that turns on Inductor's autotuned matmul templates, if any does."""
    perf = cfg.performance
    if not perf.may_compile:
        return None
    if perf.torch_compile_options.get("max_autotune_gemm") is True:
        return "performance.torch_compile_options.max_autotune_gemm: true"
    if perf.torch_compile_mode in ("max-autotune", "max-autotune-no-cudagraphs"):
        return f"performance.torch_compile_mode: {perf.torch_compile_mode}"
    return None


#: Models whose weights FSDP2 all-gathers in float8: their scales and float8 shards are computed
#: after each optimizer step (:mod:`hone.transforms.fp8_cast_once`). Kept beside the model
#: (nothing is added to a transformers object).
_PRECOMPUTE: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def _apply(model: nn.Module, ctx: PlanContext) -> dict[str, Any]:
    perf = ctx.cfg.performance
    mode: Mode = ctx.decided.fp8  # type: ignore[assignment]
    if ctx.cfg.adapter.is_lora:
        return convert_frozen_base(model, mode, ctx.decided.fp8_base_linears, perf.fp8_small_linears)
    fsdp = ctx.decided.strategy == "fsdp"
    details = convert_full_finetune(
        model, mode, fsdp_float8_all_gather=fsdp, emulate=perf.fp8_emulate, small=perf.fp8_small_linears
    )
    if details["fsdp_float8_all_gather"]:
        _PRECOMPUTE.add(model)
    return details


def _after_step(model: nn.Module) -> None:
    """Without this the float8 all-gather still works, computing each layer's scale (one small
    all-reduce per layer) and casting its shard in its pre-all-gather hook, for the forward's
    gather and again for the backward's; precomputed, the scales are one all-reduce in all and
    each shard is cast once per step."""
    if model in _PRECOMPUTE:
        precompute_scales(model)


def fp8_why(cfg: HoneConfig, decided: Decisions) -> str:
    """The fp8 line of ``hone plan``: which linears go float8, and how (the plan's decisions:
    the scaling, :func:`hone.transforms.fp8_sizes.fp8_scaling`, and a LoRA base's linears)."""
    perf = cfg.performance
    if decided.fp8 == "off":
        return decided.fp8_why
    narrow = "; narrow linears stay bf16 (fp8_small_linears: bf16)" if perf.fp8_small_linears == "bf16" else ""
    if cfg.adapter.is_lora:
        which = "LoRA target projections" if decided.fp8_base_linears == "lora_targets" else "all frozen linears but the head"
        head = "; the output head in float8 too, rowwise, inside the fused loss (fp8_head)" if perf.fp8_head else ""
        return (
            f"{decided.fp8_why}; frozen base in float8 ({which}, weights quantized once; {decided.fp8_base_linears_why}), "
            f"LoRA in bf16{narrow}{head}"
        )
    emulated = "; emulated (fp8_emulate: float8 rounding, high-precision matmuls)" if perf.fp8_emulate else ""
    how = "full fine-tune through torchao's float8 training (all linears but the head)"
    return f"{decided.fp8_why}; {how}{narrow}{emulated}"


def _label(d: dict[str, Any]) -> str:
    kind = "frozen base" if d.get("case", "").startswith("frozen") else "torchao training"
    extra = ", float8 all-gather" if d.get("fsdp_float8_all_gather") else ""
    extra += ", emulated" if d.get("emulated") else ""
    return f"fp8 ({d.get('mode')}, {kind}, {d.get('converted')} linears{extra})"


FP8 = Transform(
    name="fp8",
    switch="performance.fp8",
    wanted=lambda ctx: ctx.decided.fp8 != "off",
    check=_check,
    why=lambda ctx: fp8_why(ctx.cfg, ctx.decided),
    model=_apply,
    after_optimizer_step=_after_step,
    label=_label,
)
