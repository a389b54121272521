"""Translate an Axolotl YAML config into a hone config (``hone convert``).

Pure functions: a parsed Axolotl mapping in, a hone config mapping out, together with every
Axolotl key that could not be carried over and why. Nothing here reads files, imports torch or
validates; the CLI writes the result and runs hone's own loader on it, so "it converts" and
"it validates" are two separate, honest statements.

The translation takes keys out of the Axolotl mapping one at a time (:class:`_Reader`), so a key
that no rule consumed is reported instead of silently dropped. A key whose value asks for
nothing (null, false, an empty string or list) is dropped quietly: leaving it out changes no
behaviour. Keys that hone does not need because it does the same thing on its own are listed as
notes, not as untranslated.

A preference config (``rl: dpo | ipo | orpo``) becomes hone's preference objective and
``preference`` datasets (:mod:`hone.convert.axolotl_preference`). A config whose objective or
modality hone does not train (another ``rl``, reward models, a multimodal
``processor_type``, a diffusion or distillation plugin), or whose training datasets all fail to
convert, is refused (:class:`ConversionRefused`, naming each key and why) instead of being
converted into a plain language-model run.
"""

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

import yaml

from hone.config.attention import BACKENDS
from hone.config.data import CHAT_TEMPLATE_NAMES, SUFFIX_FORMATS, looks_like_hub_id
from hone.config.performance import COMPILE_MODES, INDUCTOR_OPTIONS
from hone.convert.axolotl_preference import objective, preference_dataset, rl_refusal
from hone.errors import HoneError


class ConversionRefused(HoneError):
    """The Axolotl config trains something hone does not (another objective or modality), or
    none of its training datasets converts: writing a config anyway would train something else
    than the user asked for, so nothing is written."""


@dataclass(frozen=True)
class Untranslated:
    """An Axolotl key (dotted path, list items as ``[i]``) that has no place in the hone config."""

    key: str
    reason: str


@dataclass
class Conversion:
    """The hone config (plain mapping, sections in hone's order) and what the translation lost."""

    config: dict[str, Any]
    untranslated: list[Untranslated] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """Keys translated with a change of meaning, or not needed because hone does it itself."""

    @property
    def untranslated_keys(self) -> list[str]:
        return [u.key for u in self.untranslated]


#: Axolotl's chat template names that hone spells differently; every other name is kept as it is
#: (``chatml``, ``llama3``, ``qwen3``, ``qwen_25``, ``gemma``, ``gemma3``, ...) and ``hone
#: validate`` refuses a name hone does not ship, listing the ones it does.
TEMPLATE_NAMES: dict[str, str] = {"qwen2_5": "qwen2.5", "qwen25": "qwen2.5"}

#: Axolotl (and Hugging Face Trainer) optimizer names -> hone's ``optimizer.name``, with the note
#: shown when the implementation differs (bitsandbytes' kernels, paging).
_BNB_8BIT = "bitsandbytes' 8-bit AdamW -> torchao's AdamW8bit (block-wise 8-bit moments; pip install 'hone[quant]')"
_PAGED = "hone does not page optimizer state to the host"
OPTIMIZERS: dict[str, tuple[str, str | None]] = {
    "adamw_torch": ("adamw", None),
    "adamw_torch_fused": ("adamw", None),
    "adamw_hf": ("adamw", None),
    "adamw": ("adamw", None),
    "adamw_apex_fused": ("adamw", None),
    "paged_adamw_32bit": ("adamw", f"paged 32-bit AdamW -> optimizer.name: adamw ({_PAGED})"),
    "adamw_bnb_8bit": ("adamw_8bit", _BNB_8BIT),
    "adamw_8bit": ("adamw_8bit", _BNB_8BIT),
    "paged_adamw_8bit": ("adamw_8bit", f"{_BNB_8BIT}; {_PAGED}"),
    "adamw_torch_8bit": ("adamw_8bit", None),  # Trainer's name for torchao's AdamW8bit
    "ao_adamw_8bit": ("adamw_8bit", None),
    "adamw_torch_4bit": ("adamw_4bit", None),  # Trainer's name for torchao's AdamW4bit
    "ao_adamw_4bit": ("adamw_4bit", None),
}

_SECTION_ORDER = ("model", "data", "adapter", "training", "optimizer", "memory", "performance", "logging", "distributed")

_TRACKERS = "hone's trackers are TensorBoard, W&B and MLflow (logging.trackers); add this one's metrics by hand"
_HUB = "hone never uploads: push the run directory yourself"
_NO_QUANT = "hone's only quantized base is 4-bit NF4 for LoRA (model.quantize: nf4); this base loads in model.dtype"

