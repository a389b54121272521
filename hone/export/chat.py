"""``hone chat``: talk to a finished run (or a model directory) in the terminal.

Each user line joins the conversation so far; the whole history is rendered with the run's chat
template (the one its training data used) and the reply streams out token by token. The loop
reads and writes plain text streams, so tests drive it through stdin exactly as a user would.
"""

from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import torch
from torch import nn
from transformers.generation.streamers import BaseStreamer

from hone.export.generate import check_sampling, complete, format_prompt
from hone.export.load import PromptSetup, load_for_inference, setup_of
from hone.models.errors import ModelError
from hone.run_files import CONFIG_FILE

RESET = "/reset"
EXIT = ("/exit", "/quit")
HELP = "/help"
COMMANDS_HELP = f"{RESET}: start a new conversation; {EXIT[0]} (or {EXIT[1]}, Ctrl-D): quit; {HELP}: this list"


def is_unknown_command(message: str) -> bool:
    """A line that looks like a command (``/word``) but is none of ours: shown the list, never
    sent to the model (a mistyped ``/exti`` would otherwise become a turn of the conversation).
    A line starting with ``//`` is sent as text without its first ``/``; a ``/`` followed by a
    space or nothing word-like (``/ 2``) is text too."""
    if not message.startswith("/") or message in (RESET, HELP, *EXIT):
        return False
    return message[1:2].isalpha()


class TextOut(BaseStreamer):
    """A transformers streamer that writes each newly decoded piece of the reply to ``out``.

    ``generate`` calls ``put`` first with the prompt (skipped), then with every new token. The
    reply so far is decoded as a whole each time, so tokens that only make sense together
    (multi-byte characters split over tokens, leading-space markers) come out right; text that
    ends in an unfinished character waits for the next token.
    """

    def __init__(self, tokenizer, out: TextIO) -> None:
        self.tokenizer = tokenizer
        self.out = out
        self.ids: list[int] = []
        self.shown = 0
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.ids.extend(int(i) for i in value.reshape(-1).tolist())
        self._flush(final=False)

    def end(self) -> None:
        self._flush(final=True)

    def _flush(self, final: bool) -> None:
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if not final and text.endswith("\ufffd"):
            return
        if len(text) > self.shown:
            self.out.write(text[self.shown :])
            self.out.flush()
            self.shown = len(text)


