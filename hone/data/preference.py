"""Preference rows: a prompt, a chosen and a rejected completion, as text or chat messages.

The shapes TRL's preference trainers accept (``trl.data_utils``), with configurable fields:

- **text**: ``prompt``, ``chosen`` and ``rejected`` are strings;
- **chat, explicit prompt**: ``prompt`` is a list of messages and ``chosen`` / ``rejected``
  are lists of messages (usually one assistant turn each) that follow it;
- **chat, implicit prompt**: no ``prompt``; ``chosen`` / ``rejected`` are whole conversations
  that share their first turns. The prompt is their longest common run of messages, ending
  before an assistant turn (TRL's ``extract_prompt``).

A chat prompt is rendered once with the chat template and the generation prompt
(``<|im_start|>assistant\\n``); a completion is what the template writes after it for
``prompt + completion``, up to the end-of-turn token (whitespace the template writes after
that token is not part of it, as for ``chat`` SFT rows). The row is rendered to three texts
here; :mod:`hone.data.preference_encode` tokenizes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hone.config.data import ChatDataset, PreferenceDataset
from hone.data.chat import ChatFormat, common_prefix_length
from hone.data.errors import DataError
from hone.data.formats import RowFormat, RowProblem, Source, TemplateProblem, describe, require_columns


@dataclass
class PreferenceRow:
    """The three texts of one pair. ``chat``: the prompt is a rendered chat template (which
    writes its own BOS, if any); text prompts get the tokenizer's BOS prepended."""

    prompt: str
    chosen: str
    rejected: str
    chat: bool


def split_shared_prompt(
    chosen: list[dict[str, Any]], rejected: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """``(prompt, chosen completion, rejected completion)`` of two conversations that share
    their first turns: the common messages, less a trailing assistant turn (TRL's rule)."""
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    if shared and chosen[shared - 1]["role"] == "assistant":
        shared -= 1
    return chosen[:shared], chosen[shared:], rejected[shared:]


def identical(cfg: PreferenceDataset) -> str:
    return f"'{cfg.field_chosen}' and '{cfg.field_rejected}' are identical (expected two different completions)"


class PreferenceFormat(RowFormat):
    """One row -> :class:`PreferenceRow`; raises :class:`RowProblem` for a bad row."""

    def __init__(self, cfg: PreferenceDataset, source: Source, tokenizer: Any, template_override: str | None) -> None:
        super().__init__(source)
        self.cfg = cfg
        self.has_prompt_column = True
        messages = ChatDataset(
            type="chat",
            path=cfg.path,
            file_format=cfg.file_format,
            field_messages="messages",
            field_role=cfg.field_role,
            field_content=cfg.field_content,
            role_map=cfg.role_map,
        )
        # Text-only data needs no chat template: a missing one is an error only at the first chat row.
        self.chat: ChatFormat | None = None
        self.no_template = ""
        try:
            self.chat = ChatFormat(messages, source, tokenizer, template_override)
        except DataError as exc:
            self.no_template = str(exc).replace("a chat dataset", "a preference dataset with chat messages")

    def check_columns(self, columns: list[str]) -> None:
        require_columns(self.source, columns, {"field_chosen": self.cfg.field_chosen, "field_rejected": self.cfg.field_rejected})
        self.has_prompt_column = self.cfg.field_prompt in columns

    def render(self, row: dict[str, Any]) -> PreferenceRow:
        cfg = self.cfg
        prompt = row.get(cfg.field_prompt) if self.has_prompt_column else None
        chosen, rejected = row.get(cfg.field_chosen), row.get(cfg.field_rejected)
        if isinstance(chosen, list) and isinstance(rejected, list) and not isinstance(prompt, str):
            return self._chat(prompt, chosen, rejected)
        if cfg.field_prompt is None:
            raise RowProblem(
                f"field_prompt is null (the prompt is the turns '{cfg.field_chosen}' and '{cfg.field_rejected}' share), "
                f"so both must be lists of messages; got {describe(chosen)} and {describe(rejected)}"
            )
        for name, value in ((cfg.field_prompt, prompt), (cfg.field_chosen, chosen), (cfg.field_rejected, rejected)):
            if not isinstance(value, str):
                raise RowProblem(
                    f"field '{name}' is {describe(value)} (expected text: prompt, chosen and rejected all strings; "
                    f"or chat: chosen and rejected lists of messages, prompt a list of messages or absent)"
                )
        for name, value in ((cfg.field_chosen, chosen), (cfg.field_rejected, rejected)):
            if not value:
                raise RowProblem(f"field '{name}' is an empty string (expected a completion)")
        if chosen == rejected:
            raise RowProblem(identical(cfg))
        return PreferenceRow(prompt, chosen, rejected, chat=False)  # type: ignore[arg-type]

    def _messages(self, name: str, value: Any) -> list[dict[str, Any]]:
        assert self.chat is not None
        if not isinstance(value, list) or not value:
            raise RowProblem(f"field '{name}' is {describe(value)} (expected a non-empty list of messages)")
        try:
            return self.chat.messages({"messages": value})
        except RowProblem as problem:
            raise RowProblem(f"field '{name}' {problem}") from None

    def _chat(self, prompt: Any, chosen: list[Any], rejected: list[Any]) -> PreferenceRow:
        cfg = self.cfg
        if self.chat is None:
            raise TemplateProblem(self.no_template)
        chosen_turns = self._messages(cfg.field_chosen, chosen)
        rejected_turns = self._messages(cfg.field_rejected, rejected)
        if prompt is None:
            turns, chosen_turns, rejected_turns = split_shared_prompt(chosen_turns, rejected_turns)
            if not turns:
                raise RowProblem(
                    f"'{cfg.field_chosen}' and '{cfg.field_rejected}' share no prompt turn and the row has no "
                    f"'{cfg.field_prompt or 'prompt'}' (expected conversations that start with the same prompt "
                    "messages, or a prompt column)"
                )
        else:
            turns = self._messages(cfg.field_prompt, prompt)
        if turns[-1]["role"] == "assistant":
            raise RowProblem("the prompt ends with an assistant turn (expected it to end with the turn the completions answer)")
        if not chosen_turns or not rejected_turns:
            empty = cfg.field_chosen if not chosen_turns else cfg.field_rejected
            raise RowProblem(f"field '{empty}' has no message after the prompt turns (expected a completion)")
        if chosen_turns == rejected_turns:
            raise RowProblem(identical(cfg))
        try:
            prompt_text = self.chat.render_messages(turns, add_generation_prompt=True)
            texts = [self._completion(turns, prompt_text, c) for c in (chosen_turns, rejected_turns)]
        except (RowProblem, TemplateProblem):
            raise
        except Exception as exc:  # noqa: BLE001 - raise_exception() in templates, type errors on odd rows
            raise RowProblem(f"the chat template refused this conversation: {type(exc).__name__}: {exc}") from exc
        return PreferenceRow(prompt_text, texts[0], texts[1], chat=True)

    def _completion(self, turns: list[dict[str, Any]], prompt_text: str, completion: list[dict[str, Any]]) -> str:
        assert self.chat is not None
        full = self.chat.render_messages(turns + completion, add_generation_prompt=False)
        if common_prefix_length(full, prompt_text) < len(prompt_text):
            raise RowProblem(
                "the chat template renders the prompt turns differently when a reply follows them, so the "
                "completion cannot be cut off after the prompt"
            )
        end = self.chat.trim_after_special(full, len(prompt_text), len(full))
        if end <= len(prompt_text):
            raise TemplateProblem(f"{self.chat.template_origin} renders no text for a completion")
        return full[len(prompt_text) : end]