#: Axolotl keys that hone cannot express, with the reason shown to the user. Keys not here and
#: not translated get a generic reason.
REASONS: dict[str, str] = {
    "load_in_8bit": _NO_QUANT,
    "gptq": _NO_QUANT,
    "deepspeed": "hone shards with PyTorch FSDP2, not DeepSpeed; only ZeRO-3 maps (to distributed.strategy: fsdp); "
    "distributed.strategy: auto picks DDP or FSDP2 by memory",
    "special_tokens": "hone keeps the tokenizer's own special tokens (it sets only a missing pad token); "
    "edit the tokenizer's files to change them",
    "tokens": "hone adds no tokens to the vocabulary; add them to the tokenizer (and resize the model) beforehand",
    "added_tokens_overrides": "hone adds no tokens to the vocabulary",
    "train_on_inputs": "hone trains only the response of alpaca rows and the train_on roles of chat rows",
    "group_by_length": "hone does not sort batches by length",
    "early_stopping_patience": "hone has no early stopping",
    "loss_watchdog_threshold": "hone has no loss watchdog (it stops after training.max_consecutive_nonfinite non-finite steps)",
    "loss_watchdog_patience": "hone has no loss watchdog (it stops after training.max_consecutive_nonfinite non-finite steps)",
    "eval_table_size": "hone does not sample generations during evaluation",
    "eval_max_new_tokens": "hone does not sample generations during evaluation",
    "eval_causal_lm_metrics": "hone evaluates the loss only",
    "do_bench_eval": "hone evaluates the loss only",
    "lora_model_dir": "hone starts a new adapter; it does not continue training an existing one",
    "unfrozen_parameters": "hone trains LoRA adapters (plus adapter.lora_modules_to_save) or every weight",
    "neftune_noise_alpha": "hone adds no embedding noise",
    "xformers_attention": "hone has no xformers backend; attention stays sdpa",
    "s2_attention": "hone has no shifted-sparse attention",
    "flash_attn_cross_entropy": "hone chooses its loss with performance.loss",
    "flash_attn_rms_norm": "hone has no flash-attn RMSNorm",
    "flash_attn_fuse_qkv": "hone does not fuse the q/k/v projections",
    "flash_attn_fuse_mlp": "hone does not fuse the MLP projections",
    "liger_rope": "hone has no Liger kernels; its own fused kernels come from the plan (hone plan)",
    "liger_rms_norm": "hone has no Liger kernels; its own fused kernels come from the plan (hone plan)",
    "liger_glu_activation": "hone has no Liger kernels; its own fused kernels come from the plan (hone plan)",
    "liger_layer_norm": "hone has no Liger kernels; its own fused kernels come from the plan (hone plan)",
    "plugins": "hone has no plugins; fused loss plugins map to performance.loss",
    "wandb_run_id": "hone starts a new W&B run for each training run (resuming a W&B run by id is not supported)",
    "wandb_watch": "hone logs metrics rows to W&B, not gradient or parameter histograms",
    "wandb_log_model": "hone does not upload checkpoints to W&B: they are in the run directory",
    "comet_api_key": _TRACKERS,
    "comet_project_name": _TRACKERS,
    "use_comet": _TRACKERS,
    "hub_model_id": _HUB,
    "hub_strategy": _HUB,
    "push_to_hub": _HUB,
    "push_dataset_to_hub": _HUB,
    "hf_use_auth_token": "hone works offline, on local files only",
    "max_memory": "hone places the model on one device per process",
    "gpu_memory_limit": "hone places the model on one device per process",
    "lora_on_cpu": "hone places the model on one device per process",
    "ddp_timeout": "hone uses torch.distributed's default timeout",
    "ddp_bucket_cap_mb": "hone uses DDP's default bucket size",
    "ddp_broadcast_buffers": "hone uses DDP's defaults",
    "ddp_find_unused_parameters": "hone uses DDP's defaults",
    "dataloader_num_workers": "hone batches pre-tokenized data in the training process",
    "dataloader_pin_memory": "hone batches pre-tokenized data in the training process",
    "dataloader_prefetch_factor": "hone batches pre-tokenized data in the training process",
    "shuffle_merged_datasets": "hone always shuffles the mixed training rows (by training.seed)",
    "resize_token_embeddings_to_32x": "hone keeps the model's embedding size",
    "lr_scheduler_kwargs": "hone's schedules take only warm-up and optimizer.cosine_min_lr_ratio",
    "optim_args": "hone's AdamW takes only the optimizer section's keys",
    "lr_quadratic_warmup": "hone's warm-up is linear",
    "sequence_parallel_degree": "hone has no sequence parallelism",
    "tensor_parallel_size": "hone has no tensor parallelism",
    "context_parallel_size": "hone has no context parallelism",
    "relora_steps": "hone has no ReLoRA",
    "peft_layers_to_transform": "hone puts adapters on every matching layer",
    "lora_fan_in_fan_out": "hone's LoRA uses PEFT's default layout",
    "save_strategy": "hone checkpoints every training.save_steps (or saves_per_epoch times an epoch) and at the end",
    "eval_strategy": "hone evaluates every training.eval_steps (or evals_per_epoch times an epoch) and at the end",
    "save_only_model": "hone's checkpoints always hold what a resume needs",
    "max_packed_sequence_len": "hone packs into rows of data.sequence_len",
    "sample_packing_eff_est": "hone packs once, before training, and knows the exact row count",
    "sample_packing_bin_size": "hone packs with best-fit decreasing (see data.sample_packing_group_size)",
    "multipack_real_batches": "hone packs documents into rows of data.sequence_len",
    "chat_template_kwargs": "hone renders the chat template with messages and add_generation_prompt only",
    "default_system_message": "hone adds no system message; put it in the data",
    "remove_unused_columns": "hone keeps only the columns its dataset type names",
}

#: Keys hone does not need: it does the same thing on its own (shown as notes).
NOT_NEEDED: dict[str, str] = {
    "base_model_config": "hone reads the model's config from model.path",
    "model_type": "hone picks the model class from config.json",
    "model_config_type": "hone picks the model class from config.json",
    "tokenizer_type": "hone loads the tokenizer with AutoTokenizer",
    "is_llama_derived_model": "hone reads the architecture from config.json",
    "is_mistral_derived_model": "hone reads the architecture from config.json",
    "is_qwen_derived_model": "hone reads the architecture from config.json",
    "is_falcon_derived_model": "hone reads the architecture from config.json",
    "strict": "hone validates every key; unknown keys are errors",
    "save_safetensors": "hone always writes safetensors",
    "low_cpu_mem_usage": "hone builds models on the meta device",
    "gradient_checkpointing_kwargs": "hone's activation checkpointing is always non-reentrant",
    "lora_mlp_kernel": "hone chooses its LoRA kernels through the plan",
    "lora_qkv_kernel": "hone chooses its LoRA kernels through the plan",
    "lora_o_kernel": "hone chooses its LoRA kernels through the plan",
    "local_rank": "set by the launcher (torchrun)",
    "debug": "use hone --verbose",
    "use_tensorboard": "hone writes TensorBoard events by default (logging.tensorboard)",
    "fsdp_version": "hone's FSDP is always FSDP2",
    "pretrain_multipack_attn": "hone's packing always keeps packed documents apart",
    "pretrain_multipack_buffer_size": "hone packs the whole dataset once, before training",
}


def _asks_nothing(value: Any) -> bool:
    """Whether leaving the key out changes nothing (null, false, empty)."""
    return value is None or value is False or value == "" or value == [] or value == {}


