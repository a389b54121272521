"""Architecture presets: transformers configs that hone builds with random weights.

``tiny-*`` presets exist so a laptop CPU trains a real architecture (attention, RoPE, norms,
gating, experts) in seconds: a quickstart and tests need no download. Their vocabulary is the
tokenizer's, whatever its size. The others copy the published shapes of real models so
``hone bench`` measures the speed and memory of the real thing without fetching weights; they
keep the published vocabulary (the tokenizer only has to fit inside it). Special-token ids
(bos, eos, pad) belong to the tokenizer, not to the architecture: the loader sets them from
the tokenizer in use.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, get_args

from hone.config.model import PresetName
from hone.models.errors import ModelError
from hone.models.preset_fields import CONFIG_FIELDS

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

#: Shape shared by the tiny dense presets: 2 layers, grouped-query attention (4 query heads,
#: 2 key/value heads of 16 dims), so every code path of the real model runs.
_TINY = dict(
    hidden_size=64,
    intermediate_size=192,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=8192,
    initializer_range=0.02,
)

#: openai/gpt-oss-20b's rope_scaling (YaRN, x32 over the 4096-token original context).
_GPT_OSS_ROPE = dict(
    rope_type="yarn",
    rope_theta=150_000.0,
    factor=32.0,
    beta_fast=32.0,
    beta_slow=1.0,
    truncate=False,
    original_max_position_embeddings=4096,
)

#: What openai/gpt-oss-20b and -120b share (their config.json): hidden 2880, 64 query / 8 key-value
#: heads of 64, sliding window 128 alternating with full attention, YaRN RoPE, experts of 2880, 4 active.
_GPT_OSS_LAYER = dict(
    vocab_size=201_088,
    hidden_size=2880,
    intermediate_size=2880,
    num_experts_per_tok=4,
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=64,
    sliding_window=128,
    max_position_embeddings=131_072,
    rope_parameters=dict(_GPT_OSS_ROPE),
    rms_norm_eps=1e-5,
    attention_bias=True,
    attention_dropout=0.0,
    swiglu_limit=7.0,
    router_aux_loss_coef=0.9,
    tie_word_embeddings=False,
)


@dataclass(frozen=True)
class Preset:
    config_name: str
    """The transformers config class, by name: imported only when a config is built, because
    importing transformers' configs imports torch, which ``hone validate`` does without."""
    values: dict[str, Any]
    tiny: bool
    """Tiny presets take the tokenizer's vocabulary and are initialised on the CPU in float32,
    so the same seed gives the same weights on every machine (generation on a laptop sees
    exactly the base a GPU run trained on). Big presets are drawn on the target device in the
    target dtype, one module at a time from a meta-device skeleton (:mod:`hone.models.materialize`),
    which is what makes a random 8B model (or its 4-bit form) appear in seconds."""

    @property
    def config_class(self) -> type[PreTrainedConfig]:
        import transformers

        return getattr(transformers, self.config_name)


