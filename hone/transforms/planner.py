"""The optimization planner: which transforms a run applies, in which order, and the record.

Each optimization is a :class:`~hone.transforms.base.Transform`. Combinations the config
alone can rule out are refused earlier, by the config's validators (``hone validate`` catches
them); the checks here are the ones that need the run: the device and the shapes of the
prepared data.

The order is fixed and is the order of :data:`TRANSFORMS` (torchtitan's ``parallelize`` is the
model: one list, read top to bottom):

1. ``attention`` (base model) -- the attention kernel for this device and data: the backend the
   config names, with packed ``sdpa`` rows switched to torch's varlen kernel where it runs. It
   decides once how packed micro-batches reach the attention (boundaries or hone's mask).
   Everything after it traces the attention the run will really use.
2. ``quantize`` (base model) -- ``model.quantize: nf4``: every linear layer but the head swapped
   for a frozen 4-bit one (:mod:`hone.transforms.quantize`), one layer at a time onto the device
   (the loader builds a quantized base on the CPU). It swaps modules, so it comes before anything
   that wraps or traces layers; the adapter then wraps the 4-bit layers with LoRA.
2b. ``experts`` (base model) -- the MoE experts implementation (``model.experts_implementation``,
   :mod:`hone.transforms.experts`); before the adapter, which reads it to fuse expert LoRA.
   (later: fused kernels -- they swap modules, so they come before anything that
   wraps or traces layers.)
   ``fp8`` (adapted model) -- float8 matmuls for the base's linears (``performance.fp8``,
   :mod:`hone.transforms.fp8`): with LoRA, the base layer inside each PEFT wrapper is replaced by
   one on a float8 weight quantized once; a full fine-tune goes through torchao's float8
   training. It swaps module instances, so it comes after the quantized-base slot (a 4-bit base
   is not also float8) and before tiled MLP, checkpointing, compile and FSDP2, which wrap, trace
   and shard the swapped modules (FSDP2 then all-gathers tensorwise weights in float8).
3. ``tiled_mlp`` (adapted model) -- each decoder layer's MLP instance replaced by one that
   computes it in shards of tokens under recomputation. It takes the PEFT-wrapped projections as
   they are (so it runs on the adapted model), and comes before checkpointing and compile, which
   wrap and trace the layer with the tiled MLP inside (a checkpointed layer recomputes the tiled
   forward; a compiled layer breaks its graph around it). ``auto`` tiles only when the memory
   estimate says the MLP's activations are what does not fit.
4. ``loss`` -- the loss function: the fused linear cross-entropy where it applies, else the
   standard one. It changes no module; it sits before compile so that a compiled run compiles
   the standard loss along with the layers.
5. ``activation_checkpointing`` (adapted model) -- recompute (or offload) each decoder layer's
   activations. transformers' checkpointing layer wraps each layer's call, so the layer compiled
   next runs inside the checkpoint; ``selective`` under Inductor is the compiler's activation
   memory budget instead (set around each micro-batch by its step context).
5b. ``tiled_layers`` (adapted model) -- each decoder layer replaced by one that computes it in
   chunks of the sequence, forward and backward (:mod:`hone.transforms.tiled_layers`). It is the
   layer's checkpoint, so it comes after checkpointing (whose flag it switches off on the inner
   layer, and whose offloader then moves the tiled layers' saved inputs) and before compile,
   which compiles each tiled layer's inner layer, the code the chunks run.
6. ``compile`` -- ``torch.compile`` of each decoder layer or of the whole decoder. Compilation
   traces whatever modules it finds, so everything that swaps modules or kernels goes before.
7. (later: context parallelism.)
8. ``ddp`` / ``fsdp`` -- data parallelism over several processes (``distributed.strategy``; one
   of the two on a world of several processes, :func:`hone.transforms.data_parallel.resolve_strategy`).
   ``ddp``: DistributedDataParallel around the module the loop calls per micro-batch, gradients
   summed across ranks. ``fsdp``: FSDP2 ``fully_shard`` of each decoder layer, then of that
   per-micro-batch module as the root unit (:mod:`hone.transforms.fsdp`). Both must see the
   final modules: each layer is compiled in place first, then sharded (the order of torchtitan's
   ``parallelize``), and the checkpointing wrapper calls the sharded layer. So they come last.

The applied list is printed and written to ``optimizations.json`` in the run directory,
together with what was skipped and why, and the compile counts once training ends.
"""

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hone.config.root import HoneConfig
from hone.errors import HoneError
from hone.run_files import OPTIMIZATIONS_FILE
from hone.transforms import compile as compile_transform
from hone.transforms.base import RunFacts, RunHooks, Stage, Transform
from hone.runtime.step import StepModule
from hone.transforms.data_parallel import DDP, resolve_strategy
from hone.transforms.experts import EXPERTS
from hone.transforms.fp8 import FP8
from hone.transforms.inductor import configure_cache_dir
from hone.transforms.quantize import QUANTIZE

