"""Dataset formats: one row of a file -> what to tokenize and which part of it to train.

A text format (alpaca, chat, completion) turns a row into a :class:`TextRow`: the full text
and the character spans whose tokens are trained. Tokenizing the whole text once and mapping
tokens to spans through the tokenizer's offsets (``hone.data.encode``) gives exactly the ids
the model sees at inference, with no re-tokenization seams between prompt and answer.
``pretokenized`` rows are already ids and become a :class:`TokenRow`.

A row that is missing a field or has a wrong type raises :class:`RowProblem` (the caller adds
file and row, and skips or stops according to ``data.on_bad_row``). A problem with the
options themselves (a column that no row has, no chat template) is a :class:`DataError`
raised once, before any row is read.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hone.config.data import AlpacaDataset, CompletionDataset, PretokenizedDataset
from hone.data.errors import DataError

#: Alpaca-style prompt, without the classic one-sentence preamble ("Below is an
#: instruction...") because it would cost ~30 tokens per row for no information. The answer
#: follows the final newline directly; only the answer and the appended EOS are trained.
ALPACA_PROMPT = "### Instruction:\n{instruction}\n\n### Response:\n"
ALPACA_PROMPT_WITH_INPUT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"


class RowProblem(Exception):
    """A bad row: skippable with ``data.on_bad_row: skip``. The message has no location."""


class TemplateProblem(Exception):
    """The chat template, not the row, is wrong (it renders no tokens for a trained role).

    Never skipped: skipping would silently drop every row of the dataset.
    """


@dataclass
class TextRow:
    """Text to tokenize and the ``[start, end)`` character spans whose tokens are trained."""

    text: str
    trained: list[tuple[int, int]]
    append_eos: bool
    add_special_tokens: bool
    #: A name per span (e.g. ``message 2 (assistant)``). When set, every span must cover at
    #: least one token, or the template is at fault (see :class:`TemplateProblem`).
    span_names: list[str] | None = None


@dataclass
class TokenRow:
    """Ids and labels given by the data itself (``pretokenized``)."""

    input_ids: list[int]
    labels: list[int]


@dataclass(frozen=True)
class Source:
    """Where rows come from, for messages: the file and its config key."""

    path: Path
    key: str  # e.g. data.datasets[0]


def describe(value: Any) -> str:
    """A short description of a bad value for messages: ``a number (5)``, ``a list``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"a boolean ({value})"
    if isinstance(value, (int, float)):
        return f"a number ({value})"
    if isinstance(value, str):
        return f"a string ({value[:40]!r}{'...' if len(value) > 40 else ''})"
    if isinstance(value, (list, tuple)):
        return f"a list of {len(value)} item{'s' if len(value) != 1 else ''}"
    if isinstance(value, dict):
        return f"an object with keys {sorted(value)[:6]}"
    return f"a {type(value).__name__}"


def get_str(row: dict[str, Any], name: str, *, optional: bool = False) -> str | None:
    """Field ``name`` as a string; None for an absent optional field."""
    value = row.get(name)
    if value is None:
        if optional:
            return None
        raise RowProblem(f"field '{name}' is missing or null (expected a string)")
    if not isinstance(value, str):
        raise RowProblem(f"field '{name}' is {describe(value)} (expected a string)")
    return value


def require_columns(source: Source, columns: list[str], wanted: dict[str, str]) -> None:
    """Fail once, naming the config key, if a required column is absent from the whole file.

    ``wanted`` maps the config key (``field_output``) to the column name it selects.
    """
    for config_key, column in wanted.items():
        if column not in columns:
            raise DataError(
                f"{source.path}: no column '{column}' ({source.key}.{config_key} = '{column}'); "
                f"the file's columns are: {', '.join(columns) or '(none)'}"
            )


class RowFormat(ABC):
    """Turns one row (a dict of column -> value) into a :class:`TextRow` or :class:`TokenRow`."""

    def __init__(self, source: Source) -> None:
        self.source = source

    @abstractmethod
    def check_columns(self, columns: list[str]) -> None:
        """Raise :class:`DataError` if the file cannot hold what this format needs."""

    @abstractmethod
    def render(self, row: dict[str, Any]) -> TextRow | TokenRow:
        """Raise :class:`RowProblem` for a bad row."""


