"""The model as the estimate sees it, read once from a ``meta``-device build (shapes, no storage).

**Parameters** are counted exactly: the model is built on the ``meta`` device from the preset or
the model directory's ``config.json``, and the adapter is applied to it there, so frozen/trainable
numbers are those of the run. Their dtypes follow :func:`hone.models.precision.precision_for`.
"""

from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Any

from hone.config.root import HoneConfig
from hone.models.model_dir import attention_head_dim
from hone.models.structure import decoder_layers

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
    experts_layout_problems: tuple[str, ...] = ()
    """Why hone's experts kernels cannot run this model's experts modules, one line per module
    class (empty: they can, or the model has none); ``experts_implementation: auto`` reads it."""
    mxfp4_checkpoint: bool = False
    """The model directory ships its experts in MXFP4 (``quantization_config.quant_method: mxfp4``)."""
    expert_params: int = 0
    """Parameters of the routed experts (their 3-D weights and biases, and the LoRA factors on
    them): what expert parallelism divides over its ranks."""
    expert_trainable_params: int = 0
    """The trainable part of :attr:`expert_params` (LoRA factors, or every expert weight in a full fine-tune)."""
    expert_bytes: int = 0
    """Bytes of :attr:`expert_params` as stored (frozen in ``model.dtype`` or MXFP4, trainable in the trainable dtype)."""
    expert_trainable_bytes: int = 0
    mxfp4_weights: int = 0
    """Expert weights held in MXFP4 (an MXFP4 checkpoint, or ``model.quantize: mxfp4``), counted at
    :data:`~hone.models.experts.mxfp4.MXFP4_BYTES_PER_WEIGHT` instead of ``model.dtype``'s bytes."""

    @cached_property
    def distinct_layers(self) -> tuple[LayerFacts, ...]:
        """The layers without repeats, in order (most models repeat one layer throughout): a term
        that is equal for equal layers is computed once for each. The longest-sequence searches
        estimate thousands of steps; computing every layer's bytes anew was most of `hone plan`."""
        return tuple(dict.fromkeys(self.layers))


def _elem_bytes(dtype: Any) -> int:
    return dtype.itemsize


def transformers_config(model: Any) -> Any:
    """The transformers config of ``model`` (a ModelConfig) as the loader builds it: preset
    (tiny ones take the tokenizer's vocabulary) or the directory's config.json. No weight file
    is opened."""
    from hone.models.rope_scaling import with_rope_scaling

    if model.preset is not None:
        from hone.models.presets import build_preset_config, get_preset

        vocab = None
        if get_preset(model.preset).tiny:
            from hone.models.tokenizer import load_tokenizer

            vocab = len(load_tokenizer(model))
        return with_rope_scaling(build_preset_config(model.preset, dict(model.preset_overrides), vocab), model.rope_scaling)
    from hone.models.hub import local_model_dir
    from hone.models.model_dir import read_causal_lm_config

    return with_rope_scaling(read_causal_lm_config(local_model_dir(model.path), model.trust_remote_code), model.rope_scaling)


def _layer_facts(layer: Any) -> LayerFacts:
    from peft.tuners.lora import LoraLayer, ParamWrapper
    from torch import nn

    linears: list[LinearFacts] = []
    inside_lora: set[int] = set()
    for name, module in layer.named_modules():
        # LoRA on the experts' 3-D parameters (ParamWrapper) is no linear layer: its factors are
        # nn.Linear modules that never run on the tokens (the grouped kernels read their weights;
        # the rank-r intermediates they keep are small beside the experts' rows, which the MoE
        # terms account for), so neither they nor their factors are listed as linears.
        if isinstance(module, ParamWrapper):
            inside_lora.update(id(m) for factors in (module.lora_A, module.lora_B) for m in factors.modules())
            continue
        if isinstance(module, LoraLayer):
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
            site = _SITES.get(short, name)
            linears.append(LinearFacts(short, site, module.in_features, module.out_features, module.weight.requires_grad))
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


def mxfp4_experts(cfg: HoneConfig) -> str | None:
    """Why the run holds its experts in MXFP4, in words (None: it does not): an MXFP4 checkpoint
    or ``model.quantize: mxfp4``."""
    from hone.models.model_dir import ships_mxfp4

    if ships_mxfp4(cfg.model):
        return f"{cfg.model.path} ships its experts in MXFP4 (quantization_config.quant_method: mxfp4)"
    if cfg.model.quantize == "mxfp4":
        return "model.quantize: mxfp4"
    return None


def _mxfp4_weights(base: Any) -> int:
    """Weights the experts modules of ``base`` hold in their projections (what MXFP4 stores)."""
    from hone.models.experts.backend import experts_modules
    from hone.models.experts.mxfp4 import EXPERT_PROJECTIONS

    return sum(getattr(module, name).numel() for _, module in experts_modules(base) for name in EXPERT_PROJECTIONS)


def _nf4_weights(base: Any) -> int:
    """Weights the quantize transform stores in NF4 (every linear layer but the head that fits its blocks)."""
    from hone.models.nf4 import can_quantize, quantizable_linears

    return sum(linear.weight.numel() for _, _, linear, _ in quantizable_linears(base) if can_quantize(linear))