__all__ = ["TRANSFORMS", "Applied", "Plan", "PlanError", "RunFacts", "Transform", "plan_optimizations", "write_record"]



class PlanError(HoneError):
    """The run cannot apply an optimization its config asks for."""


@dataclass
class Applied:
    name: str
    switch: str
    details: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------- the CUDA allocator


def _allocator_choice(cfg: HoneConfig, facts: RunFacts):
    from hone.transforms.allocator import allocator_choice

    return allocator_choice(cfg, facts.device.type)


ALLOCATOR = Transform(
    name="allocator",
    switch="memory.expandable_segments",
    # configured by run_training before CUDA starts (hone.transforms.allocator); recorded here
    wanted=lambda cfg, facts: _allocator_choice(cfg, facts).expandable,
    why=lambda cfg, facts: _allocator_choice(cfg, facts).why,
    stage="base",
    model=lambda model, cfg, facts: _allocator_choice(cfg, facts).record(),
    label=lambda details: "allocator (expandable segments)",
)


# ---------------------------------------------------------------- 1. attention kernel


def _attention_check(cfg: HoneConfig, facts: RunFacts) -> list[str]:
    from hone.models.attention.setup import attention_problems

    return attention_problems(cfg.model, facts.device)


def _attention_apply(model: nn.Module, cfg: HoneConfig, facts: RunFacts) -> dict[str, Any]:
    from hone.models.attention.setup import select_attention_kernel
    from hone.models.precision import precision_for

    compute = precision_for(cfg.model.dtype, full_finetune=not cfg.adapter.is_lora).compute
    kernel = select_attention_kernel(model, cfg, facts.device, compute)
    return {"implementation": cfg.model.attn_implementation, "kernel": kernel}


def _attention_layout(model: nn.Module, cfg: HoneConfig):
    from hone.models.attention.layout import layout_for

    return layout_for(model)


def _attention_label(details: dict[str, Any]) -> str:
    extra = f", {details['kernel']}" if details.get("kernel") else ""
    return f"attention ({details['implementation']}{extra})"


def _has_sinks(cfg: HoneConfig) -> bool:
    """Whether the configured model has attention sinks (gpt-oss); False where its config cannot
    be read here (the loader then says why)."""
    from hone.models.attention.sinks import has_attention_sinks

    try:
        if cfg.model.preset is not None:  # the preset's config class names its model type
            from hone.models.presets import get_preset

            return has_attention_sinks(get_preset(cfg.model.preset).config_class)
        from hone.models.hub import local_model_dir
        from hone.models.model_dir import read_causal_lm_config

        return has_attention_sinks(read_causal_lm_config(local_model_dir(cfg.model.path), cfg.model.trust_remote_code))
    except Exception:  # noqa: BLE001 -- a reason line never fails the plan
        return False


def _attention_why(cfg: HoneConfig, facts: RunFacts) -> str:
    why = f"model.attn_implementation: {cfg.model.attn_implementation}"
    if cfg.model.attn_implementation in ("sdpa", "flex_attention") and _has_sinks(cfg):
        return why + "; the model has attention sinks: hone's flex sink backend (sdpa would drop them)"
    if cfg.model.attn_implementation == "sdpa" and (cfg.data.sample_packing or cfg.data.packs_eval):
        why += f"; packed rows through torch's varlen kernel where it runs (model.sdpa_varlen: {cfg.model.sdpa_varlen})"
    if cfg.model.attn_implementation == "sdpa":
        why += "; causal rows without a prepared mask where the model attends to the whole row"
    return why


