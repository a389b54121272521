"""``model.rope_scaling``: RoPE scaling set on a transformers config before its model is built.

One function, used wherever hone turns a model source into a config (loading, sharded loading,
``hone validate``'s sequence-length check, ``hone plan``), so every command sees the same
positions. It writes transformers' own fields (``rope_parameters`` and
``max_position_embeddings``) and lets transformers compute the scaled frequencies.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hone.models.errors import ModelError

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

    from hone.config.model import RopeScaling

#: What ``llama3`` scaling reads that hone's config may leave out: Llama 3.1's published values.
_LLAMA3_DEFAULTS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0}
_OPTIONAL = ("beta_fast", "beta_slow", "attention_factor", "low_freq_factor", "high_freq_factor")


def with_rope_scaling(config: PreTrainedConfig | dict[str, Any], scaling: RopeScaling | None) -> Any:
    """``config`` with ``scaling`` set on its text config (in place; returned for chaining).
    A raw ``config.json`` dict (a remote-code model, whose config class validation does not run)
    comes back as a copy with ``rope_scaling`` and ``max_position_embeddings`` set.

    The previous RoPE settings keep their ``rope_theta``; a config with one set of parameters per
    layer type (e.g. Gemma 3's sliding / full attention) gets the scaling on its
    ``full_attention`` layers only, as Gemma 3's own long-context configs do."""
    if scaling is None:
        return config
    if isinstance(config, dict):
        return _raw_with_scaling(config, scaling)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    current = getattr(text, "rope_parameters", None) or {}
    nested = isinstance(current, dict) and any(isinstance(v, dict) for v in current.values())
    if nested and "full_attention" not in current:
        raise ModelError(
            f"model.rope_scaling: {type(text).__name__} sets RoPE per layer type ({', '.join(current)}) "
            "and none is 'full_attention'; hone does not know which to scale"
        )
    previous = current["full_attention"] if nested else current
    original = scaling.original_max_position_embeddings or _original_positions(text, previous)
    params = {"rope_type": scaling.type, "factor": float(scaling.factor), "rope_theta": _theta(text, previous)}
    if scaling.type in ("yarn", "llama3"):
        params["original_max_position_embeddings"] = original
    if scaling.type == "llama3":
        params.update(_LLAMA3_DEFAULTS)
    params.update({name: getattr(scaling, name) for name in _OPTIONAL if getattr(scaling, name) is not None})
    if "partial_rotary_factor" in previous:
        params["partial_rotary_factor"] = previous["partial_rotary_factor"]
    text.rope_parameters = {**current, "full_attention": params} if nested else params
    text.max_position_embeddings = scaling.max_position_embeddings or int(original * scaling.factor)
    return config


def _original_positions(text: Any, previous: dict[str, Any]) -> int:
    """The pretraining length: what the config's own scaling names, else its positions."""
    value = previous.get("original_max_position_embeddings") if previous.get("rope_type", "default") != "default" else None
    value = value or getattr(text, "max_position_embeddings", None)
    if not isinstance(value, int):
        raise ModelError(
            f"model.rope_scaling: {type(text).__name__} has no max_position_embeddings; "
            "set model.rope_scaling.original_max_position_embeddings"
        )
    return value


def _theta(text: Any, previous: dict[str, Any]) -> float:
    theta = previous.get("rope_theta", getattr(text, "rope_theta", None))
    if theta is None:
        theta = getattr(text, "default_theta", 10_000.0)
    return float(theta)


def _raw_with_scaling(raw: dict[str, Any], scaling: RopeScaling) -> dict[str, Any]:
    original = scaling.original_max_position_embeddings or raw.get("max_position_embeddings")
    if not isinstance(original, int):
        raise ModelError(
            "model.rope_scaling: the model's config.json has no max_position_embeddings; "
            "set model.rope_scaling.original_max_position_embeddings"
        )
    entry = {k: v for k, v in scaling.model_dump().items() if v is not None and k != "max_position_embeddings"}
    entry["original_max_position_embeddings"] = original
    positions = scaling.max_position_embeddings or int(original * scaling.factor)
    return {**raw, "rope_scaling": entry, "max_position_embeddings": positions}
