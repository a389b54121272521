"""Generate text with a finished run: load it back, wrap the prompt as training did, decode.

A LoRA run's base model is rebuilt exactly as training built it (a preset from the run's seed,
in the run's weight dtype; or the same local directory), then its adapter is loaded on top.
"""

import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from peft import PeftModel
from torch import nn
from transformers import AutoTokenizer, GenerationConfig

from hone.config import HoneConfig
from hone.data.formats import ALPACA_PROMPT  # the data pipeline's own: byte-for-byte what was trained
from hone.export.run_dir import Run, read_run
from hone.models.errors import ModelError
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
        return PromptSetup("chat", cfg.data.chat_template)
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
        base = build_base_model(cfg.model, tokenizer, device, trained_dtype, seed=cfg.training.seed)
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


def format_prompt(tokenizer, prompt: str, setup: PromptSetup) -> tuple[str, bool]:
    """The text to feed the model, and whether the tokenizer should add its special tokens:
    as ``hone.data`` renders training rows (a chat template writes its own BOS; Alpaca and raw
    text get the tokenizer's)."""
    if setup.style == "chat":
        template = setup.chat_template or getattr(tokenizer, "chat_template", None)
        if not template:
            raise ModelError(
                "chat generation needs a chat template, and the tokenizer has none (set "
                "data.chat_template in the run's config, or generate without --chat)"
            )
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], chat_template=template, tokenize=False, add_generation_prompt=True
        )
        return text, False
    if setup.style == "alpaca":
        return ALPACA_PROMPT.format(instruction=prompt), True
    return prompt, True


def generate(
    model: nn.Module,
    tokenizer,
    prompt: str,
    *,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_p: float = 1.0,
    chat: bool | None = None,
    seed: int | None = None,
) -> str:
    """Complete ``prompt`` and return only the new text.

    ``temperature == 0`` decodes greedily; above 0 it samples (nucleus ``top_p``), reproducibly
    when ``seed`` is given. ``chat``: True wraps the prompt in the chat template, False feeds it
    as is, None wraps it as the run's training data was (chat template, Alpaca or raw).
    """
    if max_new_tokens < 1:
        raise ModelError(f"max_new_tokens: {max_new_tokens} must be at least 1")
    if temperature < 0:
        raise ModelError(f"temperature: {temperature} must be >= 0 (0 = greedy)")
    if not 0 < top_p <= 1:
        raise ModelError(f"top_p: {top_p} must be in (0, 1]")
    if chat is None:
        setup = _SETUPS.get(model, PromptSetup("raw"))
    else:
        run_setup = _SETUPS.get(model)
        setup = PromptSetup("chat", run_setup.chat_template if run_setup else None) if chat else PromptSetup("raw")
    text, add_special = format_prompt(tokenizer, prompt, setup)
    device = next(model.parameters()).device
    inputs = tokenizer(text, return_tensors="pt", add_special_tokens=add_special).to(device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    options: dict = dict(max_new_tokens=max_new_tokens, do_sample=temperature > 0, pad_token_id=pad)
    if tokenizer.eos_token_id is not None:
        options["eos_token_id"] = tokenizer.eos_token_id
    if temperature > 0:
        options.update(temperature=temperature, top_p=top_p, top_k=0)
    was_training = model.training
    model.eval()
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            if seed is not None:
                torch.manual_seed(seed)
            with torch.no_grad():
                output = model.generate(**inputs, generation_config=GenerationConfig(**options))
    finally:
        model.train(was_training)
    new_tokens = output[0, inputs["input_ids"].shape[1] :]
    return tokenizer.decode(new_tokens, skip_special_tokens=True)


# ``hone merge`` lives in its own module; re-exported because the CLI imports it from here.
from hone.export.merge import merge_adapter  # noqa: E402

__all__ = ["generate", "load_for_inference", "merge_adapter", "format_prompt", "prompt_setup"]