ATTENTION = Transform(
    name="attention",
    switch="model.attn_implementation",
    wanted=lambda cfg, facts: True,
    why=_attention_why,
    check=_attention_check,
    stage="base",
    model=_attention_apply,
    attention_layout=_attention_layout,
    label=_attention_label,
)


# ---------------------------------------------------------------- 3. tiled MLP


def param_shards(cfg: HoneConfig, facts: RunFacts) -> int:
    """Processes FSDP shards the weights over (1 without FSDP): the memory left for activations
    on each card, which ``auto``'s tiling and checkpointing decide on."""
    return facts.world.world_size if _fsdp_module().fsdp_wanted(cfg, facts) else 1


def _tiled_mlp(cfg: HoneConfig, facts: RunFacts):
    """The tiling: the configured shard count, or what ``auto`` decides from the memory
    estimate (a :class:`~hone.transforms.auto_policy.MemoryChoice`; 0 shards: untiled)."""
    from hone.transforms.auto_policy import tiled_mlp_choice

    return tiled_mlp_choice(cfg, facts.device, facts.memory_bytes, host_budget=facts.host_memory_bytes, param_shards=param_shards(cfg, facts))


def _tiled_mlp_skipped(cfg: HoneConfig, facts: RunFacts) -> str | None:
    """Recorded only when ``auto`` left tiling off on a run that does not fit (the usual case,
    a run that fits untiled, is no news; ``hone plan`` prints it through ``why``)."""
    if cfg.memory.tiled_mlp != "auto":
        return None
    choice = _tiled_mlp(cfg, facts)
    return choice.tiled_why if choice.does_not_fit else None


def _tiled_mlp_apply(model: nn.Module, cfg: HoneConfig, facts: RunFacts) -> dict[str, Any]:
    from hone.transforms.tiled_mlp import apply_tiled_mlp

    choice = _tiled_mlp(cfg, facts)
    details = apply_tiled_mlp(model, choice.shards)
    details["why"] = choice.tiled_why
    return details


TILED_MLP = Transform(
    name="tiled_mlp",
    switch="memory.tiled_mlp",
    wanted=lambda cfg, facts: cfg.memory.tiled_mlp != "off" and _tiled_mlp(cfg, facts).shards > 0,
    why=lambda cfg, facts: _tiled_mlp(cfg, facts).tiled_why,
    skipped_because=_tiled_mlp_skipped,
    model=_tiled_mlp_apply,
    label=lambda d: f"tiled MLP ({d['shards']} shards)",
)


# ---------------------------------------------------------------- 4. loss


def _loss(model: nn.Module, cfg: HoneConfig, facts: RunFacts):
    from hone.transforms.loss import build_loss

    return build_loss(cfg, facts, model)


def _loss_why(cfg: HoneConfig, facts: RunFacts) -> str:
    from hone.transforms.memory.decide import loss_decision

    kind, why = loss_decision(cfg)
    return f"{kind} ({why})"


LOSS = Transform(
    name="loss",
    switch="performance.loss",
    wanted=lambda cfg, facts: True,
    why=_loss_why,
    loss=_loss,
    label=lambda d: f"loss ({d['loss']})",
)


# ---------------------------------------------------------------- 5. activation checkpointing


def _checkpointing_policy(cfg: HoneConfig, facts: RunFacts) -> tuple[str, str]:
    """(policy, why): the configured one, or what ``auto`` picks from the memory estimate."""
    policy = cfg.memory.checkpointing
    if policy != "auto":
        return policy, f"memory.activation_checkpointing: {policy}"
    from hone.transforms.auto_policy import auto_checkpointing

    return auto_checkpointing(cfg, facts.device, facts.memory_bytes, host_budget=facts.host_memory_bytes, param_shards=param_shards(cfg, facts))


def _checkpointing_wanted(cfg: HoneConfig, facts: RunFacts) -> bool:
    return cfg.memory.checkpointing != "none" and _checkpointing_policy(cfg, facts)[0] != "none"


