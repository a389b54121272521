"""Check a local model directory before transformers touches it.

transformers' own errors for a wrong directory talk about the Hub, revisions and repo ids,
which mislead when hone never downloads anything. These checks say what is wrong with the
directory in hone's terms, and refuse pickle weights before anything could unpickle them.
"""

import json
from pathlib import Path

from transformers import AutoConfig, PreTrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from hone.models.errors import ModelError

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")

CONVERT_HINT = (
    "convert it once, in an environment you trust, with: python -c \"from transformers import "
    "AutoModelForCausalLM as M; M.from_pretrained('{src}', dtype='auto').save_pretrained('{src}-safetensors')\" "
    "(and copy the tokenizer files), then point {key} at the new directory"
)


def check_model_dir(path: Path, key: str = "model.path") -> None:
    """Raise :class:`ModelError` unless ``path`` is a save_pretrained directory with safetensors."""
    path = Path(path)
    if not path.exists():
        raise ModelError(
            f"{key}: '{path}' does not exist; it must be a local directory written by "
            "save_pretrained (hone never downloads from a model hub)"
        )
    if not path.is_dir():
        raise ModelError(f"{key}: '{path}' is a file; it must be a directory written by save_pretrained")
    if not (path / "config.json").is_file():
        hint = ""
        if (path / "adapter_config.json").is_file():
            hint = (
                ": it holds a PEFT adapter (adapter_config.json), not a model; point "
                f"{key} at the base model, or merge the adapter first with `hone merge`"
            )
        raise ModelError(f"{key}: '{path}' has no config.json, so it is not a save_pretrained model directory{hint}")
    safetensors = sorted(p.name for p in path.glob("*.safetensors"))
    if safetensors:
        return
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise ModelError(
            f"{key}: '{path}' holds only PyTorch pickle weights ({', '.join(pickles[:3])}"
            f"{', ...' if len(pickles) > 3 else ''}); hone loads safetensors only, because loading "
            "a pickle can run arbitrary code hidden in the file. "
            + CONVERT_HINT.format(src=path, key=key)
        )
    raise ModelError(f"{key}: '{path}' has a config.json but no weights (*.safetensors)")


def read_causal_lm_config(path: Path, trust_remote_code: bool, key: str = "model.path") -> PreTrainedConfig:
    """The model's config, refusing models that are not causal language models."""
    try:
        raw = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelError(f"{key}: cannot read '{Path(path) / 'config.json'}': {exc}") from None
    if not isinstance(raw, dict):
        raise ModelError(f"{key}: '{Path(path) / 'config.json'}' is not a JSON object")
    model_type = raw.get("model_type")
    remote = "AutoModelForCausalLM" in (raw.get("auto_map") or {})
    if remote and not trust_remote_code:
        raise ModelError(
            f"{key}: '{path}' ships its own model code (auto_map in config.json), which runs only "
            "with model.trust_remote_code: true; turn it on only if you trust that code"
        )
    if not remote and model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        examples = ", ".join(t for t in ("llama", "qwen3", "qwen3_moe", "mistral", "gemma3_text") if t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
        raise ModelError(
            f"{key}: model_type '{model_type}' in '{Path(path) / 'config.json'}' is not a causal "
            f"language model transformers knows (AutoModelForCausalLM supports e.g. {examples}); "
            "hone fine-tunes decoder-only causal LMs"
        )
    try:
        return AutoConfig.from_pretrained(str(path), local_files_only=True, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelError(f"{key}: cannot read the model config in '{path}': {exc}") from None