def _number(value: Any) -> float | int | None:
    """A number, also from a string (YAML 1.1 reads ``2e-5`` without a dot as a string)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


class _Reader:
    """Takes keys out of one Axolotl mapping; what is left at the end was not translated."""

    def __init__(self, raw: Mapping[str, Any], prefix: str = "") -> None:
        self.left: dict[str, Any] = dict(raw)
        self.prefix = prefix
        self.untranslated: list[Untranslated] = []
        self.notes: list[str] = []

    def name(self, key: str) -> str:
        return f"{self.prefix}{key}"

    def take(self, key: str) -> Any:
        return self.left.pop(key, None)

    def has(self, key: str) -> bool:
        return not _asks_nothing(self.left.get(key))

    def drop(self, key: str, reason: str) -> None:
        """Record ``key`` as untranslated (unless it asks for nothing)."""
        value = self.left.pop(key, None)
        if not _asks_nothing(value):
            self.untranslated.append(Untranslated(self.name(key), reason))

    def number(self, key: str, target: dict[str, Any], target_key: str, integer: bool = False) -> None:
        """Copy a numeric key, or report it when it is not a number."""
        value = self.take(key)
        if value is None:
            return
        parsed = _number(value)
        if parsed is None or (integer and float(parsed) != int(parsed)):
            kind = "an integer" if integer else "a number"
            self.untranslated.append(Untranslated(self.name(key), f"{value!r} is not {kind}"))
            return
        target[target_key] = int(parsed) if integer else parsed

    def finish(self, generic: str) -> None:
        """Report every key nobody took."""
        for key, value in list(self.left.items()):
            del self.left[key]
            if key in NOT_NEEDED and not self.prefix:
                if not _asks_nothing(value):
                    self.notes.append(f"{key}: not needed ({NOT_NEEDED[key]})")
                continue
            if _asks_nothing(value):
                continue
            self.untranslated.append(Untranslated(self.name(key), REASONS.get(key, generic) if not self.prefix else generic))


# ----------------------------------------------------------------------------------------------
# model


def _model(r: _Reader, model: dict[str, Any]) -> None:
    base = r.take("base_model")
    if base is not None:
        model["path"] = str(base)  # a hub id stays an id (hone resolves ids from the local cache)
    tokenizer = r.take("tokenizer_config")
    if tokenizer is not None and tokenizer != base:
        model["tokenizer_path"] = str(tokenizer)
    if r.take("trust_remote_code") is True:
        model["trust_remote_code"] = True
    _rope_scaling(r, model)
    model["dtype"] = _dtype(r)


#: RoPE-scaling fields model.rope_scaling takes (besides ``type``), as transformers names them.
ROPE_FIELDS = (
    "factor", "original_max_position_embeddings", "max_position_embeddings", "beta_fast", "beta_slow",
    "attention_factor", "low_freq_factor", "high_freq_factor",
)  # fmt: skip


def _rope_scaling(r: _Reader, model: dict[str, Any]) -> None:
    """``rope_scaling`` (top level, older Axolotl) or ``overrides_of_model_config.rope_scaling`` ->
    model.rope_scaling (``rope_type`` or ``type`` -> ``type``); other overrides are listed."""
    overrides = r.take("overrides_of_model_config")
    overrides = dict(overrides) if isinstance(overrides, Mapping) else {}
    rope = overrides.pop("rope_scaling", None) or r.take("rope_scaling")
    for key in overrides:
        r.untranslated.append(
            Untranslated(
                f"overrides_of_model_config.{key}",
                "only rope_scaling maps (model.rope_scaling); presets take model.preset_overrides",
            )
        )
    if not isinstance(rope, Mapping):
        return
    rope = dict(rope)
    scaling = {"type": rope.pop("rope_type", None) or rope.pop("type", None)}
    rope.pop("type", None)
    scaling.update({key: rope.pop(key) for key in ROPE_FIELDS if key in rope})
    model["rope_scaling"] = scaling  # hone validate checks the type and the fields
    for key in rope:
        r.untranslated.append(Untranslated(f"rope_scaling.{key}", "not a RoPE-scaling field model.rope_scaling takes"))


def _dtype(r: _Reader) -> str:
    """bf16 / fp16 / tf32 -> model.dtype. Axolotl's ``bf16: auto`` means bf16 where supported."""
    bf16, fp16, tf32 = r.take("bf16"), r.take("fp16"), r.take("tf32")
    if fp16 is True and bf16 not in (True, "auto"):
        return "float16"
    if bf16 in (True, "auto", "true"):
        return "bfloat16"
    if bf16 is False:
        if tf32 is True:
            r.notes.append("tf32: true without bf16/fp16 -> model.dtype: float32 (torch decides TF32 matmul use)")
        return "float32"
    r.notes.append("bf16 not set -> model.dtype: bfloat16 (hone's default)")
    return "bfloat16"


def _attention(r: _Reader, model: dict[str, Any]) -> None:
    """Axolotl's attention flags -> model.attn_implementation (one backend)."""
    chosen: str | None = None
    direct = r.take("attn_implementation")
    if direct is not None:
        if direct in BACKENDS:
            chosen = direct
        else:
            r.untranslated.append(Untranslated("attn_implementation", f"'{direct}' is not one of hone's: {', '.join(BACKENDS)}"))
    flags = (
        ("flex_attention", "flex_attention"),
        ("flash_attention", "flash_attention_2"),
        ("sdp_attention", "sdpa"),
        ("eager_attention", "eager"),
    )
    for key, backend in flags:
        if r.take(key) is True and chosen is None:
            chosen = backend
    if chosen == "flash_attention_2" and not BACKENDS[chosen].installed:
        r.notes.append(
            "flash_attention: true -> model.attn_implementation: sdpa, because flash-attn is not installed here "
            "(packed rows still run through torch's FlashAttention-2 varlen kernel on CUDA in bf16); "
            "install flash-attn and set flash_attention_2 to use it"
        )
        chosen = "sdpa"
    if chosen == "flash_attention_2" and model.get("dtype") == "float32":
        r.notes.append("flash_attention: true with float32 -> model.attn_implementation: sdpa (flash kernels are bf16/fp16 only)")
        chosen = "sdpa"
    if chosen is not None and chosen != "sdpa":
        model["attn_implementation"] = chosen


# ----------------------------------------------------------------------------------------------
# data


#: A hub dataset id: ``Org/Name``, not a relative or absolute local path, no file suffix.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def _hub_id(path: Any) -> bool:
    return (
        isinstance(path, str) and _HUB_ID.fullmatch(path) is not None and PurePosixPath(path).suffix.lower() not in SUFFIX_FORMATS
    )