def _checkpointing_skipped(cfg: HoneConfig, facts: RunFacts) -> str | None:
    if cfg.memory.checkpointing == "auto":
        return _checkpointing_policy(cfg, facts)[1]
    return None


def _selective_meets_inductor(cfg: HoneConfig, facts: RunFacts) -> bool:
    perf = cfg.performance
    return perf.compiles_on(facts.device.type) and perf.torch_compile_backend == "inductor"


def _checkpointing_check(cfg: HoneConfig, facts: RunFacts) -> list[str]:
    policy = _checkpointing_policy(cfg, facts)[0]
    problems = []
    if policy == "offload" and cfg.performance.compiles_on(facts.device.type) and cfg.performance.torch_compile_scope == "model":
        problems.append(
            "memory.activation_checkpointing: offload needs torch_compile_scope: regional (a whole-model graph saves "
            "the layers' inputs inside itself, out of the offload hooks' reach)"
        )
    return problems


def _checkpointing_apply(model: nn.Module, cfg: HoneConfig, facts: RunFacts) -> dict[str, Any]:
    from hone.transforms.checkpointing import apply_activation_checkpointing

    policy, why = _checkpointing_policy(cfg, facts)
    if policy == "selective" and _selective_meets_inductor(cfg, facts):
        # torch's selective checkpointing wraps a layer from outside, and Inductor's kernels
        # overwrite the buffers it caches; inside a compiled layer the same choice (keep what is
        # expensive, recompute what is cheap) is the partitioner's, given a memory budget
        details = {
            "policy": "selective",
            "mechanism": "Inductor's partitioner under an activation memory budget (each compiled layer recomputes its cheapest ops first)",
            "activation_memory_budget": cfg.memory.selective_memory_budget,
        }
    elif policy == "offload":
        from hone.transforms.auto_policy import offload_layers_choice
        from hone.models.structure import decoder_layers

        layers, split_why = offload_layers_choice(cfg, len(decoder_layers(model)), facts.host_memory_bytes)
        details = apply_activation_checkpointing(model, policy, use_streams=facts.device.type == "cuda", offload_layers=layers)
        details["offload"]["why"] = split_why
    else:
        details = apply_activation_checkpointing(model, policy, use_streams=facts.device.type == "cuda")
    details["why"] = why
    if cfg.memory.alias_note:
        details["note"] = cfg.memory.alias_note
    return details


def _checkpointing_step_context(model: nn.Module, cfg: HoneConfig, facts: RunFacts):
    from hone.transforms.checkpointing import memory_budget_context, offload_step_context

    if _checkpointing_policy(cfg, facts)[0] == "selective" and _selective_meets_inductor(cfg, facts):
        budget = cfg.memory.selective_memory_budget
        return lambda batch: memory_budget_context(budget)
    return lambda batch: offload_step_context(model)


CHECKPOINTING = Transform(
    name="activation_checkpointing",
    switch="memory.activation_checkpointing",
    wanted=_checkpointing_wanted,
    why=lambda cfg, facts: _checkpointing_policy(cfg, facts)[1],
    check=_checkpointing_check,
    skipped_because=_checkpointing_skipped,
    model=_checkpointing_apply,
    step_context=_checkpointing_step_context,
    label=lambda d: f"activation checkpointing ({d.get('policy', 'full')}"
    + (f"; {d['why']}" if str(d.get("why", "")).startswith("activation_checkpointing: auto") else "")
    + ")",
)


# ---------------------------------------------------------------- 5b. tiled decoder layers


def _tiled_layers_policy(cfg: HoneConfig, facts: RunFacts) -> str:
    return _checkpointing_policy(cfg, facts)[0] if _checkpointing_wanted(cfg, facts) else "none"