PRESETS: dict[str, Preset] = {
    "tiny-llama": Preset(
        "LlamaConfig",
        dict(_TINY, rms_norm_eps=1e-5, rope_theta=500_000.0, tie_word_embeddings=False),
        tiny=True,
    ),
    "tiny-qwen3": Preset(
        "Qwen3Config",
        # Small Qwen3 models tie the output head to the embedding; keep that so the tied path
        # (and its handling in adapters and saving) is exercised.
        dict(_TINY, rms_norm_eps=1e-6, rope_theta=1_000_000.0, tie_word_embeddings=True),
        tiny=True,
    ),
    "tiny-mistral": Preset(
        "MistralConfig",
        dict(_TINY, rms_norm_eps=1e-5, rope_theta=1_000_000.0, sliding_window=None, tie_word_embeddings=False),
        tiny=True,
    ),
    "tiny-gemma": Preset(
        # Gemma 3 text: tied head, embeddings scaled by sqrt(hidden), (1 + w) RMSNorm, GELU-tanh
        # gating, q/k norms, and alternating sliding-window / global attention layers.
        "Gemma3TextConfig",
        dict(
            _TINY,
            query_pre_attn_scalar=16,
            sliding_window=512,
            layer_types=["sliding_attention", "full_attention"],
            tie_word_embeddings=True,
        ),
        tiny=True,
    ),
    "tiny-qwen3-moe": Preset(
        "Qwen3MoeConfig",
        dict(
            _TINY,
            intermediate_size=128,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            rms_norm_eps=1e-6,
            rope_theta=1_000_000.0,
            tie_word_embeddings=False,
        ),
        tiny=True,
    ),
    "tiny-gpt-oss": Preset(
        # gpt_oss at toy size: attention sinks, alternating sliding-window / full layers (a
        # window shorter than the sample rows, so it masks), YaRN RoPE, biased attention, and
        # experts in its own layout (transposed [E, in, out], interleaved gate/up, per-expert
        # biases, clamped SwiGLU).
        "GptOssConfig",
        dict(
            _TINY,
            intermediate_size=32,
            num_local_experts=8,
            num_experts_per_tok=2,
            max_position_embeddings=131_072,  # YaRN's x32 over 4096, as in the real config
            sliding_window=16,  # layer_types: GptOssConfig alternates sliding / full by itself
            rope_parameters=dict(_GPT_OSS_ROPE),
            rms_norm_eps=1e-5,
            attention_bias=True,
            swiglu_limit=7.0,
            router_aux_loss_coef=0.9,
            tie_word_embeddings=False,
        ),
        tiny=True,
    ),
    # meta-llama/Meta-Llama-3-8B config.json
    "llama3-8b": Preset(
        "LlamaConfig",
        dict(
            vocab_size=128_256,
            hidden_size=4096,
            intermediate_size=14_336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            hidden_act="silu",
            max_position_embeddings=8192,
            rms_norm_eps=1e-5,
            rope_theta=500_000.0,
            tie_word_embeddings=False,
            attention_bias=False,
            mlp_bias=False,
        ),
        tiny=False,
    ),
    # meta-llama/Llama-3.2-3B config.json, without its llama3 RoPE scaling (long-context
    # frequencies; no change to the compute): the ~3B full fine-tune of the FP8 bench
    "llama3.2-3b": Preset(
        "LlamaConfig",
        dict(
            vocab_size=128_256,
            hidden_size=3072,
            intermediate_size=8192,
            num_hidden_layers=28,
            num_attention_heads=24,
            num_key_value_heads=8,
            head_dim=128,
            hidden_act="silu",
            max_position_embeddings=8192,
            rms_norm_eps=1e-5,
            rope_theta=500_000.0,
            tie_word_embeddings=True,
            attention_bias=False,
            mlp_bias=False,
        ),
        tiny=False,
    ),
    # Qwen/Qwen3-8B config.json
    "qwen3-8b": Preset(
        "Qwen3Config",
        dict(
            vocab_size=151_936,
            hidden_size=4096,
            intermediate_size=12_288,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            hidden_act="silu",
            max_position_embeddings=40_960,
            rms_norm_eps=1e-6,
            rope_theta=1_000_000.0,
            tie_word_embeddings=False,
            attention_bias=False,
        ),
        tiny=False,
    ),
    # Qwen/Qwen3-30B-A3B config.json: 128 experts, 8 active, 48 layers, all sparse.
    "qwen3-30b-a3b": Preset(
        "Qwen3MoeConfig",
        dict(
            vocab_size=151_936,
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_experts=128,
            num_experts_per_tok=8,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            num_hidden_layers=48,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            hidden_act="silu",
            max_position_embeddings=40_960,
            rms_norm_eps=1e-6,
            rope_theta=1_000_000.0,
            router_aux_loss_coef=0.001,
            tie_word_embeddings=False,
            attention_bias=False,
        ),
        tiny=False,
    ),
    # openai/gpt-oss-20b config.json: 24 layers alternating (GptOssConfig's own layer_types) sliding-window (128) and full
    # attention, attention sinks, 32 experts of 2880, 4 active, YaRN RoPE (x32 over 4096).
    "gpt-oss-20b": Preset("GptOssConfig", dict(_GPT_OSS_LAYER, num_hidden_layers=24, num_local_experts=32), tiny=False),
    # openai/gpt-oss-120b config.json: gpt-oss-20b's layer, 36 layers, 128 experts of 2880, 4 active.
    "gpt-oss-120b": Preset("GptOssConfig", dict(_GPT_OSS_LAYER, num_hidden_layers=36, num_local_experts=128), tiny=False),
}

PRESET_NAMES: tuple[str, ...] = get_args(PresetName)


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ModelError(f"model.preset: '{name}' is not one of: {', '.join(PRESET_NAMES)}") from None


def overridable_keys(config_class: type[PreTrainedConfig] | str) -> list[str]:
    """Architecture fields of ``config_class``: its own dataclass fields (not the generic ones
    every config has, such as ``dtype`` or ``id2label``), their aliases, and ``rope_theta``,
    which every preset's config accepts and folds into ``rope_parameters``. By class name: the
    written-out list of :mod:`hone.models.preset_fields` (no transformers import)."""
    if isinstance(config_class, str):
        own = CONFIG_FIELDS[config_class]
    else:
        from hone.models.preset_fields import config_fields

        own = config_fields(config_class)
    return sorted(own | {"rope_theta"})


