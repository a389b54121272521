"""Load the model a run trains: from a local directory or a preset, adapted, ready to train.

The steps run in a fixed order, each a small function: build or load the base model in the
dtype of :mod:`hone.models.precision`, hand it to the caller's ``before_adapter`` step (the
plan's base-model transforms), apply the adapter, cast the trainable weights to their master
dtype, switch to train mode. The loader applies no optimization itself: attention kernels,
checkpointing and compilation are transforms of the plan (:mod:`hone.transforms.planner`).
"""

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel

from hone.config import HoneConfig
from hone.config.adapter import AdapterConfig
from hone.config.model import ModelConfig
from hone.models.adapters import apply_adapter, record_base_model
from hone.models.attention.sinks import sink_backend_for
from hone.models.errors import ModelError
from hone.models.experts.mxfp4 import has_mxfp4_experts, quant_method
from hone.models.hub import base_model_reference, local_model_dir
from hone.models.materialize import AsDrawn, build_skeleton, materialize
from hone.models.model_dir import check_model_dir, read_causal_lm_config
from hone.models.precision import Precision, cast_trainable, precision_for
from hone.models.preset_init import apply_preset_init
from hone.models.presets import build_preset_config, get_preset
from hone.models.rope_scaling import with_rope_scaling


@dataclass
class LoadedModel:
    model: nn.Module
    """A ``PreTrainedModel`` (full fine-tune) or a ``PeftModel`` wrapping one (LoRA)."""

    trainable_params: int
    total_params: int
    description: str
    """One line for the console and the run log."""

    precision: Precision
    """Dtypes of compute, frozen and trainable weights."""

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """The training loop runs the forward under ``torch.autocast(device_type, dtype)`` when
        this is set (trainable weights are float32 while compute is bf16/fp16)."""
        return self.precision.autocast_dtype


def load_model(
    cfg: HoneConfig,
    tokenizer,
    device: torch.device | str,
    before_adapter: Callable[[PreTrainedModel], object] | None = None,
    as_drawn: AsDrawn | None = None,
) -> LoadedModel:
    """The model of ``cfg`` on ``device``, with its adapter, in train mode.

    ``before_adapter(base)`` runs on the base model before the adapter is attached (the plan's
    base-stage transforms, e.g. the attention kernel); ``as_drawn``: the plan's replacement of
    each module of a big preset as it is drawn (:meth:`hone.transforms.planner.Plan.as_drawn`)."""
    device = torch.device(device)
    precision = precision_for(cfg.model.dtype, full_finetune=not cfg.adapter.is_lora)
    # A quantized base (model.quantize) never sits whole on the device in full precision: a big
    # preset is drawn on the device one module at a time and the plan quantizes each linear layer
    # as soon as it is drawn (as_drawn); a tiny preset or a model directory is built on the CPU and
    # the plan's quantize transform moves one full-precision layer at a time to the device.
    quantized_as_drawn = as_drawn is not None and drawn_on_device(cfg.model)
    build_on = torch.device("cpu") if cfg.model.quantize != "none" and not quantized_as_drawn else device
    base = build_base_model(cfg.model, tokenizer, build_on, precision.weights, seed=cfg.training.seed, as_drawn=as_drawn)
    if before_adapter is not None:
        before_adapter(base)
    if has_mxfp4_experts(base):
        from hone.models.mxfp4_checkpoint import check_mxfp4_run

        check_mxfp4_run(base, full_finetune=not cfg.adapter.is_lora)
    with seeded(seed=cfg.training.seed + 1, device=build_on):  # new adapter weights, own stream
        model = apply_adapter(base, cfg.adapter)
    if cfg.model.path is not None:  # final/adapter_config.json names the base usably from anywhere
        record_base_model(model, *base_model_reference(cfg.model.path))
    if build_on != device:  # the rest: embedding, norms, head, adapter weights
        model.to(device)
    cast_trainable(model, precision.trainable)
    model.train()
    trainable, total = count_parameters(model)
    description = describe(base, cfg, precision, trainable, total)
    return LoadedModel(model, trainable, total, description, precision)


def build_base_model(
    model_cfg: ModelConfig, tokenizer, device: torch.device, dtype: torch.dtype, seed: int, as_drawn: AsDrawn | None = None
) -> PreTrainedModel:
    """The base model, frozen-or-not as transformers leaves it, in ``dtype`` on ``device``.

    Also used by generation and merging: a preset rebuilt with the run's seed gives exactly the
    random weights the run trained on. ``as_drawn`` (a big preset only): given the meta skeleton,
    the replacement of each module as soon as it is drawn (the plan's: e.g. a linear layer made
    4-bit), from the same draws as without it; an MXFP4 checkpoint applies it to its experts
    modules before reading them (expert parallelism: each rank reads its block); other sources
    come as they are.
    """
    if model_cfg.preset is not None:
        model = build_preset_model(model_cfg, tokenizer, device, dtype, seed, as_drawn=as_drawn)
    else:
        model = load_pretrained(local_model_dir(model_cfg.path), model_cfg, device, dtype, as_drawn=as_drawn)
    check_vocab_fits(model, tokenizer, model_cfg)
    return model


