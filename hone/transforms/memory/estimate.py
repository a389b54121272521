"""The peak of one training step: the bytes each decoder layer keeps and every transform's term
(:mod:`hone.transforms.memory.terms`), over the phases of the step.

* **Trainable state**: AdamW keeps two moments per trainable weight in the weight's dtype
  (``torch.optim.AdamW``; about 1 or 0.5 bytes each with ``optimizer.name: adamw_8bit`` /
  ``adamw_4bit``: :meth:`~hone.config.optimizer.OptimizerConfig.state_bytes`); gradients have
  the weight's dtype (master copies: none, see :mod:`hone.models.precision`).
* **Peak**: the maximum over the phases of a step (the loss's backward with every saved
  activation alive; the first and last layer's backward with the recompute of one layer; the
  optimizer step, with a low-bit optimizer's temporaries: :mod:`~hone.transforms.memory.terms.optimizer`),
  plus a workspace allowance (cuBLAS workspaces, allocator rounding).

A transform that changes what the step holds adds its term in :mod:`hone.transforms.memory.terms`
and calls it in :func:`estimate_memory` (the layers' activations, the training state or the
phases), where every other term is called.
"""

from dataclasses import dataclass, field

from hone.config.memory import INPUT_ONLY_POLICIES, POLICIES_BY_SPEED, selective_budget_floor
from hone.config.root import HoneConfig
from hone.transforms.lora_linear import fused_lora_layers
from hone.transforms.memory.facts import ModelFacts, model_facts
from hone.transforms.memory.knobs import Knobs
from hone.transforms.memory.layers import outside_layers_bytes, per_layer, step_layer_bytes
from hone.transforms.memory.step import Step
from hone.transforms.memory.terms.checkpointing import Kept, kept_by_policy
from hone.transforms.memory.terms.expert_parallel import (
    dispatch_bytes_per_token,
    expert_blocks_beside_fsdp,
    expert_capacity_factor,
    expert_parallel_note,
    expert_parallel_recompute,
    expert_parallel_size,
    expert_state_saved,
    recomputed_experts_bytes,
)
from hone.transforms.memory.terms.fp8 import fp8_copies_bytes
from hone.transforms.memory.terms.fsdp import sharded_state
from hone.transforms.memory.terms.load import drawn_whole_bytes
from hone.transforms.memory.terms.loss import loss_bytes
from hone.transforms.memory.terms.offload import host_bytes
from hone.transforms.memory.terms.optimizer import optimizer_step_transient
from hone.transforms.memory.terms.tiled_layers import layer_chunks, rebuilt_chunk_bytes
from hone.transforms.memory.terms.tiled_mlp import mlp_backward_transient, mlp_shards
from hone.units import GIB, MIB

