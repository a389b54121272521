"""Peak GPU memory of a training step, estimated from the config alone (no weight is read).

Why: ``hone plan`` shows what fits before a model is loaded, and ``activation_checkpointing:
auto`` picks the fastest policy whose estimate fits the card. The estimate is a sum of parts a
user can act on (weights, trainable state, optimizer, activations, loss, workspace), and its
largest part is the activations: what autograd keeps per decoder layer until the backward.

How each part is counted
------------------------
* **Parameters** are counted exactly: the model is built on the ``meta`` device (shapes, no
  storage) from the preset or the model directory's ``config.json``, and the adapter is applied
  to it there, so frozen/trainable numbers are those of the run. Their dtypes follow
  :func:`hone.models.precision.precision_for`; AdamW keeps two moments per trainable weight in
  the weight's dtype (``torch.optim.AdamW``); gradients have the weight's dtype.
* **Activations per layer** are a list of the tensors autograd saves, derived op by op and
  checked against a count with ``torch.autograd.graph.saved_tensors_hooks`` on tiny models
  (tests/unit/test_estimate.py): RMSNorms keep a float32 copy of their input and the inverse
  RMS; attention (sdpa/flash/flex) keeps q, k, v, the output and the log-sum-exp (eager
  attention also the T x T probabilities); a gated MLP keeps gate, up and the activation; a LoRA
  projection keeps its input (under autocast a compute-dtype copy per projection, because PEFT
  casts the input to float32 and autocast casts it back) and the rank-r intermediate; dropout
  keeps its mask (a byte per element on CUDA). Under ``torch.compile`` Inductor's partitioner
  keeps fewer tensors (norm inputs in the compute dtype, one copy of a shared LoRA input, the
  activation recomputed): counted separately, checked against ``aot_eager_decomp_partition``.
* **Checkpointing policies**: ``none`` keeps every layer's activations; ``full`` keeps each
  layer's input and recomputes one layer at a time in the backward; ``selective`` keeps the
  input and the matmul outputs; ``offload`` moves the layers' inputs to pinned host memory
  (reported as ``host``, in power-of-two blocks as torch's pinned allocator rounds them), all of
  them or, when the host cannot hold them (``memory.offload_layers``, :func:`offload_split`),
  the first ones, keeping the others on the GPU; two are on the GPU while the backward walks the
  offloaded ones. ``host_total`` adds the process's own resident memory (:func:`host_process_bytes`).
* **FSDP** (``param_shards``): weights, gradients and optimizer state divided over the
  processes, plus two layers' weights gathered whole.
* **Tiled MLP** (``memory.tiled_mlp``): the MLP keeps only its input; while the backward
  differentiates one shard it holds that shard's activations and their gradients, the input
  gradient and, for weights trained in bf16, float32 sums of the MLP's gradients
  (:func:`tiled_mlp_transient`). ``auto``'s rule is :func:`decide_tiled_mlp`.
* **Loss**: the standard loss upcasts the [tokens x vocab] logits to float32; at its peak the
  logits, the float32 log-softmax, its incoming gradient and its input gradient are alive
  (``compute + 12`` bytes per logit). The fused linear cross-entropy holds one chunk of tokens.
* **Peak**: the maximum over the phases of a step (the loss's backward with every saved
  activation alive; the first and last layer's backward with the recompute of one layer; the
  optimizer step), plus a workspace allowance (cuBLAS workspaces, allocator rounding).

Calibrated against ``torch.cuda.max_memory_allocated`` of ``hone bench`` rows on an H100 (see
docs/plan.md); the peaks of the qwen3-8b and llama3-8b rows are within a few percent.
"""

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Literal

from hone.config.root import HoneConfig

GIB = 2**30
MIB = 2**20

Checkpointing = Literal["none", "full", "selective", "offload"]
LossKind = Literal["standard", "fused_linear_ce"]
#: From the fastest step to the leanest.
POLICIES: tuple[Checkpointing, ...] = ("none", "selective", "full", "offload")

#: Workspace allowance: cuBLAS/cuBLASLt workspaces and small buffers the step allocates
#: (RoPE tables, masks, the fused optimizer's step counters), plus the caching allocator's
#: rounding of every block to 512 bytes / 2 MiB segments, as a fraction of the rest.
WORKSPACE_BYTES = 256 * MIB
WORKSPACE_FRACTION = 0.005

#: Host memory of a training process that offloads nothing (resident set): the torch/CUDA
#: libraries and the CUDA context's host side, Python, the tokenizer and the data. Set from
#: ``hone bench`` rows' peak RSS at short lengths on an H100 machine (1.9 GiB at 2K tokens).
HOST_BASE_BYTES = 2 * GIB

#: Beyond that and the pinned blocks, an ``offload`` run's resident memory grows by about this
#: many layer inputs (``tokens x hidden`` in the compute dtype): calibrated on qwen3-8b
#: ``offload`` rows on an H100 machine (peak RSS 4.2, 21.3 and 79.9 GiB at 8K, 64K and 256K
#: tokens, of which 2.2, 17.5 and 70 GiB pinned blocks).
HOST_INPUTS_BEYOND_PINNED = 4


