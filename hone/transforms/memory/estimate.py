"""The peak of one training step: the layers' bytes under the checkpointing policy and every
transform's term (:mod:`hone.transforms.memory.terms`), over the phases of the step.

* **Trainable state**: AdamW keeps two moments per trainable weight in the weight's dtype
  (``torch.optim.AdamW``); gradients have the weight's dtype.
* **Checkpointing policies**: ``none`` keeps every layer's activations; ``full`` keeps each
  layer's input and recomputes one layer at a time in the backward; ``selective`` keeps the
  input and the matmul outputs; ``offload`` moves the layers' inputs to the host
  (:mod:`hone.transforms.memory.terms.offload`); two are on the GPU while the backward walks the
  offloaded ones.
* **FSDP** (``param_shards``): weights, gradients and optimizer state divided over the
  processes, plus two layers' weights gathered whole.
* **Peak**: the maximum over the phases of a step (the loss's backward with every saved
  activation alive; the first and last layer's backward with the recompute of one layer; the
  optimizer step), plus a workspace allowance (cuBLAS workspaces, allocator rounding).
"""

from dataclasses import dataclass, field

from hone.config.root import HoneConfig
from hone.transforms.memory.facts import model_facts
from hone.transforms.memory.knobs import POLICIES, Knobs
from hone.transforms.memory.layers import (
    layer_bytes,
    mlp_backward_bytes_per_token,
    selective_bytes,
)
from hone.transforms.memory.terms.fp8 import fp8_copies_bytes
from hone.transforms.memory.terms.loss import loss_bytes
from hone.transforms.memory.terms.offload import (
    host_process_bytes,
    offload_split,
    pinned_block,
)
from hone.transforms.memory.terms.tiled_layers import (
    auto_layer_chunks,
    tiled_layer_state_bytes,
)
from hone.transforms.memory.terms.tiled_mlp import (
    auto_tiled_shards,
    tiled_mlp_transient,
)
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
    tiled_mlp: int = 0
    """Shards of the tiled MLP (0: untiled)."""
    tiled_transient: int = 0
    """Bytes the tiled MLP holds while one shard is differentiated (in ``activations``)."""
    offloaded_layers: int = 0
    """``offload``: layers whose saved input is in pinned host memory (the rest on the GPU)."""
    host_total: int = 0
    """The process's host memory (resident, pinned included): :func:`host_process_bytes` + ``host``."""
    param_shards: int = 1
    """Processes the weights, gradients and optimizer state are sharded over (FSDP)."""
    layers: int = 0
    """Decoder layers of the model."""
    tiled_layers: int = 0
    """Chunks each decoder layer is computed in (0: whole; :mod:`hone.transforms.tiled_layers`)."""

    def components(self) -> list[tuple[str, int]]:
        """(label, bytes) in display order; their sum is ``total``."""
        return [
            ("weights", self.weights),
            ("trainable state (grads)", self.trainable_state),
            ("optimizer (AdamW moments)", self.optimizer),
            ("activations", self.activations),
            ("embeddings / final norm", self.outside_layers),
            ("loss", self.loss),
            ("workspace", self.workspace),
        ]

    @property
    def total_gib(self) -> float:
        return self.total / GIB


