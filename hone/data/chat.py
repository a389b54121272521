"""Chat rows: a list of messages rendered with a Jinja chat template, trained per role.

Which characters belong to which message is found by rendering prefixes of the conversation
with the same template and comparing them with the full rendering (longest common prefix):

- a message ends where ``render(messages[:i+1])`` stops agreeing with the full text;
- a non-assistant message starts where ``render(messages[:i])`` stops agreeing;
- an assistant message starts after ``render(messages[:i], add_generation_prompt=True)``,
  so the turn header the template writes for a reply (``<|im_start|>assistant\\n``) is
  context, and the reply plus its end-of-turn token (``<|im_end|>``) is trained, exactly as
  the model will produce it at inference.

This needs nothing from the template (no ``{% generation %}`` markers) and works for every
template whose rendering of a message does not depend on later messages; where a template
does rewrite earlier turns (e.g. dropping the reasoning of old turns), a span ends where the
renderings diverge. The full text is then tokenized once (``hone.data.encode``), and tokens
are mapped to spans through the tokenizer's character offsets.

Whitespace that a template writes after a turn's closing special token (ChatML's newline after
``<|im_end|>``) is context, not part of the turn: the model stops at the special token and
never generates what follows it. (Without a closing special token, trailing whitespace stays
trained: for such templates it is the only end-of-turn signal.)

A trained message whose span comes out empty means the template drops that role's turns:
that is a :class:`TemplateProblem` (never skipped), since every row would be affected.
"""

from __future__ import annotations

import typing
from typing import Any

import jinja2
from transformers.utils.chat_template_utils import render_jinja_template

from hone.config.data import ChatDataset, ChatRole
from hone.data.chat_templates import named_template
from hone.data.errors import DataError
from hone.data.formats import RowFormat, RowProblem, Source, TemplateProblem, TextRow, describe, require_columns

ALLOWED_ROLES: tuple[str, ...] = typing.get_args(ChatRole)

#: How ShareGPT rows (``conversations: [{from: human, value: ...}]``) map onto a chat dataset.
SHAREGPT_HINT = (
    "for ShareGPT rows set field_messages: conversations, field_role: from, field_content: value, "
    "role_map: {human: user, gpt: assistant} (see docs/datasets.md)"
)


def common_prefix_length(a: str, b: str) -> int:
    """Length of the longest common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # invariant: a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def resolve_template(tokenizer: Any, override: str | None) -> tuple[str, str]:
    """The template text and where it came from (for messages): a name hone ships
    (``data.chat_template: chatml``), Jinja text, or the tokenizer's own template."""
    if override is not None:
        named = named_template(override)
        if named is not None:
            return named, f"data.chat_template ({override.strip()})"
        return override, "data.chat_template"
    if getattr(tokenizer, "chat_template", None) is None:
        raise DataError(
            f"a chat dataset needs a chat template, but the tokenizer "
            f"('{getattr(tokenizer, 'name_or_path', '?')}') has none: set data.chat_template to a Jinja template"
        )
    try:
        return tokenizer.get_chat_template(), "the tokenizer's chat template"
    except ValueError as exc:  # several named templates and no default
        raise DataError(f"cannot pick the tokenizer's chat template: {exc}; set data.chat_template") from exc


