"""The architecture fields of the transformers configs the presets use, written out.

Importing a transformers config class imports torch (seconds), and ``hone validate`` checks a
preset's overrides without either: it reads these names. They are the class's own dataclass
fields less the generic ones every config has, plus its ``attribute_map`` aliases, as the
installed transformers defines them; tests/unit/test_models_presets.py compares them with the
classes, so a transformers upgrade that changes a field fails there, not in a user's run.
Building a config (``hone train``, ``plan``) checks against the class itself.
"""

from __future__ import annotations

from dataclasses import fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedConfig


def _names(text: str) -> frozenset[str]:
    return frozenset(text.split())


CONFIG_FIELDS: dict[str, frozenset[str]] = {
    "LlamaConfig": _names(
        "attention_bias attention_dropout bos_token_id eos_token_id head_dim hidden_act hidden_size "
        "initializer_range intermediate_size max_position_embeddings mlp_bias num_attention_heads "
        "num_hidden_layers num_key_value_heads pad_token_id pretraining_tp rms_norm_eps rope_parameters "
        "tie_word_embeddings use_cache vocab_size"
    ),
    "Qwen3Config": _names(
        "attention_bias attention_dropout bos_token_id eos_token_id head_dim hidden_act hidden_size "
        "initializer_range intermediate_size layer_types max_position_embeddings max_window_layers "
        "num_attention_heads num_hidden_layers num_key_value_heads pad_token_id rms_norm_eps rope_parameters "
        "sliding_window tie_word_embeddings use_cache use_sliding_window vocab_size"
    ),
    "MistralConfig": _names(
        "attention_dropout bos_token_id eos_token_id head_dim hidden_act hidden_size initializer_range "
        "intermediate_size max_position_embeddings num_attention_heads num_hidden_layers num_key_value_heads "
        "pad_token_id rms_norm_eps rope_parameters sliding_window tie_word_embeddings use_cache vocab_size"
    ),
    "Gemma3TextConfig": _names(
        "attention_bias attention_dropout attn_logit_softcapping bos_token_id eos_token_id "
        "final_logit_softcapping head_dim hidden_activation hidden_size initializer_range intermediate_size "
        "layer_types max_position_embeddings num_attention_heads num_hidden_layers num_key_value_heads "
        "pad_token_id query_pre_attn_scalar rms_norm_eps rope_parameters sliding_window tie_word_embeddings "
        "use_bidirectional_attention use_cache vocab_size"
    ),
    "Qwen3MoeConfig": _names(
        "attention_bias attention_dropout bos_token_id decoder_sparse_step eos_token_id hidden_act "
        "hidden_size initializer_range intermediate_size max_position_embeddings mlp_only_layers "
        "moe_intermediate_size norm_topk_prob num_attention_heads num_experts num_experts_per_tok "
        "num_hidden_layers num_key_value_heads output_router_logits pad_token_id rms_norm_eps rope_parameters "
        "router_aux_loss_coef sliding_window tie_word_embeddings use_cache use_sliding_window vocab_size"
    ),
    "GptOssConfig": _names(
        "attention_bias attention_dropout bos_token_id eos_token_id head_dim hidden_act hidden_size "
        "initializer_range intermediate_size layer_types max_position_embeddings num_attention_heads "
        "num_experts num_experts_per_tok num_hidden_layers num_key_value_heads num_local_experts "
        "output_router_logits pad_token_id rms_norm_eps rope_parameters router_aux_loss_coef sliding_window "
        "swiglu_alpha swiglu_limit tie_word_embeddings use_cache vocab_size"
    ),
}


def config_fields(config_class: type[PreTrainedConfig]) -> frozenset[str]:
    """What :data:`CONFIG_FIELDS` holds for ``config_class``, computed from the class."""
    from transformers import PreTrainedConfig

    generic = {f.name for f in fields(PreTrainedConfig)}
    return frozenset(({f.name for f in fields(config_class)} - generic) | set(config_class.attribute_map))