def estimate_memory(cfg: HoneConfig, knobs: Knobs) -> MemoryEstimate:
    """Peak memory of one training step of ``cfg`` under ``knobs`` (the checkpointing policy, the
    loss, the step's shape and memory switches: :class:`~hone.transforms.memory.knobs.Knobs`),
    without loading weights. With ``param_shards`` each process holds a ``1/param_shards`` share
    of the weights, gradients and optimizer state, plus two layers gathered whole; with
    ``tiled_layers`` the layer rebuilt in the backward holds one chunk's activations plus
    :func:`tiled_layer_state_bytes`.
    """
    checkpointing, loss, sequence_len, micro_batch = knobs.checkpointing, knobs.loss, knobs.sequence_len, knobs.micro_batch
    compiled, device, tiled_mlp, offload_layers = knobs.compiled, knobs.device, knobs.tiled_mlp, knobs.offload_layers
    host_budget, param_shards, tiled_layers = knobs.host_budget, knobs.param_shards, knobs.tiled_layers
    if checkpointing not in POLICIES:
        raise ValueError(f"checkpointing must be one of {', '.join(POLICIES)}, got {checkpointing!r}")
    m = model_facts(cfg)
    seq = sequence_len or cfg.data.sequence_len
    mbs = micro_batch or cfg.training.micro_batch_size
    tokens = seq * mbs
    if compiled is None:
        compiled = cfg.performance.compiles_on(device)
    attention = cfg.model.attn_implementation
    c, h = m.compute_bytes, m.hidden
    input_bytes = c * tokens * h  # one layer's saved input (checkpointing)
    chunks = auto_layer_chunks(seq) if tiled_layers == "auto" else int(tiled_layers)
    if chunks < 2 or checkpointing not in ("full", "offload"):
        chunks = 0
    # what one rebuilt layer processes at a time: a chunk of every row, or the whole micro-batch
    piece = mbs * -(-seq // chunks) if chunks else tokens
    shards = auto_tiled_shards(piece, h) if tiled_mlp == "auto" else int(tiled_mlp)
    tiled = shards >= 2

    full = [layer_bytes(layer, m, compiled=compiled, attention=attention, device=device, tiled=tiled).at(tokens, seq) for layer in m.layers]
    # while the tiled MLP differentiates one shard (inside a layer's backward); untiled, the
    # gradient of the MLP's intermediate activation beside what the layer saved
    if tiled:
        transient = max(tiled_mlp_transient(layer, m, piece, shards, compiled=compiled, attention=attention, device=device) for layer in m.layers)
    else:
        transient = max(mlp_backward_bytes_per_token(layer, m) for layer in m.layers) * piece
    late_extra: int | None = None  # GPU bytes beside the stored ones late in the step (default gpu_extra)
    if checkpointing == "none":
        stored_each, recompute, gpu_extra = full, 0, 0
    elif checkpointing == "full":
        stored_each, recompute, gpu_extra = [input_bytes] * len(full), max(full), 0
    elif checkpointing == "selective" and compiled and cfg.performance.torch_compile_backend == "inductor":
        # the compiler's activation memory budget: each layer keeps about that fraction of what
        # it keeps unbudgeted (above its input, which it always holds), recomputing the rest
        # inside its own backward (calibrated on H100 rows: qwen3-8b at 0.2 and 0.5, llama3-8b
        # at 0.15 to 0.4)
        budget = cfg.memory.selective_memory_budget
        stored_each = [input_bytes + int(budget * max(f - input_bytes, 0)) for f in full]
        recompute, gpu_extra = int((1 - budget) * max(full)), 0
    elif checkpointing == "selective":
        stored_each = [selective_bytes(layer, m, tiled).at(tokens, seq) for layer in m.layers]
        recompute, gpu_extra = max(full), 0
    else:  # offload: the first k layers' inputs go to pinned host memory, the rest stay here;
        # while the backward walks the offloaded ones, two are on the GPU (one in use, one coming)
        asked = cfg.memory.offload_layers if offload_layers is None else offload_layers
        leaf = 0 if m.embedding_trainable else 1  # layer 0's input stays (a leaf under LoRA)
        offloaded = offload_split(len(full) - leaf, input_bytes, asked, host_budget)
        kept_after = len(full) - leaf - offloaded
        stored_each = [input_bytes] * leaf + [0] * offloaded + [input_bytes] * kept_after
        recompute, gpu_extra = max(full), (2 * input_bytes if offloaded else 0)
        if kept_after:  # the copies back start once the kept layers are done and freed
            late_extra = 0
    if chunks:  # the rebuilt layer: one chunk's activations, the whole sequence's K/V state
        chunk_bytes = max(layer_bytes(layer, m, compiled=compiled, attention=attention, device=device, tiled=tiled).at(piece, seq) for layer in m.layers)
        recompute = chunk_bytes + tiled_layer_state_bytes(m, tokens)
    stored = sum(stored_each) + (gpu_extra if late_extra is None else late_extra)
    offloaded = offloaded if checkpointing == "offload" else 0
    host = offloaded * pinned_block(input_bytes)

    # final norm (float32 copy + inverse RMS), the RoPE cos/sin tables every layer reads
    outside = tokens * (4 * h + 4) + 2 * c * tokens * m.head_dim + (c * tokens * h if m.final_norm_trainable else 0)
    loss_peak = loss_bytes(m, tokens, loss, device)
    if param_shards < 1:
        raise ValueError(f"param_shards must be >= 1, got {param_shards}")
    weights = m.frozen_bytes + m.trainable_bytes + fp8_copies_bytes(cfg, m)
    grads = m.trainable_bytes
    optimizer = 2 * m.trainable_bytes
    if param_shards > 1:  # FSDP2: a share of everything, and two layers unsharded at a time
        per_layer = (m.frozen_bytes + m.trainable_bytes) // max(len(m.layers), 1)
        weights = -(-weights // param_shards) + 2 * per_layer
        grads, optimizer = -(-grads // param_shards), -(-optimizer // param_shards)
    grad_stream = 2 * c * tokens * h  # the residual stream's gradient and one temporary
    accumulating = cfg.training.gradient_accumulation_steps > 1  # earlier micro-batches' grads

    phases = {
        "loss backward": dict(trainable_state=grads if accumulating else 0, activations=stored, outside_layers=outside, loss=loss_peak),
        "backward, last layer": dict(
            trainable_state=grads if accumulating else m.outside_trainable_bytes,
            activations=stored + recompute + grad_stream + transient,
            outside_layers=0,
            loss=0,
        ),
        "backward, first layer": dict(
            trainable_state=grads, activations=stored_each[0] + gpu_extra + recompute + grad_stream + transient, outside_layers=0, loss=0
        ),
        "optimizer step": dict(trainable_state=grads, activations=0, outside_layers=0, loss=0),
    }
    phase, parts = max(phases.items(), key=lambda item: sum(item[1].values()))
    subtotal = weights + optimizer + sum(parts.values())
    workspace = WORKSPACE_BYTES + int(WORKSPACE_FRACTION * subtotal)
    notes = []
    if attention == "eager":
        notes.append("eager attention keeps the T x T probabilities of every head: use sdpa")
    return MemoryEstimate(
        weights=weights,
        optimizer=optimizer,
        workspace=workspace,
        total=subtotal + workspace,
        host=host,
        phase=phase,
        checkpointing=checkpointing,
        loss_kind=loss,
        compiled=bool(compiled),
        tokens=tokens,
        sequence_len=seq,
        micro_batch=mbs,
        activations_per_layer=max(stored_each),
        recompute=recompute,
        frozen_params=m.frozen_params,
        trainable_params=m.trainable_params,
        notes=tuple(notes),
        tiled_mlp=shards if tiled else 0,
        tiled_transient=transient if tiled else 0,
        tiled_layers=chunks,
        offloaded_layers=offloaded,
        host_total=host_process_bytes(input_bytes if checkpointing == "offload" else 0) + host,
        param_shards=param_shards,
        layers=len(full),
        **parts,
    )