@dataclass
class Conversation:
    """The messages so far (the system message, if any, is kept through ``/reset``)."""

    system: str | None = None
    turns: list[dict[str, str]] = field(default_factory=list)

    def messages(self) -> list[dict[str, str]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.turns

    def reset(self) -> None:
        self.turns.clear()


def load_chat_model(
    path: Path, device: "str | torch.device | None" = None, dtype: str | None = None
) -> tuple[nn.Module, object, PromptSetup]:
    """The model, tokenizer and prompt setup for ``path``: a run directory (``config.yml`` +
    ``final/``) or a plain model directory (``save_pretrained`` layout, its tokenizer beside it)."""
    path = Path(path)
    if path.is_dir() and not (path / CONFIG_FILE).is_file() and not (path / "config.json").is_file():
        raise ModelError(
            f"'{path}' is neither a run directory ({CONFIG_FILE}, written by hone train) nor a model "
            "directory (config.json, written by save_pretrained)"
        )
    if (path / CONFIG_FILE).is_file() or not path.is_dir():
        model, tokenizer = load_for_inference(path, device=device, dtype=dtype)
        return model, tokenizer, setup_of(model) or PromptSetup("raw")
    from hone.config.model import ModelConfig
    from hone.models.experts.mxfp4 import dequantize_model_experts
    from hone.models.loader import load_pretrained
    from hone.models.precision import DTYPES
    from hone.models.tokenizer import load_tokenizer
    from hone.train.device import resolve_device

    resolved = resolve_device(device)
    chosen = dtype or ("bfloat16" if resolved.type == "cuda" else "float32")
    model_cfg = ModelConfig(path=path, dtype=chosen)
    tokenizer = load_tokenizer(model_cfg)
    model = load_pretrained(path, model_cfg, resolved, DTYPES[chosen])
    dequantize_model_experts(model, DTYPES[chosen])  # MXFP4 experts (gpt-oss as shipped): transformers' experts run them
    model.eval()
    style = "chat" if getattr(tokenizer, "chat_template", None) else "raw"
    return model, tokenizer, PromptSetup(style)


def render(tokenizer, setup: PromptSetup, conversation: Conversation) -> tuple[str, bool]:
    """The text to continue for the conversation so far, and whether to add special tokens.

    Chat runs render the whole history with their template. A run trained on Alpaca or raw
    text has no notion of turns: only the last message is wrapped, as ``hone generate`` does.
    """
    if setup.style == "chat":
        template = setup.chat_template or getattr(tokenizer, "chat_template", None)
        if not template:
            raise ModelError(
                "hone chat needs a chat template and the tokenizer has none (set data.chat_template in the run's config)"
            )
        text = tokenizer.apply_chat_template(
            conversation.messages(), chat_template=template, tokenize=False, add_generation_prompt=True
        )
        return text, False
    return format_prompt(tokenizer, conversation.turns[-1]["content"], setup)


def _fit_context(
    model: nn.Module, tokenizer, setup: PromptSetup, conversation: Conversation, max_new_tokens: int
) -> tuple[str, bool, int]:
    """Render, dropping the oldest exchanges while the prompt and reply would pass the model's
    context length; returns the text, add_special and how many exchanges were dropped."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    dropped = 0
    while True:
        text, add_special = render(tokenizer, setup, conversation)
        n = len(tokenizer(text, add_special_tokens=add_special)["input_ids"])
        if limit is None or n + max_new_tokens <= limit or len(conversation.turns) <= 1:
            return text, add_special, dropped
        del conversation.turns[:2]  # the oldest user message and its reply
        dropped += 1


def chat_loop(
    model: nn.Module,
    tokenizer,
    setup: PromptSetup,
    inp: TextIO,
    out: TextIO,
    *,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = None,
    system: str | None = None,
    interactive: bool = False,
) -> int:
    """Read user lines from ``inp`` and stream replies to ``out`` until ``/exit`` or end of input.

    ``/reset`` starts a new conversation; any other ``/word`` that is not a command prints the
    commands and is not sent (``//text`` sends ``/text``). ``interactive`` shows a prompt before each line.
    Ctrl-C during a reply stops it (the turn is dropped); at the prompt it exits. Returns 0.
    """
    check_sampling(max_new_tokens, temperature, top_p)
    conversation = Conversation(system=system)
    if setup.style != "chat":
        out.write(f"note: this run was trained on {setup.style} text, not chats: each message is answered on its own\n")
    if interactive:
        out.write(f"chatting; {RESET} starts over, {EXIT[0]} or Ctrl-D quits, {HELP} lists the commands\n")
    while True:
        if interactive:
            out.write("you> ")
        out.flush()
        try:
            line = inp.readline()
        except KeyboardInterrupt:
            out.write("\n")
            return 0
        if not line:  # end of input (Ctrl-D)
            if interactive:
                out.write("\n")
            return 0
        message = line.strip()
        if not message:
            continue
        if message in EXIT:
            return 0
        if message == RESET:
            conversation.reset()
            out.write("(new conversation)\n")
            continue
        if message == HELP:
            out.write(COMMANDS_HELP + "\n")
            continue
        if is_unknown_command(message):
            out.write(f"unknown command {message.split()[0]!r} (nothing was sent to the model); {COMMANDS_HELP}\n")
            continue
        if message.startswith("//"):  # an escaped slash: text that starts with '/'
            message = message[1:]
        conversation.turns.append({"role": "user", "content": message})
        text, add_special, dropped = _fit_context(model, tokenizer, setup, conversation, max_new_tokens)
        if dropped:
            out.write(f"(dropped the {dropped} oldest exchange(s) to fit the model's context)\n")
        if interactive:
            out.write("model> ")
        streamer = TextOut(tokenizer, out)
        try:
            reply = complete(
                model,
                tokenizer,
                text,
                add_special,
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                top_p=top_p,
                seed=seed,
                streamer=streamer,
            )
        except KeyboardInterrupt:
            conversation.turns.pop()
            out.write("\n(stopped)\n")
            continue
        out.write("\n")
        conversation.turns.append({"role": "assistant", "content": reply.strip()})
        if setup.style != "chat":
            conversation.reset()
