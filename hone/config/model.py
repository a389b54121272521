"""Which model to fine-tune and how to load it."""

import importlib.util
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from hone.config.attention import BACKENDS, AttentionBackend
from hone.config.base import Section

#: Architecture presets built with random weights (``hone.models.presets`` builds them).
#: ``tiny-*`` run on a laptop CPU; the others match real architectures for benchmarking.
PresetName = Literal[
    "tiny-llama",
    "tiny-qwen3",
    "tiny-mistral",
    "tiny-gemma",
    "tiny-qwen3-moe",
    "tiny-gpt-oss",
    "llama3-8b",
    "llama3.2-3b",
    "qwen3-8b",
    "qwen3-30b-a3b",
    "gpt-oss-20b",
    "gpt-oss-120b",
]
#: The presets with mixture-of-experts layers (``model.quantize: mxfp4`` stores their experts);
#: tests/unit/test_models_presets.py checks it against the presets' configs.
MOE_PRESETS = frozenset({"tiny-qwen3-moe", "tiny-gpt-oss", "qwen3-30b-a3b", "gpt-oss-20b", "gpt-oss-120b"})
#: How a preset's random weights are drawn (``hone.models.preset_init`` says why there is a choice).
PresetInit = Literal["transformers", "sharp_attention"]

Dtype = Literal["float32", "bfloat16", "float16"]
AttnImplementation = Literal["eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3"]
ExpertsImplementation = Literal["auto", "grouped_mm", "eager", "hone"]
Quantize = Literal["none", "nf4", "mxfp4"]
#: RoPE scalings that stretch a fixed pretraining length (transformers' ``dynamic`` NTK is left out:
#: it takes ``max_position_embeddings`` as the pretraining length, which this key raises).
RopeType = Literal["yarn", "llama3", "linear"]

#: Fields of ``model.rope_scaling`` that only some RoPE types read.
_ROPE_TYPE_FIELDS = {
    "beta_fast": ("yarn",),
    "beta_slow": ("yarn",),
    "attention_factor": ("yarn",),
    "low_freq_factor": ("llama3",),
    "high_freq_factor": ("llama3",),
}


class RopeScaling(Section):
    """RoPE scaling set on the model's transformers config before the model is built, for a
    model directory, a hub id or a preset alike (it replaces any scaling the config has). It
    stretches the positions the model was trained on (``original_max_position_embeddings``)
    by ``factor``, and raises ``max_position_embeddings`` to match, which is the length
    ``data.sequence_len`` is checked against. Qwen3 documents YaRN with factor 4 over 32,768
    positions (131,072 tokens)."""

    type: RopeType
    """``yarn`` (Qwen3, gpt-oss, DeepSeek), ``llama3`` (Llama 3.1+) or ``linear`` (position
    interpolation)."""

    factor: float = Field(gt=1.0)
    """How many times the original positions are stretched (greater than 1)."""

    original_max_position_embeddings: int | None = Field(None, ge=1)
    """The positions the model was pretrained on; default: the config's own
    ``original_max_position_embeddings`` if it already scales RoPE, else its
    ``max_position_embeddings``."""

    max_position_embeddings: int | None = Field(None, ge=1)
    """The positions of the scaled model; default: ``original_max_position_embeddings x factor``."""

    beta_fast: float | None = None
    """yarn only: the fast boundary of the interpolation ramp (transformers' default 32)."""

    beta_slow: float | None = None
    """yarn only: the slow boundary of the interpolation ramp (transformers' default 1)."""

    attention_factor: float | None = Field(None, gt=0.0)
    """yarn only: the scale of the attention logits; default derived from ``factor``."""

    low_freq_factor: float | None = None
    """llama3 only (default 1.0, Llama 3.1's)."""

    high_freq_factor: float | None = None
    """llama3 only (default 4.0, Llama 3.1's); greater than ``low_freq_factor``."""

    @model_validator(mode="after")
    def _fields_fit_the_type(self) -> "RopeScaling":
        for name, types in _ROPE_TYPE_FIELDS.items():
            if getattr(self, name) is not None and self.type not in types:
                raise ValueError(
                    f"model.rope_scaling.{name} applies to type: {' / '.join(types)}, but type is "
                    f"'{self.type}': remove {name}, or set type: {types[0]}"
                )
        if (self.beta_fast if self.beta_fast is not None else 32.0) <= (self.beta_slow if self.beta_slow is not None else 1.0):
            raise ValueError(
                f"model.rope_scaling: beta_fast ({self.beta_fast}) must be greater than beta_slow ({self.beta_slow}) "
                "(defaults 32 and 1)"
            )
        low = self.low_freq_factor if self.low_freq_factor is not None else 1.0
        high = self.high_freq_factor if self.high_freq_factor is not None else 4.0
        if self.type == "llama3" and high <= low:
            raise ValueError(
                f"model.rope_scaling: high_freq_factor ({high}) must be greater than low_freq_factor ({low}) (defaults 4 and 1)"
            )
        return self


