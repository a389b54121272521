"""Which model to fine-tune and how to load it."""

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from hone.config.base import Section

#: Architecture presets built with random weights (``hone.models.presets`` builds them).
#: ``tiny-*`` run on a laptop CPU; the others match real architectures for benchmarking.
PresetName = Literal[
    "tiny-llama",
    "tiny-qwen3",
    "tiny-mistral",
    "tiny-gemma",
    "tiny-qwen3-moe",
    "llama3-8b",
    "qwen3-8b",
    "qwen3-30b-a3b",
]

Dtype = Literal["float32", "bfloat16", "float16"]
AttnImplementation = Literal["eager", "sdpa"]


class ModelConfig(Section):
    """Which model to fine-tune and how its weights are loaded."""

    path: Path | None = None
    """Local Hugging Face model directory (``save_pretrained`` layout, safetensors weights)."""

    preset: PresetName | None = None
    """Random-initialised architecture preset instead of ``path`` (quickstart, benchmarks)."""

    preset_overrides: dict[str, int | float | bool | str] = Field(default_factory=dict)
    """Fields of the preset's transformers config to override, e.g. ``num_hidden_layers: 8``."""

    tokenizer_path: Path | None = None
    """Tokenizer directory; defaults to ``path`` (or the bundled tiny tokenizer for presets)."""

    dtype: Dtype = "bfloat16"
    """Dtype of the weights and of compute. LoRA adapters (and ``lora_modules_to_save``) are kept
    in float32 under autocast; a bfloat16 full fine-tune trains in pure bfloat16; a float16 full
    fine-tune keeps float32 weights and autocasts to float16 (with loss scaling)."""

    attn_implementation: AttnImplementation = "sdpa"
    """Attention backend registered with transformers' ``AttentionInterface``."""

    trust_remote_code: bool = False
    """Allow Python code shipped inside the model directory to run. Off unless you trust it."""

    @model_validator(mode="after")
    def _exactly_one_source(self) -> "ModelConfig":
        if (self.path is None) == (self.preset is None):
            raise ValueError(
                "set exactly one of model.path (a local model directory) or model.preset "
                "(a random-init architecture such as tiny-llama)"
            )
        if self.preset_overrides and self.preset is None:
            raise ValueError("model.preset_overrides only applies together with model.preset")
        return self

    @property
    def source(self) -> str:
        """Human-readable origin of the weights, for logs and run summaries."""
        return f"preset:{self.preset}" if self.preset else str(self.path)