def _local_path(ds: _Reader, entry: dict[str, Any]) -> list[str]:
    """``path`` (and ``data_files``/``ds_type``) -> a file hone can read: a local file, or
    ``hf://datasets/Org/Name[@revision]/file`` for a hub dataset's ``data_files``. Returns the
    further files of a ``data_files`` list (each becomes an entry of its own)."""
    path = ds.take("path")
    data_files = ds.take("data_files")
    ds_type = ds.take("ds_type")
    if isinstance(data_files, str):
        data_files = [data_files]
    rest: list[str] = []
    if isinstance(data_files, list) and data_files and all(isinstance(f, str) for f in data_files):
        if _hub_id(path) and ds_type is None:
            revision = ds.take("revision")
            at = f"@{revision}" if revision else ""
            data_files = [f"hf://datasets/{path}{at}/{f.lstrip('/')}" for f in data_files]
        elif path not in (None, "json", "parquet", "csv", "arrow") and ds_type is None:
            ds.notes.append(f"{ds.name('data_files')}: the file is read as the dataset; path '{path}' is dropped")
        if path in ("json", "parquet", "csv", "arrow") and ds_type is None:
            ds_type = path
        path, rest = data_files[0], data_files[1:]
    elif data_files is not None:
        ds.untranslated.append(Untranslated(ds.name("data_files"), f"{data_files!r} is not a file name or a list of them"))
    if path is None:
        entry["path"] = "MISSING.jsonl"
        ds.untranslated.append(Untranslated(ds.name("path"), "no path: set data.datasets[].path to a local file"))
        return rest
    text = str(path)
    suffix = PurePosixPath(text).suffix.lower()
    formats = {"json": "json", "jsonl": "jsonl", "parquet": "parquet", "csv": "csv", "arrow": "arrow"}
    if ds_type in formats:
        entry["path"] = text
        if suffix not in SUFFIX_FORMATS:
            entry["file_format"] = formats[ds_type]
        return rest
    if ds_type is not None:
        ds.untranslated.append(
            Untranslated(ds.name("ds_type"), f"'{ds_type}' is not a file format hone reads (json, jsonl, parquet, csv, arrow)")
        )
    if suffix in SUFFIX_FORMATS:
        entry["path"] = text
        return rest
    if looks_like_hub_id(text):
        # a hub dataset id: hone reads it from the local Hugging Face caches (never downloads)
        revision = ds.take("revision")
        entry["path"] = f"{text}@{revision}" if revision and "@" not in text else text
        split = ds.take("split")
        if isinstance(split, str) and "[" in split:
            ds.untranslated.append(
                Untranslated(ds.name("split"), f"'{split}': hone reads whole splits (no slices); the whole split is read")
            )
            split = split.split("[")[0]
        if isinstance(split, str) and split not in ("", "train"):
            entry["split"] = split
        ds.notes.append(
            f"{ds.name('path')}: '{text}' is read from the local Hugging Face cache "
            f"(fetch it first: hf download {text.split('@')[0]} --repo-type dataset)"
        )
        return rest
    # A directory (or an id hone cannot read): hone reads one local file per entry.
    local = "data/" + text.strip("/").replace("/", "__") + ".jsonl"
    entry["path"] = local
    ds.untranslated.append(
        Untranslated(
            ds.name("path"),
            f"'{text}' is a directory or a dataset hone cannot read; hone reads files and hub dataset ids: export it (e.g. "
            f"datasets.load_dataset('{text}', split='train').to_json('{local}')), the output points at {local}",
        )
    )
    return rest


def _chat_fields(ds: _Reader, entry: dict[str, Any], messages: str, role: str, content: str) -> None:
    """Axolotl's chat_template field mappings -> hone's chat dataset fields."""
    entry["field_messages"] = ds.take("field_messages") or messages
    mapping = dict(ds.take("message_property_mappings") or {})  # a copy: the caller's mapping stays as read
    role = mapping.pop("role", None) or ds.take("message_field_role") or role
    content = mapping.pop("content", None) or ds.take("message_field_content") or content
    if mapping:
        ds.untranslated.append(
            Untranslated(ds.name("message_property_mappings"), f"only role and content map; not {', '.join(mapping)}")
        )
    if role != "role":
        entry["field_role"] = role
    if content != "content":
        entry["field_content"] = content
    if entry["field_messages"] == "messages":
        del entry["field_messages"]
    roles = ds.take("roles")
    if isinstance(roles, dict):
        role_map = {
            source: standard
            for standard, sources in roles.items()
            for source in (sources if isinstance(sources, list) else [sources])
            if source != standard
        }
        if role_map:
            entry.setdefault("role_map", {}).update(role_map)
    train_on = ds.take("roles_to_train")
    if train_on:
        entry["train_on"] = list(train_on)
    ds.drop(
        "train_on_eos",
        "hone trains the tokens the template renders for each trained role's turn; the EOS policy is not a setting",
    )
    ds.drop(
        "train_on_eot",
        "hone trains the tokens the template renders for each trained role's turn; the EOT policy is not a setting",
    )
    ds.drop("message_field_training", "hone picks trained turns by role (train_on), not per message")
    ds.drop("message_field_training_detail", "hone picks trained turns by role (train_on), not per message")
    ds.drop("drop_system_message", "hone renders every message of a row")


#: Axolotl's legacy alpaca prompt styles (``type: alpaca:<style>``): the same rows and trained span.
_ALPACA_STYLES = ("alpaca:instruct", "alpaca:chat", "alpaca:chatml", "alpaca:phi", "alpaca_chat", "alpaca_instruct")


def _dataset(
    raw: Any, index: int, group: str, data: dict[str, Any], preference: bool = False
) -> tuple[list[dict[str, Any]], _Reader]:
    """One Axolotl dataset entry -> hone dataset entries (one per file; none when its type has no
    match). ``preference``: the config trains a preference objective (``rl``), whose dataset
    types Axolotl reads with its DPO/ORPO strategies."""
    ds = _Reader(raw if isinstance(raw, Mapping) else {}, prefix=f"{group}[{index}].")
    if not isinstance(raw, Mapping):
        ds.untranslated.append(Untranslated(f"{group}[{index}]", "a dataset entry must be a mapping"))
        return [], ds
    kind = ds.take("type")
    entry: dict[str, Any] = {}
    more_files = _local_path(ds, entry)
    if preference:
        if not _preference_entry(ds, kind, entry, data):
            return [], ds
    elif kind == "alpaca":
        entry["type"] = "alpaca"
    elif kind in _ALPACA_STYLES:
        entry["type"] = "alpaca"
        ds.notes.append(
            f"{group}[{index}].type: {kind} -> alpaca: the same instruction/input/output rows and trained output, "
            "but hone's prompt ('### Instruction:' ... '### Response:'), not this style's wording"
        )
    elif kind == "completion":
        entry["type"] = "completion"
        text = ds.take("field")
        if text and text != "text":
            entry["field_text"] = text
    elif kind in ("chat_template", "chat_template.default"):
        entry["type"] = "chat"
        _chat_fields(ds, entry, "messages", "role", "content")
        template = ds.take("chat_template")
        jinja = ds.take("chat_template_jinja")
        if template is not None or jinja is not None:
            _chat_template(ds, template, jinja, data, key_prefix=ds.prefix)
    elif kind in ("sharegpt", "sharegpt:chat"):
        entry["type"] = "chat"
        entry["field_messages"] = "conversations"
        entry["role_map"] = {"human": "user", "gpt": "assistant"}
        _chat_fields(ds, entry, "conversations", "from", "value")
        ds.drop(
            "conversation",
            "hone renders chats with the tokenizer's template or data.chat_template (Jinja), not FastChat conversation names",
        )
    else:
        shown = kind if isinstance(kind, str) else "a custom format mapping"
        ds.untranslated.append(
            Untranslated(
                f"{group}[{index}]",
                f"type {shown!r} has no hone dataset type (hone has: alpaca, chat, completion, pretokenized); "
                "the entry is left out",
            )
        )
        ds.left.clear()
        return [], ds
    _finish_dataset(ds)
    return [entry] + [{**entry, "path": path} for path in more_files], ds


