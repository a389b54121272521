"""Load a finished run back for inference: the trained model, its tokenizer, and how its
training data wrapped prompts (so ``generate`` wraps them the same way).

A LoRA run's base model is rebuilt exactly as training built it (a preset from the run's seed,
in the run's weight dtype; or the same local directory), then its adapter is loaded on top. A
QLoRA run's (``model.quantize: nf4``) base is read in full precision and every weight training
held in 4 bits is replaced by its NF4 round trip (quantized and dequantized by the same code):
the adapter was trained against those weights, not the original ones. MXFP4 experts (a gpt-oss
checkpoint as shipped, or ``model.quantize: mxfp4``) are dequantized the same way, to the exact
values the experts kernels computed with.
Its own module so that ``generate`` and ``merge`` both build on it without importing each other.
"""

import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from peft import PeftModel
from torch import nn
from transformers import AutoTokenizer

from hone.config import HoneConfig
from hone.data.chat_templates import named_template
from hone.export.run_dir import Run, read_run
from hone.models.errors import ModelError
from hone.models.experts.mxfp4 import dequantize_model_experts
from hone.models.experts.mxfp4_quantize import quantize_model_experts
from hone.models.loader import build_base_model, cast_parameters, load_pretrained
from hone.models.precision import DTYPES, precision_for
from hone.train.device import resolve_device

PromptStyle = Literal["raw", "chat", "alpaca"]


@dataclass(frozen=True)
class PromptSetup:
    """How the run's training data was wrapped, so ``generate`` can wrap prompts the same way."""

    style: PromptStyle
    chat_template: str | None = None


#: Prompt setup of each model returned by :func:`load_for_inference` (weak: models are freed).
_SETUPS: "weakref.WeakKeyDictionary[nn.Module, PromptSetup]" = weakref.WeakKeyDictionary()


def prompt_setup(cfg: HoneConfig) -> PromptSetup:
    """Chat if every training dataset was chat, Alpaca if every one was Alpaca, else raw text."""
    kinds = {dataset.type for dataset in cfg.data.datasets}
    if kinds == {"chat"}:
        template = cfg.data.chat_template
        return PromptSetup("chat", None if template is None else named_template(template) or template)
    if kinds == {"alpaca"}:
        return PromptSetup("alpaca")
    return PromptSetup("raw")


def load_for_inference(
    run_dir: Path, device: torch.device | str | None = None, dtype: str | None = None
) -> tuple[nn.Module, object]:
    """The trained model of ``run_dir`` (eval mode, on ``device``) and its tokenizer.

    ``dtype`` (``float32``, ``bfloat16``, ``float16``) defaults to the run's ``model.dtype``.
    A LoRA run's base is built as training built it, then cast: a preset is drawn from the
    run's seed (tiny presets on the CPU, so any machine gets the same weights; big presets on
    ``device``, so only the same kind of device reproduces them).
    """
    run = read_run(Path(run_dir))
    cfg = run.cfg
    device = resolve_device(device)
    if dtype is not None and dtype not in DTYPES:
        raise ModelError(f"dtype: '{dtype}' is not one of: {', '.join(DTYPES)}")
    target = DTYPES[dtype or cfg.model.dtype]
    tokenizer = load_run_tokenizer(run)
    if run.is_adapter:
        trained_dtype = precision_for(cfg.model.dtype, full_finetune=False).weights
        # QLoRA: the same draws as training's (which quantized each layer as it was drawn), in full
        # precision, then every 4-bit weight is replaced by its NF4 round trip
        base = build_base_model(cfg.model, tokenizer, device, trained_dtype, seed=cfg.training.seed)
        if cfg.model.quantize == "mxfp4":  # the experts training held in MXFP4: their round trip
            quantize_model_experts(base, device)
        elif cfg.model.quantize != "none":
            from hone.models.nf4 import nf4_roundtrip_

            nf4_roundtrip_(base, trained_dtype)
        # MXFP4 experts (a checkpoint that ships them so, or the round trip above) become ordinary
        # weights holding exactly the values training computed with, so PEFT applies and merges the
        # expert LoRA on them and transformers' own experts run them
        dequantize_model_experts(base, trained_dtype)
        model: nn.Module = PeftModel.from_pretrained(base, str(run.final), is_trainable=False)
    else:
        model = load_pretrained(run.final, cfg.model, device, target, key=f"{run.directory}/final")
    cast_parameters(model, target)
    model.eval()
    _SETUPS[model] = prompt_setup(cfg)
    return model, tokenizer


def load_run_tokenizer(run: Run):
    """The tokenizer saved with the final output; else the one the config names."""
    if (run.final / "tokenizer_config.json").is_file() or (run.final / "tokenizer.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(run.final), local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ModelError(f"cannot load the tokenizer saved in '{run.final}': {exc}") from None
    from hone.models.tokenizer import load_tokenizer

    return load_tokenizer(run.cfg.model)


def setup_of(model: nn.Module) -> PromptSetup | None:
    """The prompt setup of a model returned by :func:`load_for_inference` (None for others)."""
    return _SETUPS.get(model)