def build_preset_model(
    model_cfg: ModelConfig, tokenizer, device: torch.device, dtype: torch.dtype, seed: int, as_drawn: AsDrawn | None = None
) -> PreTrainedModel:
    """Random weights drawn from ``seed``, without touching the caller's random state.

    Tiny presets: built on the CPU in float32, so the weights are the same on every machine and
    dtype. Big presets: drawn where they will live, in their dtype, one module at a time from a
    meta-device skeleton (:mod:`hone.models.materialize`), or an 8B model spends minutes
    initialising on the CPU; ``as_drawn(skeleton)`` replaces each module as soon as it is drawn
    (a quantized base: the full-precision model never exists whole)."""
    preset = get_preset(model_cfg.preset)
    config = build_preset_config(model_cfg.preset, dict(model_cfg.preset_overrides), len(tokenizer))
    with_rope_scaling(config, model_cfg.rope_scaling)
    for attr in ("pad_token_id", "bos_token_id", "eos_token_id"):
        setattr(config, attr, getattr(tokenizer, attr, None))
    attn = sink_backend_for(config, model_cfg.attn_implementation)
    if preset.tiny:
        cpu = torch.device("cpu")
        with seeded(seed, cpu), cpu:
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attn)
    else:
        skeleton = build_skeleton(config, dtype, attn_implementation=attn)
        with seeded(seed, device):
            model = materialize(skeleton, device, as_drawn(skeleton) if as_drawn is not None else None)
    apply_preset_init(model, model_cfg.preset_init)
    cast_parameters(model, dtype)
    return model.to(device)


def drawn_on_device(model_cfg: ModelConfig) -> bool:
    """Whether :func:`build_base_model` draws the base on the device it is asked for (a big
    preset), rather than building it on the CPU (a tiny preset) or reading it from files."""
    return model_cfg.preset is not None and not get_preset(model_cfg.preset).tiny


@contextmanager
def seeded(seed: int, device: torch.device) -> Iterator[None]:
    """Draw from ``seed`` inside the block, then give the caller its random state back, so
    loading a model never shifts the data order or dropout of the run."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        yield


def load_pretrained(
    path: Path,
    model_cfg: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    key: str = "model.path",
    as_drawn: AsDrawn | None = None,
) -> PreTrainedModel:
    """A causal LM from a local save_pretrained directory (safetensors only, no network).

    A checkpoint that ships its experts in MXFP4 (gpt-oss) keeps them so
    (:mod:`hone.models.mxfp4_checkpoint`; ``as_drawn``: the plan's hook for its experts modules,
    applied before they are read: under expert parallelism each rank reads its block only); one
    quantized otherwise is refused with what hone loads."""
    check_model_dir(path, key)
    config = with_rope_scaling(read_causal_lm_config(path, model_cfg.trust_remote_code, key), model_cfg.rope_scaling)
    if quant_method(config) is not None:  # mxfp4: reading the config refused every other method
        from hone.models.mxfp4_checkpoint import load_mxfp4_pretrained

        return load_mxfp4_pretrained(path, config, model_cfg, device, dtype, key, as_drawn=as_drawn)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            str(path),
            config=config,
            local_files_only=True,
            use_safetensors=True,
            trust_remote_code=model_cfg.trust_remote_code,
            dtype=dtype,
            attn_implementation=sink_backend_for(config, model_cfg.attn_implementation),
            device_map=device,
            output_loading_info=True,
        )
    except (OSError, ValueError, RuntimeError) as exc:
        raise ModelError(f"{key}: cannot load the model in '{path}': {exc}") from None
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ModelError(
            f"{key}: the weights in '{path}' lack {len(missing)} tensor(s) the model needs ({shown}); "
            "they would start from random values. Is the directory complete?"
        )
    return model


def check_vocab_fits(model: PreTrainedModel, tokenizer, model_cfg: ModelConfig) -> None:
    rows = model.get_input_embeddings().weight.shape[0]
    if rows < len(tokenizer):
        tok = model_cfg.tokenizer_path or model_cfg.path or "the bundled tokenizer"
        raise ModelError(
            f"model: the tokenizer ({tok}) has {len(tokenizer)} tokens but the model's embedding "
            f"has only {rows} rows; token ids past {rows - 1} would index out of range. Use the "
            "tokenizer the model was trained with"
        )


def cast_parameters(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast floating-point parameters only: buffers such as RoPE's ``inv_freq`` stay float32,
    which ``model.to(dtype)`` would round to bf16 and so shift every position's rotation."""
    for param in model.parameters():
        if param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts; tied weights count once."""
    trainable = total = 0
    for param in model.parameters():
        total += param.numel()
        if param.requires_grad:
            trainable += param.numel()
    return trainable, total


def format_count(n: int) -> str:
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.2f}{suffix}"
    return str(n)


def describe_adapter(adapter_cfg: AdapterConfig) -> str:
    if not adapter_cfg.is_lora:
        return "full fine-tune"
    targets = adapter_cfg.lora_target_modules
    text = f"LoRA r={adapter_cfg.lora_r} alpha={adapter_cfg.lora_alpha:g}"
    if adapter_cfg.use_rslora:
        text += " (rslora)"
    text += f" on {targets if isinstance(targets, str) else ','.join(targets)}"
    if adapter_cfg.lora_modules_to_save:
        text += f" + full {','.join(adapter_cfg.lora_modules_to_save)}"
    return text


def describe(base: PreTrainedModel, cfg: HoneConfig, precision: Precision, trainable: int, total: int) -> str:
    def name(dtype: torch.dtype) -> str:
        return str(dtype).removeprefix("torch.")

    dtypes = f"weights {name(precision.weights)}"
    if precision.trainable != precision.weights:
        dtypes += f", trainable {name(precision.trainable)}"
    if precision.autocast_dtype is not None:
        dtypes += f", autocast {name(precision.autocast_dtype)}"
    parts = [
        f"{type(base).__name__} ({cfg.model.source})",
        f"{format_count(total)} params, {format_count(trainable)} trainable ({100 * trainable / max(total, 1):.2f}%)",
        describe_adapter(cfg.adapter),
        dtypes,
    ]
    return " | ".join(parts)