def _preference_entry(ds: _Reader, kind: Any, entry: dict[str, Any], data: dict[str, Any]) -> bool:
    """A preference dataset entry (Axolotl's DPO/ORPO strategies) into ``entry``; False (and the
    entry listed with the reason) when hone cannot read its rows the same way."""
    result = preference_dataset(kind, ds.left, ds.prefix)
    if isinstance(result, str):
        ds.untranslated.append(Untranslated(ds.prefix.rstrip("."), result))
        ds.left.clear()
        return False
    implied = result.values.pop("chat_template", None)
    entry.update(result.values)
    ds.untranslated.extend(Untranslated(key, reason) for key, reason in result.lost)
    ds.notes.extend(result.notes)
    template, jinja = ds.take("chat_template"), ds.take("chat_template_jinja")
    if implied is not None and data.get("chat_template", implied) != implied:
        ds.untranslated.append(
            Untranslated(
                f"{ds.prefix}type",
                f"renders {implied} turns, but data.chat_template is already {data['chat_template']!r} "
                "(hone renders every dataset with one template)",
            )
        )
    elif implied is not None:
        data["chat_template"] = implied
    elif template is not None or jinja is not None:
        _chat_template(ds, template, jinja, data, key_prefix=ds.prefix)
    return True


def _finish_dataset(ds: _Reader) -> None:
    """The keys every dataset entry may carry that hone's entries do not take."""
    ds.drop("split", "hone reads the whole file (a split applies to hub dataset ids)")
    ds.drop("name", "hone reads one file per entry (no dataset configs)")
    ds.drop("revision", "a revision applies to hub dataset ids")
    ds.drop("shards", "hone reads the whole file")
    ds.finish("not a dataset key hone knows how to translate")


def _chat_template(r: _Reader, template: Any, jinja: Any, data: dict[str, Any], key_prefix: str = "") -> None:
    """Axolotl's ``chat_template`` (a name, ``jinja`` or ``tokenizer_default``) -> data.chat_template
    (the same name, Jinja text, or unset for the tokenizer's own template)."""
    if template in (None, "tokenizer_default", "tokenizer_default_fallback_chatml") and jinja is None:
        return
    if jinja is not None and template in (None, "jinja"):
        data["chat_template"] = str(jinja)
    elif isinstance(template, str) and ("{%" in template or "{{" in template):
        data["chat_template"] = template
    elif isinstance(template, str) and TEMPLATE_NAMES.get(template, template).lower() in CHAT_TEMPLATE_NAMES:
        data["chat_template"] = TEMPLATE_NAMES.get(template, template)
    elif isinstance(template, str):  # Axolotl's copy of a model's own template (falcon_h1, phi_3, llama4, ...)
        r.untranslated.append(
            Untranslated(
                f"{key_prefix}chat_template",
                f"{template!r} is not a template hone ships ({', '.join(CHAT_TEMPLATE_NAMES)}); left unset, so the "
                "tokenizer's own template (tokenizer_config.json / chat_template.jinja of the model) renders the chats: "
                "Axolotl's named templates copy the model's own, but compare with `hone preprocess --show 3`, or paste "
                "the Jinja text as data.chat_template",
            )
        )
    else:
        r.untranslated.append(
            Untranslated(f"{key_prefix}chat_template", f"{template!r} is neither a template name nor Jinja text")
        )


def _pretraining_entries(raw: Any) -> list[Any]:
    """``pretraining_dataset`` (a path, a mapping or a list of them) as ``completion`` entries:
    Axolotl streams raw text (``text_column``) into packed rows, hone's completion type with
    packing trains the same tokens."""
    entries = raw if isinstance(raw, list) else [raw]
    out: list[Any] = []
    for item in entries:
        if isinstance(item, str):
            item = {"path": item}
        if isinstance(item, Mapping):
            item = dict(item)
            if item.get("type") in (None, "pretrain", "completion"):
                item["type"] = "completion"
            if "text_column" in item:
                item["field"] = item.pop("text_column")
        out.append(item)
    return out


def _data(r: _Reader, data: dict[str, Any], untranslated: list[Untranslated], notes: list[str], preference: bool = False) -> None:
    data["datasets"] = []
    pretraining = r.take("pretraining_dataset")
    groups = [("datasets", "datasets", r.take("datasets")), ("test_datasets", "test_datasets", r.take("test_datasets"))]
    if not _asks_nothing(pretraining):
        groups.append(("pretraining_dataset", "datasets", _pretraining_entries(pretraining)))
    dropped: list[Untranslated] = []
    for group, target, entries in groups:
        entries = entries or []
        if not isinstance(entries, list):
            entries = [entries]
        for index, raw in enumerate(entries):
            converted, ds = _dataset(raw, index, group, data, preference)
            untranslated.extend(ds.untranslated)
            notes.extend(ds.notes)
            data.setdefault(target, []).extend(converted)
            if not converted and target == "datasets":
                dropped.extend(ds.untranslated)
    if not _asks_nothing(pretraining) and data["datasets"]:
        if r.left.get("sample_packing") is not False:
            r.take("sample_packing")
            data["sample_packing"] = True
        notes.append(
            "pretraining_dataset -> data.datasets of type completion with data.sample_packing: true "
            "(hone reads the whole file before training where Axolotl streams it)"
        )
    if not data["datasets"]:
        reasons = "; ".join(f"{u.key}: {u.reason}" for u in dropped) or "the config names none (datasets, pretraining_dataset)"
        raise ConversionRefused(f"no training dataset converts, so there is nothing hone could train: {reasons}")
    _chat_template(r, r.take("chat_template"), r.take("chat_template_jinja"), data)
    r.number("sequence_len", data, "sequence_len", integer=True)
    val = r.take("val_set_size")
    if val is not None:
        number = _number(val)
        if number is None or not 0 <= number < 1:
            untranslated.append(Untranslated("val_set_size", f"{val!r}: hone takes a fraction in [0, 1) of the training rows"))
        elif number > 0:
            if data.get("test_datasets"):
                untranslated.append(Untranslated("val_set_size", "test_datasets are set; hone takes one eval source"))
            else:
                data["val_set_size"] = number
    for key in ("sample_packing", "eval_sample_packing", "pad_to_sequence_len"):
        value = r.take(key)
        if preference and value is True:
            notes.append(f"{key}: not needed (a preference objective packs each micro-batch's pairs into one row itself)")
        elif isinstance(value, bool) and not preference and (value or key != "pad_to_sequence_len"):
            data[key] = value
    prepared = r.take("dataset_prepared_path")
    if prepared:
        data["dataset_prepared_path"] = str(prepared)
    for key in ("dataset_processes", "dataset_num_proc"):
        r.number(key, data, "num_proc", integer=True)
    if r.take("excess_length_strategy") == "truncate":
        data["excess_length_strategy"] = "truncate"
    if data.get("test_datasets") == []:
        del data["test_datasets"]