def host_process_bytes(input_bytes: int) -> int:
    """The process's host memory besides its pinned blocks, for layer inputs of ``input_bytes``."""
    return HOST_BASE_BYTES + HOST_INPUTS_BEYOND_PINNED * input_bytes

#: The share of the host's memory an offload split may not use (the page cache, other
#: processes, and the allocator's rounding beyond what :func:`pinned_block` counts).
HOST_MARGIN = 0.1


def pinned_block(nbytes: int) -> int:
    """Bytes torch's pinned-memory allocator takes for an ``nbytes`` request: it rounds every
    block up to a power of two (``CachingHostAllocator``), so a layer input of 4.5 GiB costs 8 GiB
    of host memory: the split must count blocks, not tensors."""
    return 0 if nbytes <= 0 else 1 << (nbytes - 1).bit_length()


def offload_split(layers: int, input_bytes: int, asked: int | Literal["auto"], host_budget: int | None) -> int:
    """How many layers' inputs the ``offload`` policy moves to the host: ``asked`` when it is a
    count (at most ``layers``); for ``auto`` every layer's when ``host_budget`` (bytes of host
    memory; None: unlimited) holds them, else as many pinned blocks as fit it less
    :data:`HOST_MARGIN` and the process's own (:func:`host_process_bytes`). The others stay on the GPU."""
    if asked != "auto":
        return max(0, min(int(asked), layers))
    block = pinned_block(input_bytes)
    if host_budget is None or block == 0:
        return layers
    room = int(host_budget * (1 - HOST_MARGIN)) - host_process_bytes(input_bytes)
    return max(0, min(layers, room // block))


#: LoRA/linear inputs are grouped by what they read: q/k/v read the attention norm's output,
#: gate/up (and a trainable MoE router) the MLP norm's output. A shared input is kept once
#: where autograd keeps the tensor itself, once per projection where each makes a copy.
_SITES = {
    "q_proj": "attn_in", "k_proj": "attn_in", "v_proj": "attn_in", "qkv_proj": "attn_in",
    "o_proj": "o_in",
    "gate_proj": "mlp_in", "up_proj": "mlp_in", "gate_up_proj": "mlp_in", "gate": "mlp_in",
    "down_proj": "down_in",
}  # fmt: skip


@dataclass(frozen=True)
class LinearFacts:
    """One linear layer of a decoder layer, as the adapter left it."""

    name: str
    site: str
    in_features: int
    out_features: int
    trainable: bool
    """The base weight is trained (full fine-tune, or a module in ``lora_modules_to_save``)."""
    lora_rank: int = 0
    lora_dropout: float = 0.0


@dataclass(frozen=True)
class LayerFacts:
    linears: tuple[LinearFacts, ...]
    norms: int
    """RMSNorms on the residual stream (2; Gemma 3 has 4)."""
    qk_norm: bool
    norms_trainable: bool
    moe: bool
    experts_trainable: bool


@dataclass(frozen=True)
class ModelFacts:
    """Everything the estimate needs about the model, read from a meta-device build."""

    architecture: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    max_positions: int | None
    experts: int
    top_k: int
    expert_intermediate: int
    layers: tuple[LayerFacts, ...]
    frozen_params: int
    trainable_params: int
    frozen_bytes: int
    trainable_bytes: int
    outside_trainable_bytes: int
    """Trainable bytes outside the decoder layers (embedding, head, final norm)."""
    head_trainable: bool
    embedding_trainable: bool
    """A frozen embedding (LoRA) makes layer 0's input a leaf that autograd keeps on the GPU:
    the offload hooks never move it."""
    final_norm_trainable: bool
    compute_bytes: int
    autocast: bool
    trainable_elem_bytes: int
    lora_base_shapes: tuple[tuple[int, int], ...] = ()
    """``(in, out)`` of each linear LoRA wraps (``performance.fp8: ... lora_targets`` keeps float8 copies of these)."""
    frozen_layer_linear_shapes: tuple[tuple[int, int], ...] = ()
    """``(in, out)`` of every frozen linear inside the decoder layers (``fp8_base_linears: all``)."""


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


# ---------------------------------------------------------------------------------------------
# The model, on the meta device


def _elem_bytes(dtype: Any) -> int:
    return dtype.itemsize


def _transformers_config(model: Any) -> Any:
    """The transformers config of ``model`` (a ModelConfig) as the loader builds it: preset
    (tiny ones take the tokenizer's vocabulary) or the directory's config.json. No weight file
    is opened."""
    if model.preset is not None:
        from hone.models.presets import build_preset_config, get_preset

        vocab = None
        if get_preset(model.preset).tiny:
            from hone.models.tokenizer import load_tokenizer

            vocab = len(load_tokenizer(model))
        return build_preset_config(model.preset, dict(model.preset_overrides), vocab)
    from hone.models.hub import local_model_dir
    from hone.models.model_dir import read_causal_lm_config

    return read_causal_lm_config(local_model_dir(model.path), model.trust_remote_code)


def _decoder_layers(model: Any, count: int) -> Any:
    """The ModuleList of decoder layers (the first one of ``num_hidden_layers`` entries)."""
    from torch import nn

    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) == count and name.endswith("layers"):
            return name, module
    raise ValueError(f"cannot find the {count} decoder layers of {type(model).__name__}")


def _layer_facts(layer: Any) -> LayerFacts:
    from peft.tuners.lora import LoraLayer, ParamWrapper
    from torch import nn

    linears: list[LinearFacts] = []
    inside_lora: set[int] = set()
    for name, module in layer.named_modules():
        # LoRA on the experts' 3-D parameters (ParamWrapper) is no linear layer: its rank-r
        # factors are small beside the experts, which the MoE terms below account for.
        if isinstance(module, LoraLayer) and not isinstance(module, ParamWrapper):
            adapter = module.active_adapters[0]
            base = module.get_base_layer()
            dropout = module.lora_dropout[adapter]
            short = name.rsplit(".", 1)[-1]
            linears.append(
                LinearFacts(
                    short,
                    _SITES.get(short, name),
                    base.in_features,
                    base.out_features,
                    trainable=base.weight.requires_grad,
                    lora_rank=module.r[adapter],
                    lora_dropout=dropout.p if isinstance(dropout, nn.Dropout) else 0.0,
                )
            )
            inside_lora.update(id(m) for m in module.modules())
    for name, module in layer.named_modules():
        if isinstance(module, nn.Linear) and id(module) not in inside_lora:
            parts = [p for p in name.split(".") if p not in ("modules_to_save", "original_module", "default")]
            short = parts[-1] if parts else name
            if not module.weight.requires_grad and any(lf.name == short for lf in linears):
                continue  # the frozen original beside a modules_to_save copy
            linears.append(LinearFacts(short, _SITES.get(short, name), module.in_features, module.out_features, module.weight.requires_grad))
    params = list(layer.named_parameters())
    norm_names = {name.rsplit(".", 2)[-2] for name, p in params if p.ndim == 1 and "norm" in name}
    experts = [p for _, p in params if p.ndim == 3]
    return LayerFacts(
        linears=tuple(linears),
        norms=len({n for n in norm_names if n not in ("q_norm", "k_norm")}),
        qk_norm=bool({"q_norm", "k_norm"} & norm_names),
        norms_trainable=any(p.requires_grad for name, p in params if p.ndim == 1 and "norm" in name),
        moe=bool(experts),
        experts_trainable=any(p.requires_grad for p in experts),
    )


#: NF4 storage per weight (model.quantize: nf4): a 4-bit code, an int8 scale per 64 weights and a
#: float32 factor per 16,384 (hone.models.nf4).
NF4_BYTES_PER_WEIGHT = 0.5 + 1 / 64 + 4 / 16384


def _nf4_weights(base: Any) -> int:
    """Weights the quantize transform stores in NF4 (every linear layer but the head that fits its blocks)."""
    from hone.models.nf4 import can_quantize, quantizable_linears

    return sum(linear.weight.numel() for _, _, linear, _ in quantizable_linears(base) if can_quantize(linear))


@lru_cache(maxsize=32)
def _facts_cached(model_json: str, adapter_json: str) -> ModelFacts:
    import torch
    from transformers import AutoModelForCausalLM

    from hone.config.adapter import AdapterConfig
    from hone.config.model import ModelConfig
    from hone.models.adapters import apply_adapter
    from hone.models.precision import precision_for

    model_cfg = ModelConfig.model_validate_json(model_json)
    adapter_cfg = AdapterConfig.model_validate_json(adapter_json)
    config = _transformers_config(model_cfg)
    precision = precision_for(model_cfg.dtype, full_finetune=not adapter_cfg.is_lora)
    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(config)
        quantized = _nf4_weights(base) if model_cfg.quantize == "nf4" else 0
        model = apply_adapter(base, adapter_cfg)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers_name, layer_list = _decoder_layers(model, text.num_hidden_layers)
    frozen = trainable = outside_trainable = 0
    lora_base: list[tuple[int, int]] = []
    layer_linears: list[tuple[int, int]] = []
    for name, param in model.named_parameters():  # tied weights are listed once
        if not param.requires_grad and param.ndim == 2 and name.startswith(layers_name + "."):
            shape = (param.shape[1], param.shape[0])
            layer_linears.append(shape)
            if name.endswith("base_layer.weight"):
                lora_base.append(shape)
        if param.requires_grad:
            trainable += param.numel()
            if not name.startswith(layers_name + "."):
                outside_trainable += param.numel()
        else:
            frozen += param.numel()
    head = base.get_output_embeddings()
    final_norm = next((m for n, m in base.named_modules() if n.endswith("model.norm") or n == "norm"), None)
    heads = text.num_attention_heads
    tbytes = _elem_bytes(precision.trainable)
    return ModelFacts(
        architecture=type(base).__name__,
        hidden=text.hidden_size,
        heads=heads,
        kv_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
        intermediate=getattr(text, "intermediate_size", 0) or 0,
        vocab=text.vocab_size,
        max_positions=getattr(text, "max_position_embeddings", None),
        experts=getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None) or 0,
        top_k=getattr(text, "num_experts_per_tok", 0) or 0,
        expert_intermediate=getattr(text, "moe_intermediate_size", 0) or 0,
        layers=tuple(_layer_facts(layer) for layer in layer_list),
        frozen_params=frozen,
        trainable_params=trainable,
        frozen_bytes=(frozen - quantized) * _elem_bytes(precision.weights) + round(quantized * NF4_BYTES_PER_WEIGHT),
        trainable_bytes=trainable * tbytes,
        outside_trainable_bytes=outside_trainable * tbytes,
        head_trainable=bool(head is not None and any(p.requires_grad for p in head.parameters())),
        embedding_trainable=any(p.requires_grad for p in base.get_input_embeddings().parameters()),
        final_norm_trainable=bool(final_norm is not None and any(p.requires_grad for p in final_norm.parameters())),
        compute_bytes=_elem_bytes(precision.compute),
        autocast=precision.autocast_dtype is not None,
        trainable_elem_bytes=tbytes,
        lora_base_shapes=tuple(lora_base),
        frozen_layer_linear_shapes=tuple(layer_linears),
    )