#: Workspace allowance: cuBLAS/cuBLASLt workspaces and small buffers the step allocates
#: (RoPE tables, masks, the fused optimizer's step counters), plus the caching allocator's
#: rounding of every block to 512 bytes / 2 MiB segments, as a fraction of the rest.
WORKSPACE_BYTES = 256 * MIB
WORKSPACE_FRACTION = 0.005


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes by component at the step's peak; ``total`` is their sum, ``host`` is separate."""

    weights: int
    trainable_state: int
    """Gradients alive at the peak (master copies: none, see :mod:`hone.models.precision`)."""
    optimizer: int
    activations: int
    """Saved activations of every layer under the policy, plus one layer's recompute."""
    outside_layers: int
    """Embedding output and final norm / head input kept for the backward."""
    loss: int
    workspace: int
    total: int
    host: int
    """Pinned host memory (``offload``: the layers' saved inputs)."""
    phase: str
    """The part of the step where the peak falls."""
    checkpointing: str
    loss_kind: str
    compiled: bool
    tokens: int
    sequence_len: int
    micro_batch: int
    activations_per_layer: int
    """Bytes one layer keeps until its backward, under the policy (all layers: x layers)."""
    recompute: int
    """Bytes of one layer's activations rebuilt in the backward (0 without checkpointing)."""
    frozen_params: int
    trainable_params: int
    notes: tuple[str, ...] = field(default_factory=tuple)
    optimizer_step: int = 0
    """The low-bit optimizer update's float32 temporaries, when the peak is the optimizer step."""
    tiled_mlp: int = 0
    """Shards of the tiled MLP (0: untiled)."""
    tiled_transient: int = 0
    """Bytes the tiled MLP holds while one shard is differentiated (in ``activations``)."""
    offloaded_layers: int = 0
    """``offload``: layers whose saved input is in pinned host memory (the rest on the GPU)."""
    host_total: int = 0
    """The process's host memory (resident, pinned included): :func:`~.terms.offload.host_process_bytes` + ``host``."""
    param_shards: int = 1
    """Processes the weights, gradients and optimizer state are sharded over (FSDP)."""
    layers: int = 0
    """Decoder layers of the model."""
    tiled_layers: int = 0
    """Chunks each decoder layer is computed in (0: whole; :mod:`hone.transforms.tiled_layers`)."""
    run_layers: int = 1
    """Layers per run of layer-run checkpointing (1: each layer keeps its input; ``offloaded_layers``
    then counts runs); :mod:`hone.transforms.layer_runs`."""
    rebuilt_inputs: int = 0
    """Layer runs: bytes of one run's inner inputs rebuilt in the backward (in ``activations``)."""
    load: int = 0
    """The model's load beyond the sharded weights and moments, when the peak is there (FSDP2 on a
    preset drawn whole first: :mod:`~hone.transforms.memory.terms.load`)."""

    def components(self) -> list[tuple[str, int]]:
        """(label, bytes) in display order; their sum is ``total``."""
        return [
            ("weights", self.weights),
            ("trainable state (grads)", self.trainable_state),
            ("optimizer (AdamW moments)", self.optimizer),
            ("activations", self.activations),
            ("embeddings / final norm", self.outside_layers),
            ("loss", self.loss),
            ("model drawn whole (load)", self.load),
            ("workspace", self.workspace),
        ]

    @property
    def total_gib(self) -> float:
        return self.total / GIB


def estimate_memory(cfg: HoneConfig, knobs: Knobs) -> MemoryEstimate:
    """Peak memory of one training step of ``cfg`` under ``knobs`` (the checkpointing policy, the
    loss, the step's shape and memory switches: :class:`~hone.transforms.memory.knobs.Knobs`),
    without loading weights."""
    if knobs.checkpointing not in POLICIES_BY_SPEED:
        raise ValueError(f"checkpointing must be one of {', '.join(POLICIES_BY_SPEED)}, got {knobs.checkpointing!r}")
    m = model_facts(cfg)
    step = resolve_step(cfg, knobs, m)
    # the layers: what each keeps without checkpointing (expert parallel: the exchanged rows), then under the policy
    ep, factor, ep_recompute = expert_parallel_size(cfg), expert_capacity_factor(cfg), expert_parallel_recompute(cfg)
    full = per_layer(
        m,
        lambda layer: (
            step_layer_bytes(step, layer, m).at(step.tokens, step.sequence_len)
            + dispatch_bytes_per_token(layer, m, ep, factor, ep_recompute) * step.tokens
        ),
    )
    kept = kept_by_policy(m, step, full)
    # tiled layers: the layer rebuilt in the backward is one chunk of it
    recompute = rebuilt_chunk_bytes(m, step) if step.chunks else kept.recompute
    # the MLP's backward (tiled: one shard at a time)
    transient = mlp_backward_transient(m, step) + recomputed_experts_bytes(m, ep, factor, ep_recompute, step.tokens)
    host, host_total = host_bytes(step, kept.offloaded)
    weights, grads, optimizer = training_state(cfg, m, step.param_shards)
    step_transient = optimizer_step_transient(cfg, m, step.param_shards)
    phases = step_phases(m, step, kept, recompute + transient, grads, step_transient)
    # the load, before FSDP2 shards a preset drawn whole (the moments do not exist yet)
    drawn = drawn_whole_bytes(cfg, training_state(cfg, m, 1)[0], step.param_shards)
    if drawn > weights + optimizer:
        phases["model load"] = dict(trainable_state=0, activations=0, outside_layers=0, loss=0, load=drawn - weights - optimizer)
    phase, parts = max(phases.items(), key=lambda item: sum(item[1].values()))
    subtotal = weights + optimizer + sum(parts.values())
    workspace = WORKSPACE_BYTES + int(WORKSPACE_FRACTION * subtotal)
    notes = []
    if step.attention == "eager":
        notes.append("eager attention keeps the T x T probabilities of every head: use sdpa")
    ep_note = expert_parallel_note(m, ep)
    if ep_note:
        notes.append(ep_note)
    return MemoryEstimate(
        weights=weights,
        optimizer=optimizer,
        workspace=workspace,
        total=subtotal + workspace,
        host=host,
        phase=phase,
        checkpointing=step.policy,
        loss_kind=step.loss,
        compiled=step.compiled,
        tokens=step.tokens,
        sequence_len=step.sequence_len,
        micro_batch=step.micro_batch,
        activations_per_layer=max(kept.each),
        recompute=recompute,
        frozen_params=m.frozen_params,
        trainable_params=m.trainable_params,
        notes=tuple(notes),
        tiled_mlp=step.shards,
        tiled_transient=transient if step.tiled else 0,
        tiled_layers=step.chunks,
        offloaded_layers=kept.offloaded,
        host_total=host_total,
        param_shards=step.param_shards,
        layers=len(full),
        run_layers=step.run_layers,
        rebuilt_inputs=kept.rebuilt_inputs,
        **parts,
    )