# ----------------------------------------------------------------------------------------------
# adapter


def _adapter(r: _Reader, adapter: dict[str, Any]) -> str | None:
    """LoRA settings; returns Axolotl's adapter kind (``qlora`` decides the base's quantization later)."""
    kind = r.take("adapter")
    lora_keys = (
        "lora_r",
        "lora_alpha",
        "lora_dropout",
        "lora_target_modules",
        "lora_target_linear",
        "lora_modules_to_save",
        "peft_use_rslora",
    )
    if kind not in ("lora", "qlora"):
        if kind is not None:
            r.untranslated.append(
                Untranslated("adapter", f"'{kind}' is not an adapter hone has (lora, or none for a full fine-tune)")
            )
        adapter["type"] = "none"
        for key in lora_keys:
            r.drop(key, "LoRA settings, but no LoRA adapter is set (a full fine-tune)")
        return kind
    adapter["type"] = "lora"
    r.number("lora_r", adapter, "lora_r", integer=True)
    r.number("lora_alpha", adapter, "lora_alpha")
    r.number("lora_dropout", adapter, "lora_dropout")
    modules = r.take("lora_target_modules")
    if r.take("lora_target_linear") is True:
        adapter["lora_target_modules"] = "all-linear"
        if modules:
            r.notes.append("lora_target_linear: true covers lora_target_modules -> adapter.lora_target_modules: all-linear")
    elif isinstance(modules, str):
        adapter["lora_target_modules"] = "all-linear" if modules == "all-linear" else [modules]
    elif modules:
        adapter["lora_target_modules"] = [str(m) for m in modules]
    to_save = r.take("lora_modules_to_save")
    if to_save:
        adapter["lora_modules_to_save"] = [str(m) for m in to_save]
    if r.take("peft_use_rslora") is True:
        adapter["use_rslora"] = True

    # ----------------------------------------------------------------------------------------------
    # training, optimizer
    return kind


def _quantization(r: _Reader, model: dict[str, Any], kind: str | None, distributed: dict[str, Any]) -> None:
    """``adapter: qlora`` / ``load_in_4bit`` -> ``model.quantize: nf4`` (hone's QLoRA: torchao's
    NF4 with double-quantized scales, compute in model.dtype), except where hone cannot run it:
    a full fine-tune, or FSDP2 (hone does not shard a 4-bit base)."""
    four = r.take("load_in_4bit") is True
    bnb = r.take("bnb_config_kwargs") or {}
    if four and kind not in ("lora", "qlora"):
        r.untranslated.append(
            Untranslated("load_in_4bit", "a 4-bit base trains only under LoRA (QLoRA); this full fine-tune loads in model.dtype")
        )
    if not (kind == "qlora" or (four and kind == "lora")):
        if bnb:
            r.untranslated.append(Untranslated("bnb_config_kwargs", "no 4-bit base in this config"))
        return
    quant_type = str(bnb.get("bnb_4bit_quant_type", "nf4"))
    others = sorted(k for k in bnb if k not in ("bnb_4bit_quant_type", "bnb_4bit_use_double_quant", "bnb_4bit_compute_dtype"))
    if quant_type != "nf4" or others or bnb.get("bnb_4bit_use_double_quant") is False:
        r.untranslated.append(
            Untranslated(
                "bnb_config_kwargs",
                "hone's 4-bit base is NF4 with double-quantized scales, computing in model.dtype; "
                "other bitsandbytes settings do not apply",
            )
        )
    if distributed.get("strategy") == "fsdp":
        r.notes.append(
            "adapter: qlora with FSDP -> adapter.type: lora on a base in model.dtype: hone does not shard a 4-bit "
            "base (for QLoRA on several GPUs use distributed.strategy: ddp with model.quantize: nf4)"
        )
        return
    model["quantize"] = "nf4"
    r.notes.append(
        "adapter: qlora -> adapter.type: lora with model.quantize: nf4 "
        "(torchao's NF4, double-quantized scales; pip install 'hone[quant]')"
    )


def _text_fields(r: _Reader, names: dict[str, str]) -> dict[str, Any]:
    """Axolotl keys -> hone field names, for the keys set (as text)."""
    fields: dict[str, Any] = {}
    for key, name in names.items():
        value = r.take(key)
        if not _asks_nothing(value):
            fields[name] = str(value)
    return fields


def _trackers(r: _Reader, logging: dict[str, Any]) -> None:
    """Axolotl's W&B and MLflow keys -> ``logging.trackers`` and their sections (TensorBoard,
    hone's default tracker, stays on beside them)."""
    trackers: list[str] = []
    wandb = _text_fields(r, {"wandb_project": "project", "wandb_entity": "entity", "wandb_name": "name"})
    mode, use_wandb = r.take("wandb_mode"), r.take("use_wandb")
    if mode in ("online", "offline"):
        wandb["mode"] = mode
    if (use_wandb is True or "project" in wandb) and use_wandb is not False and mode != "disabled":
        trackers.append("wandb")
        logging["wandb"] = wandb
    mlflow = _text_fields(
        r, {"mlflow_tracking_uri": "tracking_uri", "mlflow_experiment_name": "experiment", "mlflow_run_name": "run_name"}
    )
    use_mlflow = r.take("use_mlflow")
    if (use_mlflow is True or "tracking_uri" in mlflow) and use_mlflow is not False:
        trackers.append("mlflow")
        logging["mlflow"] = mlflow
    if trackers:
        logging["trackers"] = ["tensorboard", *trackers]
        extras = " ".join(f"'hone[{t}]'" for t in trackers)
        r.notes.append(f"{', '.join(trackers)} -> logging.trackers: [tensorboard, {', '.join(trackers)}] (pip install {extras})")


def _training(r: _Reader, training: dict[str, Any], has_eval: bool) -> None:
    r.number("micro_batch_size", training, "micro_batch_size", integer=True)
    r.number("gradient_accumulation_steps", training, "gradient_accumulation_steps", integer=True)
    if r.has("max_steps"):
        r.number("max_steps", training, "max_steps", integer=True)
        r.drop("num_epochs", "max_steps is set and decides the run length")
    else:
        r.take("max_steps")
        r.number("num_epochs", training, "num_epochs")
    r.number("max_grad_norm", training, "max_grad_norm")
    if training.get("max_grad_norm") == 0:
        training["max_grad_norm"] = None  # HF's 0 = no clipping
    _cadence(r, training, "save")
    r.number("save_total_limit", training, "save_total_limit", integer=True)
    if has_eval:
        _cadence(r, training, "eval")
    else:
        for key in ("eval_steps", "evals_per_epoch"):
            r.drop(key, "there is no eval data (val_set_size is 0 and no test_datasets)")
        if r.left.get("eval_strategy") in ("steps", "epoch"):
            r.take("eval_strategy")
    r.number("seed", training, "seed", integer=True)
    out = r.take("output_dir")
    if out:
        training["output_dir"] = str(out)
    resume = r.take("resume_from_checkpoint")
    if resume:
        training["resume"] = str(resume)
    if r.take("auto_resume_from_checkpoints") is True and "resume" not in training:
        training["resume"] = "latest"