def _expert_parameter_ids(model: Any) -> set[int]:
    """The parameters expert parallelism splits: every experts module's own (3-D weights, biases)
    and the LoRA factors of the PEFT wrappers around one."""
    from peft.tuners.lora import ParamWrapper

    from hone.models.experts.backend import experts_modules

    ids = {id(p) for _, module in experts_modules(model) for p in module.parameters()}
    for module in model.modules():
        if isinstance(module, ParamWrapper):
            ids.update(id(p) for factors in (module.lora_A, module.lora_B) for p in factors.parameters())
    return ids


def _expert_facts(model: Any, frozen_bytes: int, trainable_bytes: int, mxfp4: int = 0) -> dict[str, int]:
    """:class:`ModelFacts`' expert fields: the parameters expert parallelism splits, and their bytes
    (the ``mxfp4`` expert weights held in MXFP4, frozen, at its bytes a weight: each rank's share
    of them is a block of the blocks and scales)."""
    from hone.models.experts.mxfp4 import MXFP4_BYTES_PER_WEIGHT

    in_experts = _expert_parameter_ids(model)
    frozen = trainable = 0
    for _, param in model.named_parameters():  # tied weights are listed once
        if id(param) in in_experts:
            trainable += param.numel() if param.requires_grad else 0
            frozen += 0 if param.requires_grad else param.numel()
    return dict(
        expert_params=frozen + trainable,
        expert_trainable_params=trainable,
        expert_bytes=(frozen - mxfp4) * frozen_bytes + round(mxfp4 * MXFP4_BYTES_PER_WEIGHT) + trainable * trainable_bytes,
        expert_trainable_bytes=trainable * trainable_bytes,
    )


def _experts_layout_problems(base: Any) -> tuple[str, ...]:
    from hone.models.experts.backend import experts_modules, layout_problem

    problems = {}
    for _, module in experts_modules(base):
        problem = layout_problem(module)
        if problem:
            problems.setdefault(type(module).__name__, f"{type(module).__name__}: {problem}")
    return tuple(problems.values())


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
    from hone.models.experts.mxfp4 import MXFP4_BYTES_PER_WEIGHT, is_mxfp4_config

    config = transformers_config(model_cfg)
    precision = precision_for(model_cfg.dtype, full_finetune=not adapter_cfg.is_lora)
    checkpoint = is_mxfp4_config(config)
    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(config)
        mxfp4 = _mxfp4_weights(base) if checkpoint or model_cfg.quantize == "mxfp4" else 0
        quantized = _nf4_weights(base) if model_cfg.quantize == "nf4" and not checkpoint else 0
        model = apply_adapter(base, adapter_cfg)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layer_list = decoder_layers(model)  # the decoder layers as every transform finds them
    if not layer_list:
        raise ValueError(
            f"cannot find the decoder layers of {type(base).__name__} (no module of a class in its _no_split_modules)"
        )
    in_layers = {id(p) for layer in layer_list for p in layer.parameters()}
    frozen = trainable = outside_trainable = 0
    lora_base: list[tuple[int, int]] = []
    layer_linears: list[tuple[int, int]] = []
    for name, param in model.named_parameters():  # tied weights are listed once
        if not param.requires_grad and param.ndim == 2 and id(param) in in_layers:
            shape = (param.shape[1], param.shape[0])
            layer_linears.append(shape)
            if name.endswith("base_layer.weight"):
                lora_base.append(shape)
        if param.requires_grad:
            trainable += param.numel()
            if id(param) not in in_layers:
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
        head_dim=attention_head_dim(text),
        intermediate=getattr(text, "intermediate_size", 0) or 0,
        vocab=text.vocab_size,
        max_positions=getattr(text, "max_position_embeddings", None),
        experts=getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None) or 0,
        top_k=getattr(text, "num_experts_per_tok", 0) or 0,
        expert_intermediate=getattr(text, "moe_intermediate_size", 0) or 0,
        layers=tuple(_layer_facts(layer) for layer in layer_list),
        frozen_params=frozen,
        trainable_params=trainable,
        frozen_bytes=(frozen - quantized - mxfp4) * _elem_bytes(precision.weights)
        + round(quantized * NF4_BYTES_PER_WEIGHT + mxfp4 * MXFP4_BYTES_PER_WEIGHT),
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
        experts_layout_problems=_experts_layout_problems(base),
        mxfp4_checkpoint=checkpoint,
        mxfp4_weights=mxfp4,
        **_expert_facts(model, _elem_bytes(precision.weights), tbytes, mxfp4),
    )


def model_facts(cfg: HoneConfig) -> ModelFacts:
    """Parameter counts and layer structure of ``cfg``'s model with its adapter (meta device,
    cached per model/adapter config: the bisection in :func:`~hone.transforms.memory.longest.longest_sequence` reuses it)."""
    return _facts_cached(cfg.model.model_dump_json(), cfg.adapter.model_dump_json())