def _tiled_layers_blockers(cfg: HoneConfig, facts: RunFacts) -> list[str]:
    """What rules tiled layers out for this run beyond the config's own validators (which refuse
    packing and other backends for an explicit count): the problems of an explicit count, the
    reason ``auto`` leaves the layers whole."""
    blockers = []
    if cfg.data.sample_packing or cfg.data.packs_eval:
        blockers.append("packed rows carry a document mask, tiled layers compute causal rows without one")
    if cfg.model.attn_implementation != "sdpa":
        blockers.append(f"model.attn_implementation is {cfg.model.attn_implementation}; tiled layers attend through sdpa")
    if _fsdp_module().fsdp_wanted(cfg, facts):
        blockers.append("tiled layers are untested under FSDP2 (distributed.strategy resolves to fsdp): use distributed.strategy: ddp")
    if cfg.performance.compiles_on(facts.device.type) and cfg.performance.torch_compile_scope == "model":
        blockers.append(
            "tiled layers need torch_compile_scope: regional (each tiled layer compiles the layer its chunks run; a "
            "whole-model graph would stop at every tiled layer)"
        )
    return blockers


def _tiled_layers_check(cfg: HoneConfig, facts: RunFacts) -> list[str]:
    """What the config validators cannot see: ``auto`` decisions and the device."""
    key = f"memory.tiled_layers: {cfg.memory.tiled_layers}"
    problems = []
    policy = _tiled_layers_policy(cfg, facts)
    if policy not in ("full", "offload"):
        problems.append(
            f"{key} needs memory.activation_checkpointing full or offload (a tiled layer is the layer's checkpoint), "
            f"but it resolves to {policy}: set activation_checkpointing: full or offload"
        )
    return problems + [f"{key}: {b}" for b in _tiled_layers_blockers(cfg, facts)]


def _tiled_layers_choice(cfg: HoneConfig, facts: RunFacts) -> tuple[int, str, bool]:
    """(chunks, why, does_not_fit): the configured count, or what ``auto`` decides from the
    memory estimate (:func:`hone.transforms.auto_policy.tiled_layers_choice`). ``auto`` never
    fails a run: where tiled layers cannot apply, or the estimate fails, the layers stay whole."""
    chunks = cfg.memory.tiled_layers_chunks
    if chunks is not None:
        return chunks, f"memory.tiled_layers: {cfg.memory.tiled_layers}", False
    blockers = _tiled_layers_blockers(cfg, facts)
    if blockers:
        return 0, f"tiled_layers: auto: off, {blockers[0]}", False
    try:
        from hone.transforms.auto_policy import tiled_layers_choice

        decision = tiled_layers_choice(
            cfg, facts.device, _tiled_layers_policy(cfg, facts), _tiled_mlp(cfg, facts).shards, facts.memory_bytes,
            host_budget=facts.host_memory_bytes, param_shards=param_shards(cfg, facts),
        )  # fmt: skip
    except Exception as exc:  # noqa: BLE001 -- the estimate's failure is reported, not raised
        return 0, f"tiled_layers: auto: off, the memory estimate failed ({type(exc).__name__}: {exc})", False
    blocker = _layers_attend_otherwise(cfg) if decision.shards else None
    if blocker is not None:
        return 0, f"tiled_layers: auto: off, {blocker} (tiled layers attend causally to the whole row)", True
    return decision.shards, decision.why, decision.does_not_fit


def _layers_attend_otherwise(cfg: HoneConfig) -> str | None:
    """Why the model's layers cannot be chunked (sliding windows, sinks, router logits from
    hooks), read from its config; None when they can or the config cannot be read here (the
    transform then says why when it applies)."""
    from hone.models.attention.setup import causal_blockers
    from hone.transforms.memory.facts import transformers_config

    try:
        config = transformers_config(cfg.model)
    except Exception:  # noqa: BLE001 -- a reason line never fails the plan
        return None
    blockers = list(causal_blockers(config))
    if getattr(config, "output_router_logits", False):
        blockers.append("router logits recorded from hooks")
    return f"the model has {', '.join(blockers)}" if blockers else None


def _tiled_layers_skipped(cfg: HoneConfig, facts: RunFacts) -> str | None:
    """Recorded only when ``auto`` left the layers whole on a run that does not fit."""
    if cfg.memory.tiled_layers != "auto":
        return None
    chunks, why, does_not_fit = _tiled_layers_choice(cfg, facts)
    return why if does_not_fit and not chunks else None