def _cadence(r: _Reader, training: dict[str, Any], what: str) -> None:
    """``save_steps`` / ``saves_per_epoch`` / ``save_strategy`` (and the eval ones) -> hone's one
    cadence: steps win over per-epoch (hone takes one of the two), ``*_strategy: epoch`` is once
    an epoch, ``steps`` is what the numbers say."""
    steps, per_epoch, strategy = f"{what}_steps", f"{what}s_per_epoch", f"{what}_strategy"
    if r.has(steps):
        r.number(steps, training, steps, integer=True)
        r.drop(per_epoch, f"{steps} is set; hone takes one of the two")
    else:
        r.take(steps)
        r.number(per_epoch, training, per_epoch, integer=True)
    mode = r.left.get(strategy)
    if mode == "steps":
        r.take(strategy)
    elif mode == "epoch":
        r.take(strategy)
        if steps not in training and per_epoch not in training:
            training[per_epoch] = 1
            r.notes.append(f"{strategy}: epoch -> training.{per_epoch}: 1")


_SCHEDULERS = {"cosine": "cosine", "linear": "linear", "constant": "constant", "constant_with_warmup": "constant"}


def _optimizer(r: _Reader, optimizer: dict[str, Any]) -> None:
    name = r.take("optimizer")
    if name in OPTIMIZERS:
        hone_name, note = OPTIMIZERS[name]
        if hone_name != "adamw":
            optimizer["name"] = hone_name
        if note:
            r.notes.append(f"optimizer: {name} -> optimizer.name: {hone_name} ({note})")
    elif name is not None:
        r.untranslated.append(
            Untranslated(
                "optimizer",
                f"'{name}' is not an optimizer hone has (adamw, adamw_8bit, adamw_4bit); "
                "optimizer.name: adamw (32-bit states, fused on CUDA) is used",
            )
        )
    r.number("learning_rate", optimizer, "learning_rate")
    r.number("weight_decay", optimizer, "weight_decay")
    r.number("adam_beta1", optimizer, "adam_beta1")
    r.number("adam_beta2", optimizer, "adam_beta2")
    r.number("adam_epsilon", optimizer, "adam_epsilon")
    scheduler = r.take("lr_scheduler")
    if scheduler in _SCHEDULERS:
        optimizer["lr_scheduler"] = _SCHEDULERS[scheduler]
    elif scheduler is not None:
        r.untranslated.append(
            Untranslated("lr_scheduler", f"'{scheduler}' is not a schedule hone has (constant, linear, cosine); cosine is used")
        )
    r.number("cosine_min_lr_ratio", optimizer, "cosine_min_lr_ratio")
    if r.has("warmup_steps"):
        r.number("warmup_steps", optimizer, "warmup_steps", integer=True)
        r.drop("warmup_ratio", "warmup_steps is set; hone takes one of the two")
    else:
        r.take("warmup_steps")
        r.number("warmup_ratio", optimizer, "warmup_ratio")


# ----------------------------------------------------------------------------------------------
# memory, performance, distributed, logging


def _memory(r: _Reader, memory: dict[str, Any]) -> None:
    checkpointing = r.take("gradient_checkpointing")
    offload = r.take("activation_offloading")
    if checkpointing in (True, "true"):
        policy = "full"
    elif checkpointing in ("offload", "offload_disk"):
        policy = "offload"
        if checkpointing == "offload_disk":
            r.notes.append("gradient_checkpointing: offload_disk -> offload (hone offloads to pinned host memory, not disk)")
    elif checkpointing not in (None, False):
        r.untranslated.append(
            Untranslated("gradient_checkpointing", f"'{checkpointing}' is not a checkpointing mode hone knows (true, offload)")
        )
        policy = "none"
    else:
        policy = "none"
    if offload not in (None, False):
        policy = "offload"
        r.notes.append("activation_offloading -> memory.activation_checkpointing: offload (layer inputs in pinned host memory)")
    if policy != "none":
        memory["activation_checkpointing"] = policy


def _performance(r: _Reader, performance: dict[str, Any]) -> None:
    compile_on = r.take("torch_compile")
    if compile_on in (True, "auto"):
        performance["torch_compile"] = compile_on
        backend = r.take("torch_compile_backend")
        if backend in ("inductor", "aot_eager", "eager"):
            if backend != "inductor":
                performance["torch_compile_backend"] = backend
        elif backend is not None:
            r.untranslated.append(
                Untranslated("torch_compile_backend", f"'{backend}' is not a backend hone has (inductor, aot_eager, eager)")
            )
        mode = r.take("torch_compile_mode")
        if mode in COMPILE_MODES:
            if mode != "default":
                performance["torch_compile_mode"] = mode
        elif mode is not None:
            r.untranslated.append(Untranslated("torch_compile_mode", f"'{mode}' is not one of: {', '.join(COMPILE_MODES)}"))
        options = r.take("torch_compile_options") or {}
        kept = {k: v for k, v in options.items() if k in INDUCTOR_OPTIONS and type(v) is INDUCTOR_OPTIONS[k]}
        for key in options:
            if key not in kept:
                r.untranslated.append(
                    Untranslated(f"torch_compile_options.{key}", "not an Inductor option hone allows (see docs/compile.md)")
                )
        if kept:
            performance["torch_compile_options"] = kept
    else:
        for key in ("torch_compile_backend", "torch_compile_mode", "torch_compile_options"):
            r.drop(key, "torch_compile is not on")
    fused_loss = [k for k in ("liger_fused_linear_cross_entropy", "cut_cross_entropy") if r.take(k) is True]
    if fused_loss:
        performance["loss"] = "fused_linear_ce"
        r.notes.append(
            f"{', '.join(fused_loss)} -> performance.loss: fused_linear_ce (hone's chunked loss, no [tokens x vocab] logits)"
        )
    plugins = r.left.get("plugins")
    if isinstance(plugins, list):
        rest = [p for p in plugins if not any(s in str(p) for s in ("CutCrossEntropy", "LigerPlugin"))]
        if not rest:  # the fused-loss plugins are covered by performance.loss (or ask for nothing)
            r.take("plugins")
        else:
            r.left["plugins"] = rest