def _check_keys(name: str, preset: Preset, overrides: dict[str, Any], valid: list[str]) -> None:
    unknown = sorted(set(overrides) - set(valid))
    if unknown:
        raise ModelError(
            f"model.preset_overrides: {', '.join(repr(k) for k in unknown)} "
            f"{'is not a field' if len(unknown) == 1 else 'are not fields'} of "
            f"{preset.config_name} (preset '{name}'); valid keys: {', '.join(valid)}"
        )


def _preset_values(preset: Preset, overrides: dict[str, Any], vocab_size: int | None) -> dict[str, Any]:
    values = copy.deepcopy(dict(preset.values))  # nested dicts (rope_parameters) are shared by presets
    if preset.tiny and vocab_size is not None:
        values["vocab_size"] = vocab_size
    values.update(overrides)
    if "rope_theta" in overrides:
        values.pop("rope_parameters", None)
    return values


def preset_values(name: PresetName, overrides: dict[str, Any]) -> dict[str, Any]:
    """The preset's config values with ``overrides`` applied, checked without transformers:
    the override names, whole-number sizes, and the shape rules of :func:`build_preset_config`.
    What ``hone validate`` uses (it never imports torch); the values' full check by the config
    class happens when the config is built (``hone train``, ``plan``)."""
    preset = get_preset(name)
    _check_keys(name, preset, overrides, overridable_keys(preset.config_name))
    for key, value in sorted(overrides.items()):
        default = preset.values.get(key)
        if isinstance(default, int) and not isinstance(default, bool) and (isinstance(value, bool) or not isinstance(value, int)):
            raise ModelError(
                f"model.preset_overrides: {key}: expected int (a whole number), got {value!r} "
                f"({type(value).__name__}) (preset '{name}')"
            )
    values = _preset_values(preset, overrides, None)
    _check_shape(values.get, name, overrides)
    return values


def build_preset_config(name: PresetName, overrides: dict[str, Any], vocab_size: int | None) -> PreTrainedConfig:
    """The transformers config of preset ``name`` with ``overrides`` applied.

    ``vocab_size`` is the tokenizer's size: a tiny preset takes it as its vocabulary; a real
    architecture keeps its published vocabulary, which must hold every token id.
    """
    from huggingface_hub.errors import StrictDataclassError

    preset = get_preset(name)
    _check_keys(name, preset, overrides, overridable_keys(preset.config_class))
    values = _preset_values(preset, overrides, vocab_size)
    try:
        config = preset.config_class(**values)
    except (TypeError, ValueError, StrictDataclassError) as exc:
        shown = {k: overrides[k] for k in sorted(overrides)}
        raise ModelError(
            f"model.preset_overrides: {shown} do not give a valid {preset.config_name} for preset '{name}': {_first_line(exc)}"
        ) from None
    _check_shape(lambda key: getattr(config, key, None), name, overrides)
    if vocab_size is not None and config.vocab_size < vocab_size:
        where = "model.preset_overrides.vocab_size" if "vocab_size" in overrides else f"model.preset '{name}'"
        raise ModelError(
            f"{where}: the vocabulary has {config.vocab_size} entries but the tokenizer has "
            f"{vocab_size} tokens; the model must have at least as many embedding rows as tokens"
        )
    return config


def _check_shape(get: Callable[[str], Any], name: str, overrides: dict[str, Any]) -> None:
    """Shape rules transformers' configs accept but whose models then fail deep in a forward.
    ``get``: a value of the config by name (an attribute of a built config, or a key of its values)."""
    heads, kv_heads = get("num_attention_heads"), get("num_key_value_heads")
    problem = None
    if isinstance(heads, int) and isinstance(kv_heads, int) and (kv_heads < 1 or heads % kv_heads):
        problem = f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})"
    experts = get("num_experts") if get("num_experts") is not None else get("num_local_experts")
    top_k = get("num_experts_per_tok")
    if isinstance(experts, int) and isinstance(top_k, int) and not 1 <= top_k <= experts:
        problem = f"num_experts_per_tok ({top_k}) must be between 1 and num_experts ({experts})"
    if problem:
        raise ModelError(f"model.preset_overrides: {problem} (preset '{name}', overrides {dict(sorted(overrides.items()))})")


def _first_line(exc: Exception) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return " ".join(lines[:2]) if lines else type(exc).__name__