def _tiled_layers_apply(model: nn.Module, cfg: HoneConfig, facts: RunFacts) -> dict[str, Any]:
    from hone.transforms.tiled_layers import apply_tiled_layers

    chunks, why, _ = _tiled_layers_choice(cfg, facts)
    details = apply_tiled_layers(model, chunks)
    details["why"] = why
    return details


TILED_LAYERS = Transform(
    name="tiled_layers",
    switch="memory.tiled_layers",
    wanted=lambda cfg, facts: _tiled_layers_choice(cfg, facts)[0] >= 2,
    why=lambda cfg, facts: _tiled_layers_choice(cfg, facts)[1],
    check=_tiled_layers_check,
    skipped_because=_tiled_layers_skipped,
    model=_tiled_layers_apply,
    label=lambda d: f"tiled layers ({d['chunks']} chunks)",
)


# ---------------------------------------------------------------- 6. torch.compile


def _compile_wanted(cfg: HoneConfig, facts: RunFacts) -> bool:
    return cfg.performance.compiles_on(facts.device.type)


def _compile_check(cfg: HoneConfig, facts: RunFacts) -> list[str]:
    perf = cfg.performance
    problems = []
    if perf.uses_cudagraphs and facts.device.type != "cuda":
        problems.append(f"{perf.cudagraphs_source} uses CUDA graphs, which need a CUDA device (training on {facts.device.type})")
    if perf.uses_cudagraphs and facts.shape_note is not None:
        problems.append(
            f"{perf.cudagraphs_source} uses CUDA graphs, which need one fixed shape, but {facts.shape_note}: every "
            "new shape would record another graph and hold its memory. Use triton.cudagraphs: false (or "
            "torch_compile_mode: max-autotune-no-cudagraphs), or train on rows of one length"
        )
    return problems


def _compile_apply(model: nn.Module, cfg: HoneConfig, facts: RunFacts) -> dict[str, Any]:
    cache_dir, chosen_by_hone = configure_cache_dir()
    perf = cfg.performance
    dynamic = facts.lengths_vary
    if perf.torch_compile_scope == "regional":
        details = compile_transform.compile_regional(model, perf, dynamic)
    else:
        details = compile_transform.compile_model(model, perf, dynamic)
    details["mode"] = perf.torch_compile_mode or "default"
    details["user_options"] = dict(perf.torch_compile_options)
    details["cache_dir"] = str(cache_dir)
    details["cache_dir_from"] = "hone default" if chosen_by_hone else "TORCHINDUCTOR_CACHE_DIR"
    return details


def _compile_skipped(cfg: HoneConfig, facts: RunFacts) -> str | None:
    if cfg.performance.torch_compile == "auto" and facts.device.type != "cuda":
        return f"torch_compile: auto compiles on CUDA only; this run trains on {facts.device.type}"
    return None


def _compile_label(d: dict[str, Any]) -> str:
    extra = f"{d['scope']}"
    if d.get("layers"):
        extra += f", {d['layers']} layers"
    extra += f", {d['backend']}"
    if d.get("mode") not in (None, "default"):
        extra += f", mode {d['mode']}"
    if d.get("user_options"):
        extra += ", " + ", ".join(f"{k}={v}" for k, v in d["user_options"].items())
    return f"compile ({extra})"


COMPILE = Transform(
    name="compile",
    switch="performance.torch_compile",
    wanted=_compile_wanted,
    check=_compile_check,
    model=_compile_apply,
    skipped_because=_compile_skipped,
    label=_compile_label,
)

# ---------------------------------------------------------------- 7. FSDP2


def _fsdp_apply(model: nn.Module, cfg: HoneConfig, facts: RunFacts) -> dict[str, Any]:
    from hone.transforms.fsdp import apply_fsdp

    return apply_fsdp(model, cfg, facts)


def _fsdp_wrap_step(step: StepModule, cfg: HoneConfig, facts: RunFacts):
    from hone.transforms.fsdp import wrap_fsdp_step

    return wrap_fsdp_step(step, cfg, facts)


def _fsdp_label(details: dict[str, Any]) -> str:
    from hone.transforms.fsdp import fsdp_label

    return fsdp_label(details)