def _fsdp_option(config: Mapping[str, Any], name: str) -> Any:
    """``fsdp_config`` keys come with (FSDP1 style) or without (FSDP2 style) the ``fsdp_`` prefix."""
    for key in (name, f"fsdp_{name}"):
        if key in config:
            return config[key]
    return None


def _distributed(r: _Reader, distributed: dict[str, Any]) -> None:
    fsdp = r.take("fsdp")
    config = r.take("fsdp_config") or {}
    version = r.left.get("fsdp_version")
    if fsdp or config or version:
        distributed["strategy"] = "fsdp"
        if _fsdp_option(config, "offload_params") is True:
            distributed["cpu_offload"] = True
        reshard = _fsdp_option(config, "reshard_after_forward")
        if reshard is False or (isinstance(fsdp, list) and "shard_grad_op" in fsdp):
            distributed["reshard_after_forward"] = False
        handled = {"offload_params", "reshard_after_forward"}
        quiet = {
            "auto_wrap_policy",
            "transformer_layer_cls_to_wrap",
            "version",
            "use_orig_params",
            "sync_module_states",
            "cpu_ram_efficient_loading",
        }
        for key, value in config.items():
            bare = key.removeprefix("fsdp_")
            if bare in handled:
                continue
            if bare in quiet:
                r.notes.append(f"fsdp_config.{key}: not needed (hone shards each decoder layer and the root with FSDP2)")
            elif not _asks_nothing(value):
                r.untranslated.append(
                    Untranslated(
                        f"fsdp_config.{key}",
                        "hone's FSDP2 takes only cpu_offload and reshard_after_forward (distributed section)",
                    )
                )
    deepspeed = r.left.get("deepspeed")
    if (
        isinstance(deepspeed, str)
        and "zero3" in deepspeed.replace("_", "").replace("-", "").lower()
        and "strategy" not in distributed
    ):
        r.take("deepspeed")
        distributed["strategy"] = "fsdp"
        if "offload" in deepspeed.lower():
            distributed["cpu_offload"] = True
        r.notes.append(f"deepspeed: {deepspeed} (ZeRO-3) -> distributed.strategy: fsdp (PyTorch FSDP2)")


def _logging(r: _Reader, logging: dict[str, Any]) -> None:
    r.number("logging_steps", logging, "logging_steps", integer=True)


# ----------------------------------------------------------------------------------------------


#: ``plugins`` entries (matched in their dotted class path) that change the training objective.
_OBJECTIVE_PLUGINS = {
    "diffusion": "a diffusion language model (masked-token denoising), not next-token prediction",
    ".kd.": "knowledge distillation from a teacher's logits, not the language-modelling loss on the data",
}
_CLASSIFIER = re.compile(r"For(Sequence|Token)Classification$|ForQuestionAnswering$")


def refusals(raw: Mapping[str, Any]) -> list[str]:
    """Why hone cannot train what this config trains (``key: value: why``); empty when it can."""
    out: list[str] = []
    rl = rl_refusal(raw)
    if rl is not None:
        out.append(rl)
    for key in ("reward_model", "process_reward_model"):
        if raw.get(key) is True:
            out.append(f"{key}: true: a reward model (a scalar score head); hone trains causal language models")
    model_type = raw.get("model_type")
    if isinstance(model_type, str) and _CLASSIFIER.search(model_type):
        out.append(f"model_type: {model_type}: a classification head; hone trains causal language models")
    processor = raw.get("processor_type")
    if not _asks_nothing(processor):
        out.append(
            f"processor_type: {processor}: a multimodal model (images or audio through a processor); hone trains on "
            "text only, and dropping the processor would train a text-only run"
        )
    plugins = raw.get("plugins")
    for plugin in plugins if isinstance(plugins, list) else []:
        for marker, why in _OBJECTIVE_PLUGINS.items():
            if marker in str(plugin).lower():
                out.append(f"plugins: {plugin}: {why}")
    return out


def convert_axolotl(raw: Mapping[str, Any]) -> Conversion:
    """Translate a parsed Axolotl config into a hone config mapping.

    Returns the mapping (sections in hone's order, empty sections left out), every Axolotl key
    it could not translate with the reason, and notes on keys translated with a change of
    meaning. Does not validate: run :func:`hone.config.parse_config` on the result.

    Raises :class:`ConversionRefused` when the config trains another objective or modality
    (:func:`refusals`), or when none of its training datasets converts.
    """
    refused = refusals(raw)
    if refused:
        raise ConversionRefused(
            "hone convert refuses this config: it trains something hone does not, and converting it would "
            f"train something else: {'; '.join(refused)}"
        )
    r = _Reader(raw)
    untranslated: list[Untranslated] = []
    notes: list[str] = []
    sections: dict[str, dict[str, Any]] = {name: {} for name in _SECTION_ORDER}
    _model(r, sections["model"])
    _attention(r, sections["model"])
    preference = not _asks_nothing(raw.get("rl"))
    _data(r, sections["data"], untranslated, notes, preference)
    kind = _adapter(r, sections["adapter"])
    data = sections["data"]
    has_eval = bool(data.get("val_set_size")) or bool(data.get("test_datasets"))
    if preference:
        translated = objective(r.left)
        sections["training"].update(translated.values)
        untranslated.extend(Untranslated(key, reason) for key, reason in translated.lost)
        notes.extend(translated.notes)
    _training(r, sections["training"], has_eval)
    _optimizer(r, sections["optimizer"])
    _memory(r, sections["memory"])
    _performance(r, sections["performance"])
    _distributed(r, sections["distributed"])
    _quantization(r, sections["model"], kind, sections["distributed"])
    _logging(r, sections["logging"])
    _trackers(r, sections["logging"])
    r.finish("not an Axolotl key hone knows how to translate")
    untranslated.extend(r.untranslated)
    notes.extend(r.notes)
    config = {name: section for name, section in sections.items() if section or name in ("model", "data")}
    return Conversion(config=config, untranslated=untranslated, notes=notes)


class _Dumper(yaml.SafeDumper):
    """Safe YAML with multi-line strings (chat templates) as literal blocks."""


def _str_representer(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str_representer)


def render_conversion(conversion: Conversion, source: str) -> str:
    """The hone YAML, headed by a comment block listing untranslated keys and notes."""
    lines = [f"# hone config converted from the Axolotl config {source} by `hone convert`."]
    if conversion.untranslated:
        lines.append("#")
        lines.append(f"# Not translated ({len(conversion.untranslated)}):")
        for item in conversion.untranslated:
            lines.append(f"#   {item.key}: {item.reason}")
    if conversion.notes:
        lines.append("#")
        lines.append("# Notes:")
        lines.extend(f"#   {note}" for note in conversion.notes)
    body = yaml.dump(conversion.config, Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=100)
    return "\n".join(lines) + "\n\n" + body