def selective_budget(cfg: HoneConfig, knobs: Knobs) -> float:
    """The compiler's activation memory budget ``selective`` is estimated at: the knob's, else the
    config's (``auto``: the floor it may go down to, where the policy choice is made)."""
    if knobs.selective_budget is not None:
        return knobs.selective_budget
    budget = cfg.memory.selective_memory_budget
    return selective_budget_floor(cfg.distributed.expert_parallel) if budget == "auto" else budget


def float8_of(cfg: HoneConfig, param_shards: int | None) -> tuple[str, str] | None:
    """``(scaling, fp8_small_linears)`` of a full fine-tune in float8 (``auto`` resolved as the
    plan resolves it: FSDP2 when the weights are sharded), else None."""
    from hone.transforms.fp8_sizes import fp8_scaling  # (torch-free callers of the estimate import no kernel)

    if cfg.performance.fp8 == "off" or cfg.adapter.is_lora:
        return None
    mode = fp8_scaling(cfg, fsdp=(param_shards or 1) > 1)[0]
    return mode, cfg.performance.fp8_small_linears


def resolve_step(cfg: HoneConfig, knobs: Knobs, m: ModelFacts) -> Step:
    """``knobs`` with the config's defaults filled in: the sequence (under context parallelism one
    rank's shard of it: attention holds the whole sequence for ``1/N`` of the heads, the same bytes) and micro-batch, whether the
    step compiles on the device (``torch_compile: auto`` compiles on CUDA), the attention, the
    offload split asked for (``memory.offload_layers``), the tiled layers' chunks and the tiled
    MLP's shards (the MLP of a tiled layer processes one chunk at a time)."""
    perf = cfg.performance
    split = knobs.context_parallel or cfg.distributed.context_parallel  # one rank's shard of each sequence
    seq = -(-(knobs.sequence_len or cfg.data.sequence_len) // split)
    mbs = knobs.micro_batch or cfg.sequences_per_micro_batch  # a preference micro-batch: 2 sequences per pair
    compiled = perf.compiles_on(knobs.device) if knobs.compiled is None else knobs.compiled
    chunks = layer_chunks(knobs.tiled_layers, knobs.checkpointing, seq)
    piece = mbs * -(-seq // chunks) if chunks else seq * mbs
    return Step(
        policy=knobs.checkpointing,
        loss=knobs.loss,
        device=knobs.device,
        sequence_len=seq,
        micro_batch=mbs,
        compiled=bool(compiled),
        attention=cfg.model.attn_implementation,
        input_bytes=m.compute_bytes * seq * mbs * m.hidden,
        chunks=chunks,
        piece=piece,
        shards=mlp_shards(knobs.tiled_mlp, piece, m.hidden),
        offload_layers=cfg.memory.offload_layers if knobs.offload_layers is None else knobs.offload_layers,
        host_budget=knobs.host_budget,
        param_shards=knobs.param_shards,
        selective_budget=selective_budget(cfg, knobs) if compiled and perf.torch_compile_backend == "inductor" else None,
        accumulating=cfg.training.gradient_accumulation_steps > 1,
        run_layers=knobs.run_layers if knobs.checkpointing in INPUT_ONLY_POLICIES else 1,
        float8=float8_of(cfg, knobs.param_shards),
        fused_lora=fused_lora_layers(cfg),
        sequences=cfg.training.is_preference,
        # Ulysses: q, k, v to the rank's heads over the whole sequence, the output back (same bytes as one shard's)
        exchanged_per_token=m.compute_bytes * 2 * (m.heads + m.kv_heads) * m.head_dim if split > 1 else 0,
    )


def training_state(cfg: HoneConfig, m: ModelFacts, param_shards: int) -> tuple[int, int, int]:
    """(weights, gradients, AdamW moments) on one device: the weights with their float8 copies,
    the experts split over the expert-parallel ranks, sharded over ``param_shards`` processes by FSDP."""
    ep = expert_parallel_size(cfg)
    weights_off, grads_off, params_off = expert_state_saved(m, ep)
    copies = fp8_copies_bytes(cfg, m, float8_of(cfg, param_shards), param_shards)
    weights = m.frozen_bytes + m.trainable_bytes + copies - weights_off
    optimizer = cfg.optimizer.state_bytes(m.trainable_params - params_off, m.trainable_elem_bytes)
    if ep > 1 and param_shards > 1:  # FSDP2 shards what lies outside the experts; each rank's block stays whole
        return expert_blocks_beside_fsdp(cfg, m, ep, (weights, m.trainable_bytes - grads_off, optimizer), param_shards)
    return sharded_state(m, weights, m.trainable_bytes - grads_off, optimizer, param_shards)


def step_phases(
    m: ModelFacts, step: Step, kept: Kept, rebuilt: int, grads: int, optimizer_step: int = 0
) -> dict[str, dict[str, int]]:
    """The parts alive at each phase of the step (beside the weights and the optimizer state), in
    the order a tie goes to. ``rebuilt``: what one layer's backward adds to what the layers keep
    (its recompute and the MLP's backward); ``optimizer_step``: what the optimizer's update holds
    beside the moments (:mod:`hone.transforms.memory.terms.optimizer`)."""
    tokens = step.tokens
    grad_stream = 2 * m.compute_bytes * tokens * m.hidden  # the residual stream's gradient and one temporary
    accumulating = step.accumulating  # earlier micro-batches' gradients are alive
    outside, loss = outside_layers_bytes(m, tokens), loss_bytes(m, tokens, step.loss, step.device, step.sequences)
    return {
        "loss backward": dict(
            trainable_state=grads if accumulating else 0, activations=kept.stored, outside_layers=outside, loss=loss
        ),
        "backward, last layer": dict(
            trainable_state=grads if accumulating else m.outside_trainable_bytes,
            activations=kept.stored + kept.rebuilt_inputs + rebuilt + grad_stream,
            outside_layers=0,
            loss=0,
        ),
        "backward, first layer": dict(
            trainable_state=grads,
            activations=kept.each[0] + kept.in_flight + kept.rebuilt_inputs + rebuilt + grad_stream,
            outside_layers=0,
            loss=0,
        ),
        "optimizer step": dict(trainable_state=grads, activations=0, outside_layers=0, loss=0, optimizer_step=optimizer_step),
    }