class AlpacaFormat(RowFormat):
    """Instruction (+ optional input) -> output. Trains the output and an appended EOS."""

    def __init__(self, cfg: AlpacaDataset, source: Source) -> None:
        super().__init__(source)
        self.cfg = cfg

    def check_columns(self, columns: list[str]) -> None:
        require_columns(
            self.source,
            columns,
            {"field_instruction": self.cfg.field_instruction, "field_output": self.cfg.field_output},
        )

    def render(self, row: dict[str, Any]) -> TextRow:
        instruction = get_str(row, self.cfg.field_instruction)
        extra = get_str(row, self.cfg.field_input, optional=True)
        output = get_str(row, self.cfg.field_output)
        if extra:
            prompt = ALPACA_PROMPT_WITH_INPUT.format(instruction=instruction, input=extra)
        else:
            prompt = ALPACA_PROMPT.format(instruction=instruction)
        text = prompt + output
        return TextRow(text, [(len(prompt), len(text))], append_eos=True, add_special_tokens=True)


class CompletionFormat(RowFormat):
    """Raw text; every token is trained, and an appended EOS."""

    def __init__(self, cfg: CompletionDataset, source: Source) -> None:
        super().__init__(source)
        self.cfg = cfg

    def check_columns(self, columns: list[str]) -> None:
        require_columns(self.source, columns, {"field_text": self.cfg.field_text})

    def render(self, row: dict[str, Any]) -> TextRow:
        text = get_str(row, self.cfg.field_text)
        if not text:
            raise RowProblem(f"field '{self.cfg.field_text}' is an empty string (expected text to train on)")
        return TextRow(text, [(0, len(text))], append_eos=True, add_special_tokens=True)


class PretokenizedFormat(RowFormat):
    """Token ids from the file, checked against the vocabulary; no EOS is added.

    Without a labels column (or with a null in it) every token is trained.
    """

    def __init__(self, cfg: PretokenizedDataset, source: Source, vocab_size: int) -> None:
        super().__init__(source)
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.has_labels = False

    def check_columns(self, columns: list[str]) -> None:
        require_columns(self.source, columns, {"field_input_ids": self.cfg.field_input_ids})
        self.has_labels = self.cfg.field_labels is not None and self.cfg.field_labels in columns

    def render(self, row: dict[str, Any]) -> TokenRow:
        ids = self._ids(row, self.cfg.field_input_ids, allow_ignore=False)
        if not ids:
            raise RowProblem(f"field '{self.cfg.field_input_ids}' is an empty list (expected token ids)")
        labels = list(ids)
        if self.has_labels and row.get(self.cfg.field_labels) is not None:
            labels = self._ids(row, self.cfg.field_labels, allow_ignore=True)
            if len(labels) != len(ids):
                raise RowProblem(
                    f"field '{self.cfg.field_labels}' has {len(labels)} labels but "
                    f"'{self.cfg.field_input_ids}' has {len(ids)} ids (expected the same length)"
                )
        return TokenRow(ids, labels)

    def _ids(self, row: dict[str, Any], name: str, *, allow_ignore: bool) -> list[int]:
        value = row.get(name)
        if not isinstance(value, list):
            raise RowProblem(f"field '{name}' is {describe(value)} (expected a list of token ids)")
        allowed = f"integers in [0, {self.vocab_size})" + (" or -100" if allow_ignore else "")
        ids = []
        for position, item in enumerate(value):
            # A float anywhere in a JSON column makes Arrow read the whole column as floats, so
            # whole-number floats (5.0) are ids; 6.5 is not.
            if isinstance(item, float) and item.is_integer():
                item = int(item)
            if isinstance(item, bool) or not isinstance(item, int):
                raise RowProblem(f"field '{name}' item {position} is {describe(item)} (expected {allowed})")
            if not (0 <= item < self.vocab_size or (allow_ignore and item == -100)):
                raise RowProblem(
                    f"field '{name}' item {position} is {item}, outside the tokenizer's vocabulary (expected {allowed})"
                )
            ids.append(item)
        return ids