def _fsdp_why(cfg: HoneConfig, facts: RunFacts) -> str:
    from hone.transforms.data_parallel import resolve_strategy

    return resolve_strategy(cfg, facts)[1]


FSDP = Transform(
    name="fsdp",
    switch="distributed.strategy",
    wanted=lambda cfg, facts: _fsdp_module().fsdp_wanted(cfg, facts),
    check=lambda cfg, facts: _fsdp_module().fsdp_problems(cfg, facts),
    skipped_because=lambda cfg, facts: _fsdp_module().fsdp_skipped_because(cfg, facts),
    why=_fsdp_why,
    model=_fsdp_apply,
    wrap_step=_fsdp_wrap_step,
    shards_parameters=True,
    label=_fsdp_label,
)


def _fsdp_module():
    from hone.transforms import fsdp

    return fsdp


#: Every transform, in the order they are applied (see the module docstring for why).
TRANSFORMS: tuple[Transform, ...] = (
    ALLOCATOR,
    ATTENTION,
    QUANTIZE,
    EXPERTS,
    FP8,
    TILED_MLP,
    LOSS,
    CHECKPOINTING,
    TILED_LAYERS,
    COMPILE,
    # data parallelism, last: it wraps the final modules. At most one of the two is on.
    DDP,
    FSDP,
)


# ---------------------------------------------------------------- planning and applying


@dataclass
class Plan:
    """The transforms of one run, in order, and what applying them did so far."""

    transforms: list[Transform]
    skipped: list[dict[str, str]]
    applied: list[Applied] = field(default_factory=list)

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.transforms]

    @property
    def shards_parameters(self) -> bool:
        """Whether a transform of this plan shards the weights (then the model is loaded sharded)."""
        return any(t.shards_parameters for t in self.transforms)

    def apply(self, model: nn.Module, stage: Stage, cfg: HoneConfig, facts: RunFacts) -> list[Applied]:
        """Run the ``model`` hooks of this ``stage``, in order; records and returns what they did."""
        done = []
        for transform in self.transforms:
            if transform.stage != stage:
                continue
            details = transform.model(model, cfg, facts) if transform.model is not None else {}
            done.append(self._record(transform, details))
        return done

    def hooks(self, model: nn.Module, cfg: HoneConfig, facts: RunFacts) -> RunHooks:
        """What the loop and the eval use of the plan, once ``model`` has been through it."""
        loss_fn = layout = None
        step_contexts, after_step, state_dict, step_wrappers = [], [], [], []
        for transform in self.transforms:
            if transform.loss is not None:
                if loss_fn is not None:
                    raise PlanError(f"two transforms supply the loss ({transform.name} and an earlier one)")
                loss_fn, details = transform.loss(model, cfg, facts)
                self._record(transform, details)
            if transform.attention_layout is not None:
                layout = transform.attention_layout(model, cfg)
                self._record(transform, {"packed_batches_carry": layout.kind})
            if transform.step_context is not None:
                step_contexts.append(transform.step_context(model, cfg, facts))
            if transform.after_optimizer_step is not None:
                hook = transform.after_optimizer_step
                after_step.append(lambda hook=hook: hook(model))
            if transform.state_dict_hooks is not None:
                state_dict.append(transform.state_dict_hooks(cfg, facts))
            if transform.wrap_step is not None:  # applied in the loop; what is known now goes on record
                self._record(transform, _world_details(facts))
                step_wrappers.append(lambda step, t=transform: self._wrap(t, step, cfg, facts))
        if loss_fn is None or layout is None:
            raise PlanError("the plan has no loss or no attention transform; hone's own TRANSFORMS always do")
        return RunHooks(
            loss_fn=loss_fn,
            layout=layout,
            step_contexts=step_contexts,
            after_step=after_step,
            state_dict=state_dict,
            step_wrappers=step_wrappers,
            sharded_checkpoints=self.shards_parameters,
        )

    def _wrap(self, transform: Transform, step: StepModule, cfg: HoneConfig, facts: RunFacts) -> StepModule:
        assert transform.wrap_step is not None
        wrapped, details = transform.wrap_step(step, cfg, facts)
        self._record(transform, details)
        return wrapped

    def _record(self, transform: Transform, details: dict[str, Any]) -> Applied:
        for item in self.applied:
            if item.name == transform.name:
                item.details.update(details)
                return item
        item = Applied(transform.name, transform.switch, dict(details))
        self.applied.append(item)
        return item

    def in_order(self) -> list[Applied]:
        """The applied transforms in plan order (hooks run in stages, so not in that order)."""
        rank = {t.name: i for i, t in enumerate(self.transforms)}
        return sorted(self.applied, key=lambda a: rank.get(a.name, len(rank)))

    def describe(self) -> str:
        """One console line: what was applied (and what the config mentions but this run skips)."""
        by_name = {t.name: t for t in self.transforms}
        parts = [by_name[a.name].describe(a.details) for a in self.in_order() if a.name in by_name]
        text = "optimizations: " + (", ".join(parts) if parts else "none")
        for skip in self.skipped:
            text += f"; skipped {skip['name']}: {skip['reason']}"
        return text


