"""Check a local model directory before transformers touches it.

transformers' own errors for a wrong directory talk about the Hub, revisions and repo ids,
which mislead when hone never downloads anything. These checks say what is wrong with the
directory in hone's terms, and refuse pickle weights before anything could unpickle them.

Everything here reads metadata only: ``config.json``, file names, the sharded index and the
JSON header of each ``.safetensors`` file (whose tensor offsets give the exact size the file
must have, so a truncated download is caught without reading a single weight).
``hone validate`` reports every problem at once (:func:`model_dir_problems`); loading raises
on the first (:func:`check_model_dir`).
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hone.models.errors import ModelError

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

    from hone.config.model import ModelConfig

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
SHARD_INDEX = "model.safetensors.index.json"
#: A safetensors header larger than this is not a header (the format caps it at 100 MB).
MAX_HEADER_BYTES = 100_000_000
#: Bytes per element of each safetensors dtype (unknown dtypes skip the size check).
DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U64": 8,
    "U32": 4,
    "U16": 2,
    "U8": 1,
    "BOOL": 1,
}

CONVERT_HINT = (
    'convert it once, in an environment you trust, with: python -c "from transformers import '
    "AutoModelForCausalLM as M; M.from_pretrained('{src}', dtype='auto').save_pretrained('{src}-safetensors')\" "
    "(and copy the tokenizer files), then point {key} at the new directory"
)


# ---------------------------------------------------------------- files


def layout_problems(path: Path, key: str = "model.path", weights: bool = True) -> list[str]:
    """Every problem with the directory's files: config.json present, safetensors weights
    present and complete (headers, sizes, the shards an index names). Reads no weights.
    ``weights=False`` checks the config alone (``hone plan`` needs no weights)."""
    path = Path(path)
    if not path.exists():
        return [
            f"{key}: '{path}' does not exist; it must be a local directory written by "
            "save_pretrained (hone never downloads from a model hub)"
        ]
    if not path.is_dir():
        return [f"{key}: '{path}' is a file; it must be a directory written by save_pretrained"]
    problems = []
    if not (path / "config.json").is_file():
        hint = ""
        if (path / "adapter_config.json").is_file():
            hint = (
                ": it holds a PEFT adapter (adapter_config.json), not a model; point "
                f"{key} at the base model, or merge the adapter first with `hone merge`"
            )
        problems.append(f"{key}: '{path}' has no config.json, so it is not a save_pretrained model directory{hint}")
        if hint:
            return problems
    if not weights:
        return problems
    safetensors = sorted(path.glob("*.safetensors"))
    if not safetensors:
        pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            problems.append(
                f"{key}: '{path}' holds only PyTorch pickle weights ({', '.join(pickles[:3])}"
                f"{', ...' if len(pickles) > 3 else ''}); hone loads safetensors only, because loading "
                "a pickle can run arbitrary code hidden in the file. " + CONVERT_HINT.format(src=path, key=key)
            )
        elif not problems:
            problems.append(f"{key}: '{path}' has a config.json but no weights (*.safetensors)")
        return problems
    problems += _index_problems(path, key)
    for file in safetensors:
        problem = safetensors_problem(file)
        if problem is not None:
            problems.append(f"{key}: {problem}; copy or download the file again")
    return problems


def _index_problems(path: Path, key: str) -> list[str]:
    index = path / SHARD_INDEX
    if not index.is_file():
        return []
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        shards = sorted({str(name) for name in weight_map.values()})
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return [f"{key}: '{index}' is not a valid shard index ({type(exc).__name__}: {exc})"]
    missing = [name for name in shards if not (path / name).is_file()]
    if not missing:
        return []
    shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
    return [
        f"{key}: '{index}' names {len(shards)} weight shard(s) but {len(missing)} are missing "
        f"from '{path}' ({shown}); the download or copy is incomplete"
    ]


def safetensors_problem(file: Path) -> str | None:
    """Why ``file`` is not a complete safetensors file, or None.

    The format is an 8-byte little-endian header length, a JSON header giving each tensor's
    dtype, shape and ``data_offsets`` into the data that follows, and that data. The file must
    end exactly where the last tensor does.
    """
    try:
        size = file.stat().st_size
        with open(file, "rb") as handle:
            head = handle.read(8)
            if len(head) < 8:
                return f"'{file}' is truncated ({size} bytes; not even the 8-byte header length is complete)"
            (header_len,) = struct.unpack("<Q", head)
            if header_len > min(size - 8, MAX_HEADER_BYTES):
                return (
                    f"'{file}' is truncated or not a safetensors file (it announces a {header_len:,}-byte "
                    f"header, the file has {size:,} bytes)"
                )
            header = json.loads(handle.read(header_len))
    except OSError as exc:
        return f"cannot read '{file}': {exc.strerror or exc}"
    except (ValueError, UnicodeDecodeError):
        return f"'{file}' is corrupt (its header is not valid JSON)"
    if not isinstance(header, dict):
        return f"'{file}' is corrupt (its header is not a JSON object)"
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        problem = _tensor_entry_problem(info)
        if problem is not None:
            return f"'{file}' is corrupt (tensor '{name}': {problem})"
        end = max(end, info["data_offsets"][1])
    expected = 8 + header_len + end
    if size < expected:
        return f"'{file}' is truncated: its header describes {expected:,} bytes, the file has {size:,}"
    if size > expected:
        return f"'{file}' is corrupt: {size - expected:,} bytes follow the data its header describes"
    return None


def _tensor_entry_problem(info: Any) -> str | None:
    if not isinstance(info, dict):
        return "entry is not a JSON object"
    offsets, shape = info.get("data_offsets"), info.get("shape")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) and o >= 0 for o in offsets)):
        return f"bad data_offsets {offsets!r}"
    if offsets[1] < offsets[0]:
        return f"data_offsets {offsets} end before they start"
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
        return f"bad shape {shape!r}"
    width = DTYPE_BYTES.get(str(info.get("dtype")))
    if width is not None and math.prod(shape) * width != offsets[1] - offsets[0]:
        return f"{info.get('dtype')} {shape} needs {math.prod(shape) * width} bytes, data_offsets give {offsets[1] - offsets[0]}"
    return None


def check_model_dir(path: Path, key: str = "model.path") -> None:
    """Raise :class:`ModelError` unless ``path`` is a save_pretrained directory with complete
    safetensors weights."""
    problems = layout_problems(path, key)
    if problems:
        raise ModelError(problems[0])


# ---------------------------------------------------------------- config.json


def read_raw_config(path: Path, key: str = "model.path") -> dict[str, Any]:
    """``config.json`` as a dict; :class:`ModelError` if it is missing, unreadable or not an object."""
    file = Path(path) / "config.json"
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelError(f"{key}: cannot read '{file}': {exc}") from None
    if not isinstance(raw, dict):
        raise ModelError(f"{key}: '{file}' is not a JSON object")
    return raw


def ships_mxfp4(model: ModelConfig) -> bool:
    """Whether ``model`` names a checkpoint whose experts ship in MXFP4 (config.json's
    ``quantization_config.quant_method: mxfp4``, gpt-oss as published). Read as JSON (no torch,
    no transformers: ``hone validate`` asks too). A preset never is; a directory whose config
    cannot be read counts as not (loading it says why)."""
    from hone.models.hub import local_model_dir

    if model.path is None:
        return False
    try:
        quantization = read_raw_config(local_model_dir(model.path)).get("quantization_config")
    except (ModelError, OSError):
        return False
    return isinstance(quantization, dict) and quantization.get("quant_method") == "mxfp4"


#: ``quantization_config.quant_method`` values hone loads (the experts stay quantized).
LOADED_QUANT_METHODS = ("mxfp4",)


def quant_method_problem(method: str | None, path: Path, key: str = "model.path") -> str | None:
    """Why a checkpoint quantized with ``method`` cannot be loaded (None: it can, or it is not
    quantized), saying what hone loads instead."""
    if method is None or method in LOADED_QUANT_METHODS:
        return None
    return (
        f"{key}: '{Path(path) / 'config.json'}' declares a checkpoint quantized with "
        f"quantization_config.quant_method '{method}', which hone does not load: hone trains unquantized "
        "checkpoints (bf16, fp16 or fp32 safetensors) and gpt-oss MXFP4 checkpoints (quant_method: mxfp4, "
        "experts kept in MXFP4), and quantizes a base itself with model.quantize (nf4 for linear layers, "
        "mxfp4 for MoE experts). Point model.path at the unquantized original, or dequantize the checkpoint "
        "to bf16 once and save it with save_pretrained"
    )


def raw_config_problem(raw: dict[str, Any], path: Path, trust_remote_code: bool, key: str = "model.path") -> str | None:
    """Refuse remote code without consent, quantized formats hone does not load and model types
    that are not causal LMs."""
    quantization = raw.get("quantization_config")
    if isinstance(quantization, dict):
        problem = quant_method_problem(quantization.get("quant_method"), path, key)
        if problem is not None:
            return problem
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    remote = "AutoModelForCausalLM" in (raw.get("auto_map") or {})
    if remote and not trust_remote_code:
        return (
            f"{key}: '{path}' ships its own model code (auto_map in config.json), which runs only "
            "with model.trust_remote_code: true; turn it on only if you trust that code"
        )
    model_type = raw.get("model_type")
    if not remote and model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        examples = ", ".join(
            t for t in ("llama", "qwen3", "qwen3_moe", "mistral", "gemma3_text") if t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        )
        return (
            f"{key}: model_type '{model_type}' in '{Path(path) / 'config.json'}' is not a causal "
            f"language model transformers knows (AutoModelForCausalLM supports e.g. {examples}); "
            "hone fine-tunes decoder-only causal LMs"
        )
    return None


def read_causal_lm_config(path: Path, trust_remote_code: bool, key: str = "model.path") -> PreTrainedConfig:
    """The model's config, refusing models that are not causal language models."""
    from transformers import AutoConfig

    raw = read_raw_config(path, key)
    problem = raw_config_problem(raw, path, trust_remote_code, key)
    if problem is not None:
        raise ModelError(problem)
    try:
        return AutoConfig.from_pretrained(str(path), local_files_only=True, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelError(f"{key}: cannot read the model config in '{path}': {exc}") from None


def model_dir_problems(
    path: Path, trust_remote_code: bool, key: str = "model.path", weights: bool = True
) -> tuple[list[str], PreTrainedConfig | dict[str, Any] | None]:
    """Every problem of the directory (files and config), and its config when readable: a
    transformers config, or the raw dict for remote-code models (whose config class is their
    own code, which validation does not run)."""
    problems = layout_problems(path, key, weights)
    if not (Path(path) / "config.json").is_file():
        return problems, None
    try:
        raw = read_raw_config(path, key)
    except ModelError as exc:
        return [*problems, str(exc)], None
    problem = raw_config_problem(raw, path, trust_remote_code, key)
    if problem is not None:
        return [*problems, problem], None
    if "AutoModelForCausalLM" in (raw.get("auto_map") or {}):
        return problems, raw
    try:
        return problems, read_causal_lm_config(path, trust_remote_code=False, key=key)
    except ModelError as exc:
        return [*problems, str(exc)], None


# ---------------------------------------------------------------- context length


def context_length(config: PreTrainedConfig | dict[str, Any]) -> int | None:
    """The positions the model was built for (``max_position_embeddings`` or its alias)."""
    if isinstance(config, dict):
        for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
            if isinstance(config.get(name), int):
                return config[name]
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    value = getattr(text, "max_position_embeddings", None)
    return value if isinstance(value, int) else None


def attention_head_dim(config: PreTrainedConfig) -> int | None:
    """The width of one attention head: ``head_dim``, else ``hidden_size / num_attention_heads``
    (None where the config says neither)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    value = getattr(text, "head_dim", None)
    if value:
        return int(value)
    heads, hidden = getattr(text, "num_attention_heads", None), getattr(text, "hidden_size", None)
    return int(hidden) // int(heads) if heads and hidden else None


def attention_groups(config: PreTrainedConfig) -> int:
    """Query heads per key/value head (1 without grouped-query attention, or where the config
    names no heads)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None) or 1
    return max(heads // (getattr(text, "num_key_value_heads", None) or heads), 1)


def rope_scaling_type(config: PreTrainedConfig | dict[str, Any]) -> str | None:
    """The RoPE scaling the model config sets (``linear``, ``yarn``, ...), or None for plain RoPE."""
    if isinstance(config, dict):
        params = config.get("rope_scaling") or config.get("rope_parameters")
    else:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        params = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None)
    if not isinstance(params, dict):
        return None
    candidates = [params] if ("rope_type" in params or "type" in params) else [p for p in params.values() if isinstance(p, dict)]
    for entry in candidates:
        kind = entry.get("rope_type") or entry.get("type")
        if kind and kind != "default":
            return str(kind)
    return None