def model_facts(cfg: HoneConfig) -> ModelFacts:
    """Parameter counts and layer structure of ``cfg``'s model with its adapter (meta device,
    cached per model/adapter config: the bisection in :func:`longest_sequence` reuses it)."""
    return _facts_cached(cfg.model.model_dump_json(), cfg.adapter.model_dump_json())


# ---------------------------------------------------------------------------------------------
# Activations of one decoder layer


@dataclass(frozen=True)
class LayerBytes:
    """What one layer keeps: ``per_token`` bytes for every token of the micro-batch, plus
    ``per_token_key`` for every (token, attended key) pair (eager attention's probabilities)
    and ``fixed`` bytes that do not grow with tokens (autocast's cast copies of LoRA weights)."""

    per_token: int
    per_token_key: int = 0
    fixed: int = 0

    def at(self, tokens: int, sequence_len: int) -> int:
        return self.per_token * tokens + self.per_token_key * tokens * sequence_len + self.fixed


def _site_bytes(linears: list[LinearFacts], width: int, site: str, m: ModelFacts, compiled: bool, mask_bytes: int) -> tuple[int, int]:
    """(per-token, fixed) bytes the projections reading one input keep for their backward."""
    c = m.compute_bytes
    lora = [lf for lf in linears if lf.lora_rank]
    trained = [lf for lf in linears if lf.trainable]
    per_token = sum(c * lf.lora_rank for lf in lora)  # lora_A's output, for lora_B's gradient
    fixed = sum(c * lf.lora_rank * (lf.in_features + lf.out_features) for lf in lora) if m.autocast else 0
    dropped = [lf for lf in lora if lf.lora_dropout > 0]
    per_token += sum(mask_bytes * width for lf in dropped)
    if m.autocast:
        # PEFT casts the input to float32, autocast casts it back: a compute-dtype copy per
        # projection (compiled: one copy for all, the partitioner shares it).
        copies = (1 if lora else 0) if compiled else len(lora)
        return per_token + c * width * (copies + len(trained)), fixed
    per_token += sum(c * width for lf in dropped)  # each dropout output is a new tensor
    keeps_input = bool(trained) or any(lf.lora_dropout == 0 for lf in lora)
    if keeps_input and site != "o_in":  # the attention output is kept by attention already
        per_token += c * width
    return per_token, fixed


