"""Bytes autograd keeps for one decoder layer until its backward.

**Activations per layer** are a list of the tensors autograd saves, derived op by op and checked
against a count with ``torch.autograd.graph.saved_tensors_hooks`` on tiny models
(tests/unit/test_estimate.py): RMSNorms keep a float32 copy of their input and the inverse RMS;
attention (sdpa/flash/flex) keeps q, k, v, the output and the log-sum-exp (eager attention also
the T x T probabilities); a gated MLP keeps gate, up and the activation; a LoRA projection keeps
its input (under autocast a compute-dtype copy per projection, because PEFT casts the input to
float32 and autocast casts it back) and the rank-r intermediate; dropout keeps its mask (a byte
per element on CUDA). Under ``torch.compile`` Inductor's partitioner keeps fewer tensors (norm
inputs in the compute dtype, one copy of a shared LoRA input, the activation recomputed): counted
separately, checked against ``aot_eager_decomp_partition``.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from hone.transforms.memory.facts import LayerFacts, LinearFacts, ModelFacts
from hone.transforms.memory.step import Step
from hone.transforms.memory.terms.fp8 import float8_site_bytes


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


def _site_bytes(
    linears: list[LinearFacts],
    width: int,
    site: str,
    m: ModelFacts,
    compiled: bool,
    mask_bytes: int,
    float8: tuple[str, str] | None = None,
    fused_lora: bool = False,
) -> tuple[int, int]:
    """(per-token, fixed) bytes the projections reading one input keep for their backward.
    ``fused_lora``: hone's fused LoRA layer, which keeps the input itself (in the compute dtype
    already), not a cast copy of it as PEFT's layer under autocast does."""
    c = m.compute_bytes
    kept = float8_site_bytes(linears, width, site, float8) if compiled else None
    if kept is not None:
        return kept, 0
    lora = [lf for lf in linears if lf.lora_rank]
    trained = [lf for lf in linears if lf.trainable]
    per_token = sum(c * lf.lora_rank for lf in lora)  # lora_A's output, for lora_B's gradient
    fixed = sum(c * lf.lora_rank * (lf.in_features + lf.out_features) for lf in lora) if m.autocast else 0
    dropped = [lf for lf in lora if lf.lora_dropout > 0]
    per_token += sum(mask_bytes * width for lf in dropped)
    if m.autocast and not (fused_lora and lora):
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


def layer_bytes(
    layer: LayerFacts,
    m: ModelFacts,
    *,
    compiled: bool,
    attention: str,
    device: str,
    tiled: bool = False,
    float8: tuple[str, str] | None = None,
    fused_lora: bool = False,
) -> LayerBytes:
    """Bytes autograd keeps for one decoder layer without checkpointing (see the module doc).

    ``tiled``: the MLP is tiled (:mod:`hone.transforms.tiled_mlp`) and keeps only its input; what
    it holds while one shard is differentiated is :func:`~hone.transforms.memory.terms.tiled_mlp.tiled_mlp_transient`.
    ``float8``: a full fine-tune in torchao's float8 training (:func:`~hone.transforms.memory.terms.fp8.float8_site_bytes`).
    ``fused_lora``: LoRA layers run hone's fused layer (:func:`_site_bytes`)."""
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
        t, f = _site_bytes(group, group[0].in_features, site, m, compiled, mask_bytes, float8, fused_lora)
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


def mlp_bytes_per_token(layer: LayerFacts, m: ModelFacts, *, compiled: bool, attention: str, device: str) -> int:
    """Bytes per token the untiled MLP keeps for its backward beyond what the tiled one keeps
    (its ``[tokens x intermediate]`` activations, LoRA intermediates, routed tokens)."""
    untiled = layer_bytes(layer, m, compiled=compiled, attention=attention, device=device)
    tiled = layer_bytes(layer, m, compiled=compiled, attention=attention, device=device, tiled=True)
    return untiled.per_token - tiled.per_token


def selective_bytes(layer: LayerFacts, m: ModelFacts, tiled: bool = False) -> LayerBytes:
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


T = TypeVar("T")


def per_layer(m: ModelFacts, value: Callable[[LayerFacts], T]) -> list[T]:
    """``value`` of every layer of ``m``, in order, computed once for each distinct layer."""
    values = {layer: value(layer) for layer in m.distinct_layers}
    return [values[layer] for layer in m.layers]


def step_layer_bytes(step: Step, layer: LayerFacts, m: ModelFacts) -> LayerBytes:
    """:func:`layer_bytes` of ``layer`` in ``step`` (its compilation, attention, device and MLP tiling)."""
    return layer_bytes(
        layer,
        m,
        compiled=step.compiled,
        attention=step.attention,
        device=step.device,
        tiled=step.tiled,
        float8=step.float8,
        fused_lora=step.fused_lora,
    )


def outside_layers_bytes(m: ModelFacts, tokens: int) -> int:
    """What the step keeps outside the decoder layers for the backward: the final norm's float32
    copy and inverse RMS, the RoPE cos/sin tables every layer reads, and the final norm's input
    when the norm is trained."""
    c, h = m.compute_bytes, m.hidden
    return tokens * (4 * h + 4) + 2 * c * tokens * m.head_dim + (c * tokens * h if m.final_norm_trainable else 0)