class ChatFormat(RowFormat):
    """A list of ``{role, content}`` messages (field names and ``role_map`` from the config)."""

    def __init__(self, cfg: ChatDataset, source: Source, tokenizer: Any, template_override: str | None) -> None:
        super().__init__(source)
        self.cfg = cfg
        self.template, self.template_origin = resolve_template(tokenizer, template_override)
        # The same variables apply_chat_template passes: bos_token, eos_token, ...
        self.template_vars = dict(tokenizer.special_tokens_map)
        self.train_on = frozenset(cfg.train_on)
        # Every special added token (e.g. <|im_end|>, <|eot_id|>), not only the named ones.
        added = getattr(tokenizer, "added_tokens_decoder", {}).values()
        self.special_tokens = tuple(t.content for t in added if t.special and t.content.strip())
        self._check_template_compiles()

    def _check_template_compiles(self) -> None:
        try:
            self._render([], add_generation_prompt=False)
        except jinja2.TemplateSyntaxError as exc:
            raise DataError(f"{self.template_origin} is not valid Jinja (line {exc.lineno}): {exc.message}") from exc
        except Exception:  # noqa: BLE001 - an empty conversation may legitimately be refused
            pass

    def check_columns(self, columns: list[str]) -> None:
        if self.cfg.field_messages not in columns and "conversations" in columns:
            raise DataError(
                f"{self.source.path}: no column '{self.cfg.field_messages}' ({self.source.key}.field_messages); "
                f"the file has 'conversations': {SHAREGPT_HINT}"
            )
        require_columns(self.source, columns, {"field_messages": self.cfg.field_messages})

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        rendered, _ = render_jinja_template(
            conversations=[messages],
            chat_template=self.template,
            add_generation_prompt=add_generation_prompt,
            **self.template_vars,
        )
        return rendered[0]

    def render_messages(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        """The template's text for ``messages`` (preference rows render their prompt with it)."""
        return self._render(messages, add_generation_prompt)

    def trim_after_special(self, text: str, start: int, end: int) -> int:
        """``end`` moved back over whitespace that follows a closing special token."""
        return self._trim_after_special(text, start, end)

    def _trim_after_special(self, text: str, start: int, end: int) -> int:
        """``end`` moved back over whitespace that follows a closing special token."""
        stripped = text[start:end].rstrip()
        if stripped and len(stripped) < end - start and stripped.endswith(self.special_tokens):
            return start + len(stripped)
        return end

    def messages(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        """The row's messages with standard ``role``/``content`` keys; raises :class:`RowProblem`."""
        cfg = self.cfg
        raw = row.get(cfg.field_messages)
        if not isinstance(raw, list):
            raise RowProblem(f"field '{cfg.field_messages}' is {describe(raw)} (expected a list of messages)")
        if not raw:
            raise RowProblem(f"field '{cfg.field_messages}' is an empty list (expected at least one message)")
        out = []
        for number, message in enumerate(raw, start=1):
            if not isinstance(message, dict):
                raise RowProblem(
                    f"message {number} is {describe(message)} "
                    f"(expected an object with '{cfg.field_role}' and '{cfg.field_content}')"
                )
            role = message.get(cfg.field_role)
            if not isinstance(role, str):
                hint = f"; {SHAREGPT_HINT}" if "from" in message and "value" in message else ""
                raise RowProblem(f"message {number}: '{cfg.field_role}' is {describe(role)} (expected a string){hint}")
            content = message.get(cfg.field_content)
            if not isinstance(content, str):
                raise RowProblem(f"message {number}: '{cfg.field_content}' is {describe(content)} (expected a string)")
            mapped = cfg.role_map.get(role, role)
            if mapped not in ALLOWED_ROLES:
                mapped_note = f" (mapped from '{role}' by role_map)" if mapped != role else ""
                raise RowProblem(
                    f"message {number}: unknown role '{mapped}'{mapped_note}; allowed roles: {', '.join(ALLOWED_ROLES)} "
                    f"(map other names with {self.source.key}.role_map, e.g. {{human: user, gpt: assistant}}; "
                    "see docs/datasets.md)"
                )
            extra = {k: v for k, v in message.items() if k not in (cfg.field_role, cfg.field_content) and v is not None}
            out.append({**extra, "role": mapped, "content": content})
        return out

    def render(self, row: dict[str, Any]) -> TextRow:
        messages = self.messages(row)
        try:
            full = self._render(messages, add_generation_prompt=False)
            spans: list[tuple[int, int]] = []
            names: list[str] = []
            for i, message in enumerate(messages):
                if message["role"] not in self.train_on:
                    continue
                head = self._render(messages[:i], add_generation_prompt=message["role"] == "assistant")
                start = common_prefix_length(head, full)
                end = common_prefix_length(self._render(messages[: i + 1], add_generation_prompt=False), full)
                name = f"message {i + 1} ({message['role']})"
                if end <= start:
                    raise TemplateProblem(
                        f"{self.template_origin} renders no text for {name}, a role in train_on "
                        f"({', '.join(self.cfg.train_on)}); the template must write every message it is given"
                    )
                spans.append((start, self._trim_after_special(full, start, end)))
                names.append(name)
        except (TemplateProblem, RowProblem):
            raise
        except jinja2.TemplateSyntaxError as exc:
            raise DataError(f"{self.template_origin} is not valid Jinja (line {exc.lineno}): {exc.message}") from exc
        except Exception as exc:  # noqa: BLE001 - raise_exception() in templates, type errors on odd rows
            raise RowProblem(f"the chat template refused this conversation: {type(exc).__name__}: {exc}") from exc
        return TextRow(full, spans, append_eos=False, add_special_tokens=False, span_names=names)