#: The projection inputs that belong to the MLP (dense or MoE block): what tiling takes away.
MLP_SITES = ("mlp_in", "down_in")


def auto_tiled_shards(tokens: int, hidden: int) -> int:
    """``memory.tiled_mlp: auto``'s shard count: about ``hidden`` tokens per shard (as ALST
    does), so one shard's ``[tokens x intermediate]`` activations are the size of an MLP weight
    and the shard's matmuls are still large; at least 2."""
    return max(2, -(-tokens // max(hidden, 1)))


def layer_bytes(layer: LayerFacts, m: ModelFacts, *, compiled: bool, attention: str, device: str, tiled: bool = False) -> LayerBytes:
    """Bytes autograd keeps for one decoder layer without checkpointing (see the module doc).

    ``tiled``: the MLP is tiled (:mod:`hone.transforms.tiled_mlp`) and keeps only its input; what
    it holds while one shard is differentiated is :func:`tiled_mlp_transient`."""
    c = m.compute_bytes
    h, q_width, kv_width = m.hidden, m.heads * m.head_dim, m.kv_heads * m.head_dim
    # CUDA's fused dropout keeps a bool mask; elsewhere a mask in the dropout input's dtype
    # (float32 under autocast: PEFT casts the input to the adapter's dtype first)
    mask_bytes = 1 if device == "cuda" else (4 if m.autocast else c)
    per_token = per_key = fixed = 0
    # residual-stream norms: float32 copy of the input + inverse RMS (compiled: the input as is)
    norm = (c * h if compiled else 4 * h) + 4
    per_token += layer.norms * (norm + (c * h if layer.norms_trainable and not compiled else 0))
    if layer.qk_norm:
        widths = (q_width, kv_width)
        per_token += sum((c if compiled else 4) * w + (c * w if layer.norms_trainable and not compiled else 0) for w in widths)
        per_token += 4 * (m.heads + m.kv_heads)
    # attention: q, k, v, output, log-sum-exp (eager: k, v repeated to every head + probabilities)
    if attention == "eager":
        per_token += c * (4 * q_width)
        per_key += m.heads * (4 + (c if c != 4 else 0))
    else:
        per_token += c * (2 * q_width + 2 * kv_width) + 4 * m.heads
    # the projections' inputs, grouped by what they read
    by_site: dict[str, list[LinearFacts]] = {}
    for lf in layer.linears:
        by_site.setdefault(lf.site, []).append(lf)
    for site, group in by_site.items():
        if layer.moe and site == "down_in":
            continue
        t, f = _site_bytes(group, group[0].in_features, site, m, compiled, mask_bytes)
        per_token += 0 if tiled and site in MLP_SITES else t
        fixed += f
    if tiled:
        per_token += c * h  # the MLP's input, saved by the tiled MLP for its recompute
    elif layer.moe:
        k, e, im = m.top_k, m.experts, m.expert_intermediate
        # router probabilities (float32), routing indices and weights, then per routed token:
        # gate_up output, activation, expert output (for the routing-weight product)
        per_token += 4 * e + 32 * k + 4 + 8 * k + c * k * (3 * im + h)
        fixed += 4 * e
        if layer.experts_trainable:
            per_token += c * k * (h + im)
    else:
        per_token += (2 if compiled else 3) * c * _dense_intermediate(layer, m)  # gate, up (+ activation)
    return LayerBytes(per_token, per_key, fixed)


def _dense_intermediate(layer: LayerFacts, m: ModelFacts) -> int:
    """The dense MLP's intermediate width (the gate/up projection's output, halved for a fused
    gate_up projection); 0 for an MoE block."""
    if layer.moe:
        return 0
    intermediate = max((lf.out_features for lf in layer.linears if lf.site == "mlp_in"), default=m.intermediate)
    if any(lf.name == "gate_up_proj" for lf in layer.linears):
        intermediate //= 2
    return intermediate


def mlp_backward_bytes_per_token(layer: LayerFacts, m: ModelFacts) -> int:
    """Bytes per token an untiled dense MLP's backward holds beyond its saved activations: the
    gradient of its ``[tokens x intermediate]`` activation, alive beside the saved gate and up
    until their own gradients are formed (calibrated on qwen3-8b rows at 64K and 256K tokens,
    whose measured peaks were 1.7 and 7.7 GiB above the estimate without it)."""
    return m.compute_bytes * _dense_intermediate(layer, m)


#: ``memory.tiled_layers: auto``'s chunk: about this many tokens per chunk of a tiled layer
#: (large enough that each chunk's matmuls and attention run at full speed, small enough that one
#: chunk's activations are a few GiB for an 8B model).
TILED_LAYER_CHUNK_TOKENS = 32_768


def auto_layer_chunks(sequence_len: int) -> int:
    """``memory.tiled_layers: auto``'s chunk count: about :data:`TILED_LAYER_CHUNK_TOKENS` tokens
    of each row per chunk; at least 2."""
    return max(2, -(-sequence_len // TILED_LAYER_CHUNK_TOKENS))


def tiled_layer_state_bytes(m: ModelFacts, tokens: int) -> int:
    """What a tiled layer (:mod:`hone.transforms.tiled_layers`) holds for the whole sequence while
    its backward walks the chunks: the keys and values of every position ([tokens x kv width],
    compute dtype), their gradient sums (float32), the prefix of keys and values each chunk
    attends to (copied together with the chunk's own) and its gradient, once per group of query
    heads sharing a key head (they are attended one group at a time) plus the running sum. The
    layer's input gradient it fills chunk by chunk is the one any layer's backward produces
    (counted with the residual stream's gradient). Measured: qwen3-8b at 256K tokens in 8 chunks
    peaked at 41.6 GiB against 39.1 GiB estimated (H100)."""
    c, kv = m.compute_bytes, m.kv_heads * m.head_dim
    groups = max(1, m.heads // max(m.kv_heads, 1))
    return tokens * 2 * kv * (c + 4 + c + (groups + 1) * c)


def mlp_bytes_per_token(layer: LayerFacts, m: ModelFacts, *, compiled: bool, attention: str, device: str) -> int:
    """Bytes per token the untiled MLP keeps for its backward beyond what the tiled one keeps
    (its ``[tokens x intermediate]`` activations, LoRA intermediates, routed tokens)."""
    untiled = layer_bytes(layer, m, compiled=compiled, attention=attention, device=device)
    tiled = layer_bytes(layer, m, compiled=compiled, attention=attention, device=device, tiled=True)
    return untiled.per_token - tiled.per_token


def tiled_mlp_transient(layer: LayerFacts, m: ModelFacts, tokens: int, shards: int, *, compiled: bool, attention: str, device: str) -> int:
    """Bytes the tiled MLP holds while it differentiates one shard in the backward: the shard's
    activations (what the untiled MLP keeps, for ``tokens / shards`` tokens) and as much again
    for their gradients, the input gradient it fills ([tokens x hidden]) and, for parameters
    trained in a lower precision, their float32 gradient sums."""
    c = m.compute_bytes
    shard_tokens = -(-tokens // shards)
    # the MLP's own saved tensors (eager: the input copy included) for one shard, twice
    per_token = mlp_bytes_per_token(layer, m, compiled=False, attention=attention, device=device) + c * m.hidden
    sums = 0
    if m.trainable_elem_bytes != 4:
        trained = sum(lf.in_features * lf.out_features for lf in layer.linears if lf.trainable and lf.site in MLP_SITES)
        trained += sum(lf.lora_rank * (lf.in_features + lf.out_features) for lf in layer.linears if lf.lora_rank and lf.site in MLP_SITES)
        if layer.experts_trainable:
            trained += m.experts * 3 * m.expert_intermediate * m.hidden
        sums = 4 * trained
    return 2 * per_token * shard_tokens + c * tokens * m.hidden + sums


def _selective_bytes(layer: LayerFacts, m: ModelFacts, tiled: bool = False) -> LayerBytes:
    """Selective checkpointing: the layer input and every matmul's output (base projections,
    LoRA A and B, attention's output and log-sum-exp); the cheap ops are recomputed. A tiled MLP
    computes its matmuls without grad: selective keeps none of them, only the MLP's input."""
    c = m.compute_bytes
    per_token = c * m.hidden + c * m.heads * m.head_dim + 4 * m.heads
    for lf in layer.linears:
        if tiled and lf.site in MLP_SITES:
            continue
        per_token += c * lf.out_features + (c * (lf.lora_rank + lf.out_features) if lf.lora_rank else 0)
    if tiled:
        per_token += c * m.hidden
    elif layer.moe:
        per_token += c * m.top_k * (2 * m.expert_intermediate + m.hidden) + 4 * m.experts
    return LayerBytes(per_token)


# ---------------------------------------------------------------------------------------------
# The whole step


def checkpointing_of(cfg: HoneConfig) -> str:
    """The policy the config asks for (none/full/selective/offload/auto; the boolean alias
    ``memory.gradient_checkpointing`` resolved)."""
    return cfg.memory.checkpointing


def loss_decision(cfg: HoneConfig) -> tuple[LossKind, str]:
    """(the loss the run will use, why), by the run's own rule
    (:func:`hone.transforms.loss.decide_loss`) with what the model's config shows (a bias on the
    head is only known once the model loads)."""
    from hone.transforms.loss import decide_loss, fused_loss_blockers

    return decide_loss(cfg.performance.loss, fused_loss_blockers(_transformers_config(cfg.model), None))


def loss_of(cfg: HoneConfig) -> LossKind:
    """The loss the run will use (see :func:`loss_decision`)."""
    return loss_decision(cfg)[0]


def fused_chunk_tokens(tokens: int, vocab: int) -> int:
    """Tokens per chunk of the fused linear cross-entropy: the kernel's own choice."""
    from hone.kernels.cross_entropy import default_chunk_tokens

    return default_chunk_tokens(tokens, vocab)


def loss_bytes(m: ModelFacts, tokens: int, kind: LossKind, device: str = "cuda") -> int:
    """Bytes the loss holds at its peak, beyond the layers' activations."""
    c, v, h = m.compute_bytes, m.vocab, m.hidden
    if kind == "standard":
        # logits (compute dtype) + float32 log-softmax + its incoming and outgoing gradients
        # (in float32 runs the upcast is the logits themselves: 4 + 12 either way)
        return tokens * v * (c + 12) + (c * tokens * h if m.head_trainable else 0)
    # hone.kernels.cross_entropy, inside its forward: the hidden states it reads and the
    # gradient it writes for them ([tokens x hidden] each), one chunk's logits -- overwritten in
    # place by their gradient with the Triton step (CUDA); with the torch step a float32 copy
    # and a downcast gradient beside them -- and a trained head's float32 gradient and its cast
    chunk = fused_chunk_tokens(tokens, v)
    per_chunk = chunk * v * (c if device == "cuda" else 2 * c + 4)
    head_grad = (4 + c) * v * h if m.head_trainable else 0
    return 2 * c * tokens * h + per_chunk + head_grad


def fp8_copies_bytes(cfg: HoneConfig, m: ModelFacts) -> int:
    """The float8 copies a LoRA run on a float8 base keeps beside each converted bf16 weight (the
    weight per output row and its transpose per input column: 2 bytes a weight, hone.transforms.fp8);
    a full fine-tune's float8 casts are per step and transient. Layers the shape rule keeps in bf16
    (hone.transforms.fp8_sizes) have no copies."""
    from hone.transforms.fp8_sizes import converts_to_fp8

    perf = cfg.performance
    if perf.fp8 == "off" or not cfg.adapter.is_lora:
        return 0
    shapes = m.lora_base_shapes if perf.fp8_base_linears == "lora_targets" else m.frozen_layer_linear_shapes
    return 2 * sum(k * n for k, n in shapes if converts_to_fp8(k, n, perf.fp8, perf.fp8_small_linears))


def estimate_memory(
    cfg: HoneConfig,
    *,
    checkpointing: str,
    loss: LossKind,
    sequence_len: int | None = None,
    micro_batch: int | None = None,
    compiled: bool | None = None,
    device: str = "cuda",
    tiled_mlp: int | Literal["auto"] = 0,
    offload_layers: int | Literal["auto"] | None = None,
    host_budget: int | None = None,
    param_shards: int = 1,
    tiled_layers: int | Literal["auto"] = 0,
) -> MemoryEstimate:
    """Peak memory of one training step of ``cfg`` under ``checkpointing``
    (``none``/``full``/``selective``/``offload``) and ``loss``, without loading weights.

    ``sequence_len``/``micro_batch`` default to the config's; ``compiled`` to whether the config
    compiles on ``device`` (``torch_compile: auto`` compiles on CUDA). ``tiled_mlp``: the MLP in
    that many shards (0: untiled; ``auto``: :func:`auto_tiled_shards` of the tokens).
    ``offload_layers`` (``offload``): the host/GPU split, default the config's
    ``memory.offload_layers``, ``auto`` decided on ``host_budget`` bytes of host memory
    (:func:`offload_split`). ``param_shards``: processes FSDP shards the weights, gradients and
    optimizer state over (each holds a ``1/param_shards`` share, plus two layers gathered whole).
    ``tiled_layers`` (``full``/``offload``): each layer computed and rebuilt in that many chunks of
    the sequence (``auto``: :func:`auto_layer_chunks`; 0: whole), so the layer rebuilt in the
    backward holds one chunk's activations plus :func:`tiled_layer_state_bytes`.
    """
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
        stored_each = [_selective_bytes(layer, m, tiled).at(tokens, seq) for layer in m.layers]
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


def longest_sequence(
    cfg: HoneConfig,
    checkpointing: str,
    loss: LossKind,
    budget_bytes: int,
    *,
    micro_batch: int | None = None,
    compiled: bool | None = None,
    device: str = "cuda",
    multiple: int = 256,
    limit: int = 1 << 24,
    tiled_mlp: int | Literal["auto"] = 0,
    offload_layers: int | Literal["auto"] | None = None,
    host_budget: int | None = None,
    param_shards: int = 1,
    tiled_layers: int | Literal["auto"] = 0,
) -> int:
    """The longest ``sequence_len`` (a multiple of ``multiple``) whose estimated peak fits
    ``budget_bytes`` on the GPU and, when ``host_budget`` is given, whose host memory
    (``host_total``) fits that; 0 when not even ``multiple`` tokens fit. Bisection on the
    estimate, which grows with the sequence (linearly, or quadratically with eager attention;
    an ``auto`` offload split keeps fewer layers on the host as they grow, so the GPU share
    grows faster than linearly once the host is full)."""

    def fits(seq: int) -> bool:
        est = estimate_memory(
            cfg,
            checkpointing=checkpointing,
            loss=loss,
            sequence_len=seq,
            micro_batch=micro_batch,
            compiled=compiled,
            device=device,
            tiled_mlp=tiled_mlp,
            offload_layers=offload_layers,
            host_budget=host_budget,
            param_shards=param_shards,
            tiled_layers=tiled_layers,
        )
        return est.total <= budget_bytes and (host_budget is None or est.host_total <= host_budget)

    lo, hi = 0, 1
    if not fits(multiple):
        return 0
    while hi * multiple < limit and fits(hi * 2 * multiple):
        hi *= 2
    lo = hi
    hi = min(hi * 2, limit // multiple)
    while hi - lo > 1:  # fits(lo * multiple), not fits(hi * multiple)
        mid = (lo + hi) // 2
        if fits(mid * multiple):
            lo = mid
        else:
            hi = mid
    return lo * multiple


#: The share of the card an estimate may not use (estimates are not exact, the allocator
#: fragments): the margin of ``activation_checkpointing: auto`` and ``tiled_mlp: auto``.
AUTO_MARGIN = 0.1


@dataclass(frozen=True)
class TiledDecision:
    """``memory.tiled_mlp`` resolved for one checkpointing policy on one card."""

    shards: int
    """0: untiled."""
    why: str
    does_not_fit: bool = False
    """``auto`` left tiling off on a run that does not fit even tiled (worth recording)."""


def _auto_limit(budget: int, source: str) -> tuple[int, str]:
    """What an ``auto`` memory decision may use of a ``budget``-byte card, and how to say it."""
    usable = int(budget * (1 - AUTO_MARGIN))
    return usable, f"{usable / GIB:.1f} GiB ({source} less a {AUTO_MARGIN:.0%} margin)"


def decide_tiled_mlp(
    cfg: HoneConfig, policy: str, loss: LossKind, device: str, budget: int, source: str, *, host_budget: int | None = None, param_shards: int = 1
) -> TiledDecision:
    """``tiled_mlp`` under ``policy`` on a card of ``budget`` bytes (``source``: where that
    number comes from, for the reason). An explicit count or ``off`` is taken as written;
    ``auto`` tiles only when the untiled estimate does not fit (less :data:`AUTO_MARGIN`) and
    the tiled one, in :func:`auto_tiled_shards` shards, does: the MLP's [tokens x intermediate]
    activations are then what does not fit. ``param_shards``: FSDP's share of the weights per
    process (a sharded run has more room for activations); ``host_budget``: the host memory an
    ``offload`` split is decided on."""
    configured = cfg.memory.tiled_mlp_shards
    if configured is not None:
        return TiledDecision(configured, f"memory.tiled_mlp: {cfg.memory.tiled_mlp}")
    usable, limit = _auto_limit(budget, source)
    extra = {"host_budget": host_budget, "param_shards": param_shards}
    untiled = estimate_memory(cfg, checkpointing=policy, loss=loss, device=device, **extra).total
    if untiled <= usable:
        return TiledDecision(0, f"tiled_mlp: auto: the run fits untiled ({untiled / GIB:.1f} GiB <= {limit})")
    tiled = estimate_memory(cfg, checkpointing=policy, loss=loss, device=device, tiled_mlp="auto", **extra)
    if tiled.total <= usable:
        return TiledDecision(
            tiled.tiled_mlp,
            f"tiled_mlp: auto: {tiled.tiled_mlp} shards, the MLP's [tokens x intermediate] activations are what does not "
            f"fit: untiled {untiled / GIB:.1f} GiB, tiled {tiled.total / GIB:.1f} GiB <= {limit}",
        )
    return TiledDecision(
        0,
        f"tiled_mlp: auto: off, the run does not fit tiled either ({untiled / GIB:.1f} GiB untiled, {tiled.total / GIB:.1f} GiB "
        f"in {tiled.tiled_mlp} shards, > {limit}): tiling alone would not make it fit",
        does_not_fit=True,
    )


def decide_tiled_layers(
    cfg: HoneConfig,
    policy: str,
    loss: LossKind,
    device: str,
    budget: int,
    source: str,
    *,
    tiled_mlp: int = 0,
    host_budget: int | None = None,
    param_shards: int = 1,
) -> TiledDecision:
    """``memory.tiled_layers`` under ``policy`` on a card of ``budget`` bytes: a count or ``off`` as
    written; ``auto`` chunks the layers (:func:`auto_layer_chunks`) only under ``full`` or
    ``offload`` and only when the run does not fit whole and does fit chunked (both with
    ``tiled_mlp`` shards, the MLP decision): the layer rebuilt in the backward is then what does
    not fit."""
    configured = cfg.memory.tiled_layers_chunks
    if configured is not None:
        return TiledDecision(configured, f"memory.tiled_layers: {cfg.memory.tiled_layers}")
    if policy not in ("full", "offload"):
        return TiledDecision(0, f"tiled_layers: auto: off, checkpointing {policy} (tiled layers are a form of full checkpointing)")
    usable, limit = _auto_limit(budget, source)
    extra = {"host_budget": host_budget, "param_shards": param_shards, "device": device}
    whole = estimate_memory(cfg, checkpointing=policy, loss=loss, tiled_mlp=tiled_mlp, **extra).total
    if whole <= usable:
        return TiledDecision(0, f"tiled_layers: auto: off, the run fits with whole layers ({whole / GIB:.1f} GiB <= {limit})")
    chunked = estimate_memory(cfg, checkpointing=policy, loss=loss, tiled_mlp=tiled_mlp, tiled_layers="auto", **extra)
    if chunked.total <= usable:
        return TiledDecision(
            chunked.tiled_layers,
            f"tiled_layers: auto: {chunked.tiled_layers} chunks, the layer rebuilt in the backward is what does not fit: "
            f"whole {whole / GIB:.1f} GiB, chunked {chunked.total / GIB:.1f} GiB <= {limit}",
        )
    return TiledDecision(
        0,
        f"tiled_layers: auto: off, the run does not fit chunked either ({whole / GIB:.1f} GiB whole, {chunked.total / GIB:.1f} GiB "
        f"in {chunked.tiled_layers} chunks, > {limit})",
        does_not_fit=True,
    )


def estimate_for_config(cfg: HoneConfig, device: str = "cuda", host_budget: int | None = None) -> MemoryEstimate | None:
    """The estimate of the step ``cfg`` runs as written (its checkpointing policy, loss and MLP
    tiling, ``tiled_mlp: auto`` decided as the planner decides it on ``device``'s memory, an
    ``offload_layers: auto`` split on ``host_budget``, default this machine's RAM); None for
    ``activation_checkpointing: auto``, whose policy the planner picks later."""
    policy = checkpointing_of(cfg)
    if policy not in POLICIES:
        return None
    loss = loss_of(cfg)
    if host_budget is None:
        from hone.transforms.card import host_memory

        host_budget = host_memory(None)[0]
    shards, chunks = cfg.memory.tiled_mlp_shards, cfg.memory.tiled_layers_chunks
    if shards is None or chunks is None:  # auto: decided on this device's card, as the planner decides it
        from hone.transforms.card import device_memory

        budget, source = device_memory(device, None)
        if shards is None:
            shards = decide_tiled_mlp(cfg, policy, loss, device, budget, source, host_budget=host_budget).shards
        if chunks is None:
            chunks = decide_tiled_layers(cfg, policy, loss, device, budget, source, tiled_mlp=shards, host_budget=host_budget).shards
    return estimate_memory(cfg, checkpointing=policy, loss=loss, device=device, tiled_mlp=shards, host_budget=host_budget, tiled_layers=chunks)

