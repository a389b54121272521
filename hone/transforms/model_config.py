"""The transformers config of the configured model, read without loading a weight.

What a transform's ``why`` or an ``auto`` decision needs to know about the model before it
loads (logit soft-capping, sliding windows, router logits) is in this config: built from the
preset (tiny presets take the tokenizer's vocabulary, as the loader does) or read from the
directory's ``config.json``.
"""

from typing import Any

from hone.config.model import ModelConfig
from hone.models.hub import local_model_dir
from hone.models.model_dir import read_causal_lm_config
from hone.models.presets import build_preset_config, get_preset
from hone.models.tokenizer import load_tokenizer


def transformers_config(model: ModelConfig) -> Any:
    """The transformers config of ``model`` as the loader builds it. No weight file is opened."""
    if model.preset is not None:
        vocab = len(load_tokenizer(model)) if get_preset(model.preset).tiny else None
        return build_preset_config(model.preset, dict(model.preset_overrides), vocab)
    return read_causal_lm_config(local_model_dir(model.path), model.trust_remote_code)
