"""Generate text with a finished run: load it back (:mod:`hone.export.load`), wrap the prompt
as training did, decode.
"""

import torch
from torch import nn
from transformers import GenerationConfig

from hone.data.formats import ALPACA_PROMPT  # the data pipeline's own: byte-for-byte what was trained
from hone.export.load import PromptSetup, load_for_inference, prompt_setup, setup_of
from hone.models.errors import ModelError


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
    check_sampling(max_new_tokens, temperature, top_p)
    if chat is None:
        setup = setup_of(model) or PromptSetup("raw")
    else:
        run_setup = setup_of(model)
        setup = PromptSetup("chat", run_setup.chat_template if run_setup else None) if chat else PromptSetup("raw")
    text, add_special = format_prompt(tokenizer, prompt, setup)
    return complete(
        model, tokenizer, text, add_special, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed
    )


def check_sampling(max_new_tokens: int, temperature: float, top_p: float) -> None:
    """Refuse sampling settings ``generate`` cannot honour (shared with ``hone chat``)."""
    if max_new_tokens < 1:
        raise ModelError(f"max_new_tokens: {max_new_tokens} must be at least 1")
    if temperature < 0:
        raise ModelError(f"temperature: {temperature} must be >= 0 (0 = greedy)")
    if not 0 < top_p <= 1:
        raise ModelError(f"top_p: {top_p} must be in (0, 1]")


def complete(
    model: nn.Module,
    tokenizer,
    text: str,
    add_special_tokens: bool,
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    seed: int | None = None,
    streamer=None,
) -> str:
    """Continue already-formatted ``text`` and return the new text only. ``streamer`` (a
    transformers streamer: ``put``/``end``) receives the tokens as they are generated."""
    device = next(model.parameters()).device
    inputs = tokenizer(text, return_tensors="pt", add_special_tokens=add_special_tokens).to(device)
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
                output = model.generate(**inputs, generation_config=GenerationConfig(**options), streamer=streamer)
    finally:
        model.train(was_training)
    new_tokens = output[0, inputs["input_ids"].shape[1] :]
    return tokenizer.decode(new_tokens, skip_special_tokens=True)


__all__ = ["generate", "complete", "check_sampling", "load_for_inference", "format_prompt", "prompt_setup", "PromptSetup"]