def _world_details(facts: RunFacts) -> dict[str, Any]:
    import torch.distributed as dist

    backend = dist.get_backend() if dist.is_available() and dist.is_initialized() else None
    return {"processes": facts.world.world_size, "backend": backend}


def plan_optimizations(cfg: HoneConfig, facts: RunFacts, transforms: tuple[Transform, ...] = TRANSFORMS) -> Plan:
    """The transforms this run applies, in order; raises :class:`PlanError` with every problem."""
    chosen, skipped, problems = [], [], []
    for transform in transforms:
        if not transform.wanted(cfg, facts):
            reason = transform.skipped_because(cfg, facts)
            if reason:
                skipped.append({"name": transform.name, "switch": transform.switch, "reason": reason})
            continue
        problems += transform.check(cfg, facts)
        chosen.append(transform)
    if facts.world.distributed and not any(t.wrap_step is not None for t in chosen):
        strategy, why = resolve_strategy(cfg, facts)
        problems.append(
            f"distributed.strategy: {cfg.distributed.strategy} resolves to {strategy!r} on {facts.world.world_size} "
            f"processes ({why}), and no transform of this hone provides it; allowed here: ddp"
        )
    names = {t.name for t in chosen}
    for transform in chosen:
        clash = sorted(names & set(transform.conflicts))
        if clash:
            problems.append(f"{transform.switch} ({transform.name}) cannot be combined with {', '.join(clash)}")
    if problems:
        raise PlanError("cannot apply the optimizations the config asks for:\n  - " + "\n  - ".join(problems))
    return Plan(chosen, skipped)


def decisions(cfg: HoneConfig, facts: RunFacts, transforms: tuple[Transform, ...] = TRANSFORMS) -> list[tuple[str, str, bool, str]]:
    """(name, switch, on, why) of every transform in plan order, without loading anything: what
    ``hone plan`` shows. A transform the run could not apply says so with the planner's reason."""
    lines = []
    for transform in transforms:
        if transform.wanted(cfg, facts):
            problems = transform.check(cfg, facts)
            why = transform.why(cfg, facts) if transform.why is not None else f"{transform.switch} is on"
            if problems:
                why = "REFUSED: " + "; ".join(problems)
            lines.append((transform.name, transform.switch, True, why))
        else:
            reason = transform.skipped_because(cfg, facts) or (transform.why(cfg, facts) if transform.why is not None else f"{transform.switch} is off")
            lines.append((transform.name, transform.switch, False, reason))
    return lines


def write_record(out_dir: Path, plan: Plan, compile_stats: dict[str, Any] | None = None) -> Path:
    """``optimizations.json``: applied transforms in order, skipped ones, compile counts."""
    from hone.atomic import atomic_write_text

    record: dict[str, Any] = {
        "applied": [asdict(a) for a in plan.in_order()],
        "skipped": plan.skipped,
        "torch": torch.__version__,
    }
    if compile_stats is not None:
        record["compile"] = compile_stats
    path = Path(out_dir) / OPTIMIZATIONS_FILE
    atomic_write_text(path, json.dumps(record, indent=2, default=str) + "\n")
    return path