class ModelConfig(Section):
    """Which model to fine-tune and how its weights are loaded."""

    path: Path | None = None
    """Local Hugging Face model directory (``save_pretrained`` layout, safetensors weights), or a
    model id ``Org/Name`` / ``Org/Name@revision`` found in the local Hugging Face cache
    (``HF_HUB_CACHE`` / ``HF_HOME`` honoured; a local directory of that name wins)."""

    preset: PresetName | None = None
    """Random-initialised architecture preset instead of ``path`` (quickstart, benchmarks)."""

    preset_overrides: dict[str, int | float | bool | str] = Field(default_factory=dict)
    """Fields of the preset's transformers config to override, e.g. ``num_hidden_layers: 8``."""

    preset_init: PresetInit = "transformers"
    """How the preset's random weights are drawn. ``transformers``: the model's own init. On it a
    MoE router sends nearly every token to the same few experts (flat attention makes all
    tokens' hidden states alike after a layer or two), which no trained router does and which
    expert parallelism pays for. ``sharp_attention``: the same draws with every attention's logits
    multiplied by 16, so tokens stay distinct and the router spreads them roughly as a trained
    one does; for benchmarks of expert parallelism (docs/distributed.md). Same architecture and
    cost per token either way."""

    rope_scaling: RopeScaling | None = None
    """RoPE scaling applied to the model's config before it is built (a directory, hub id or
    preset), e.g. ``{type: yarn, factor: 4.0, original_max_position_embeddings: 32768}`` for
    Qwen3 at 131,072 tokens; raises ``max_position_embeddings`` so a longer
    ``data.sequence_len`` validates. Replaces any scaling the model's config sets. See
    docs/long-context.md."""

    tokenizer_path: Path | None = None
    """Tokenizer directory or cached model id; defaults to ``path`` (or the bundled tiny
    tokenizer for presets)."""

    allow_download: bool = False
    """Let ``hone train`` download a model id of ``path`` / ``tokenizer_path`` that is not in
    the local hub cache (safetensors, config and tokenizer files only). Off: hone never
    touches the network, and a missing id is an error that says how to fetch it."""

    dtype: Dtype = "bfloat16"
    """Dtype of the weights and of compute. LoRA adapters (and ``lora_modules_to_save``) are kept
    in float32 under autocast; a bfloat16 full fine-tune trains in pure bfloat16; a float16 full
    fine-tune keeps float32 weights and autocasts to float16 (with loss scaling)."""

    attn_implementation: AttnImplementation = "sdpa"
    """Attention backend (transformers' ``AttentionInterface``): ``eager``, ``sdpa``,
    ``flex_attention`` (skips the blocks between packed documents; trains on CUDA only; compiled
    by Inductor, heads at least 16 wide),
    ``flash_attention_2`` / ``flash_attention_3`` (CUDA, bf16/fp16, need the flash-attn package).
    Every one isolates packed documents; see docs/packing.md. Models with attention sinks
    (gpt_oss) train through hone's flex attention with sinks under ``sdpa`` or ``flex_attention``;
    flash attention, which would drop the sinks, is refused for them (docs/moe.md)."""

    sdpa_varlen: bool | Literal["auto"] = "auto"
    """Packed rows under ``sdpa``: ``auto`` runs them through torch's per-document varlen kernel
    (FlashAttention-2; computes each document's causal triangle only, no mask) where it can run:
    CUDA, bfloat16/float16, a model without sliding-window layers, attention dropout or logit
    soft-capping; elsewhere through hone's block-diagonal mask. Preference pairs sharing their
    prompt take the same kernel (their rejected branch a segment with the prompt's keys gathered
    again) where it runs. ``false``: always the mask (shared prompts: sdpa's tree mask).
    ``true``: the kernel or a clear error before training. Read with ``sample_packing`` and with
    ``training.preference.share_prompt``."""

    experts_implementation: ExpertsImplementation = "auto"
    """How mixture-of-experts layers compute their experts (transformers' experts interface):
    ``hone`` (hone's Triton grouped GEMMs with LoRA on the experts fused in, no host syncs; CUDA,
    needs triton), ``grouped_mm`` (transformers' default: one grouped matmul per projection) or
    ``eager`` (a loop over experts). ``auto``: ``hone`` where its kernels run (training on CUDA,
    experts of a layout they know: gated SiLU or gpt_oss' clamped SwiGLU, no post-expert norm),
    ``grouped_mm`` elsewhere (``hone plan`` prints the choice and why). LoRA on the experts
    (``adapter.lora_target_modules`` naming ``experts``, ``gate_up_proj`` or ``down_proj``) runs
    inside hone's kernels only under ``hone``; see docs/moe.md. Read only for MoE models."""

    quantize: Quantize = "none"
    """Store the frozen base model in 4 bits for LoRA (QLoRA). ``nf4`` keeps each linear layer
    but the output head as NormalFloat-4 codes in blocks of 64 weights with double-quantized
    scales (torchao's NF4 layout; about 0.52 bytes a weight) and computes in ``model.dtype``
    (bf16), dequantizing one layer at a time in hone's kernel; it needs the optional ``quant``
    extra (``pip install 'hone[quant]'``). ``mxfp4`` (mixture-of-experts bases only: qwen3-moe,
    gpt-oss in bf16, mixtral) stores the experts of every MoE layer in MXFP4 (4-bit E2M1 codes
    with one power-of-two scale per 32 weights, 0.53 bytes a weight, the format gpt-oss ships);
    the attention and dense layers stay in ``model.dtype``; the experts run in hone's kernels
    (``model.experts_implementation``: auto or hone; their float32 reference off CUDA). A
    checkpoint that ships MXFP4 experts (gpt-oss) is MXFP4 whatever this key says (``none`` or
    ``mxfp4``). The base is quantized layer by layer as it is loaded, so the full-precision
    model never sits on the GPU. Both need ``adapter.type: lora``; not with
    ``distributed.strategy: fsdp`` nor ``performance.fp8``. Adapters save as usual PEFT
    adapters; ``hone merge`` merges into the dequantized base. See docs/quantization.md and
    docs/moe.md."""

    trust_remote_code: bool = False
    """Allow Python code shipped inside the model directory to run. Off unless you trust it."""

    @model_validator(mode="after")
    def _exactly_one_source(self) -> "ModelConfig":
        if (self.path is None) == (self.preset is None):
            raise ValueError(
                "set exactly one of model.path (a local model directory) or model.preset "
                "(a random-init architecture such as tiny-llama)"
            )
        if self.allow_download and self.path is None and self.tokenizer_path is None:
            raise ValueError(
                "model.allow_download applies to a model id in model.path or model.tokenizer_path; remove it for presets"
            )
        if self.preset_overrides and self.preset is None:
            raise ValueError("model.preset_overrides only applies together with model.preset")
        if self.preset_init != "transformers" and self.preset is None:
            raise ValueError(
                f"model.preset_init: {self.preset_init} only applies together with model.preset "
                "(a checkpoint's weights are read, not drawn); remove it"
            )
        backend = self.attention
        if not backend.installed:
            usable = ", ".join(n for n, b in BACKENDS.items() if b.installed)
            raise ValueError(
                f"attn_implementation: '{self.attn_implementation}' needs the Python package "
                f"'{backend.package}', which is not installed: install it, or use one of: {usable}"
            )
        if not backend.supports_float32 and self.dtype == "float32":
            raise ValueError(
                f"attn_implementation: '{self.attn_implementation}' computes in bfloat16/float16 only, "
                "but model.dtype is float32: set model.dtype: bfloat16, or use sdpa or flex_attention"
            )
        if self.quantize == "nf4" and importlib.util.find_spec("torchao") is None:
            raise ValueError(
                "model.quantize: 'nf4' needs the Python package 'torchao', which is not installed: "
                "pip install 'hone[quant]' (or pip install torchao), or set model.quantize: none"
            )
        if self.quantize == "mxfp4" and self.experts_implementation in ("eager", "grouped_mm"):
            raise ValueError(
                f"model.quantize: mxfp4 runs the MXFP4 experts in hone's kernels only (their float32 reference off "
                f"CUDA), but model.experts_implementation is '{self.experts_implementation}': allowed with mxfp4: "
                "auto, hone (or model.quantize: none)"
            )
        if self.quantize == "mxfp4" and self.preset is not None:
            if self.preset not in MOE_PRESETS:
                raise ValueError(
                    f"model.quantize: mxfp4 stores the experts of a mixture-of-experts model, but model.preset "
                    f"'{self.preset}' has no experts: use a MoE preset ("
                    f"{', '.join(sorted(MOE_PRESETS))}), model.quantize: nf4, or none"
                )
        if self.sdpa_varlen is True and self.attn_implementation != "sdpa":
            raise ValueError(
                f"model.sdpa_varlen: true applies to attn_implementation: sdpa, but it is "
                f"'{self.attn_implementation}': remove sdpa_varlen, or use sdpa"
            )
        if self.sdpa_varlen is True and self.dtype == "float32":
            raise ValueError(
                "model.sdpa_varlen: true needs bfloat16/float16 compute (the varlen kernel is "
                "FlashAttention-2), but model.dtype is float32: set model.dtype: bfloat16, or sdpa_varlen: auto"
            )
        return self

    @property
    def attention(self) -> AttentionBackend:
        """The capabilities of ``attn_implementation`` (see :mod:`hone.config.attention`)."""
        return BACKENDS[self.attn_implementation]

    @property
    def attention_isolates_packed_documents(self) -> bool:
        return self.attention.isolates_packed_documents

    @property
    def attention_needs_cuda(self) -> bool:
        return self.attention.needs_cuda

    @property
    def attention_trains_on_cpu(self) -> bool:
        return self.attention.trains_on_cpu

    @property
    def attention_works_under_compile(self) -> bool:
        return self.attention.works_under_compile

    @property
    def attention_supports_sliding_window(self) -> bool:
        return self.attention.sliding_window

    @property
    def source(self) -> str:
        """Human-readable origin of the weights, for logs and run summaries."""
        return f"preset:{self.preset}" if self.preset else str(self.path)
