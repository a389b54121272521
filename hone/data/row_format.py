"""Which :class:`~hone.data.formats.RowFormat` reads a dataset entry.

Apart from :mod:`hone.data.formats` because the chat format builds on that module's base
classes: the choice among all formats sits above both, so neither imports the other back.
"""

from __future__ import annotations

from typing import Any

from hone.config.data import DatasetConfig
from hone.data.chat import ChatFormat
from hone.data.formats import AlpacaFormat, CompletionFormat, PretokenizedFormat, RowFormat, Source
from hone.data.preference import PreferenceFormat


def make_format(cfg: DatasetConfig, source: Source, tokenizer: Any, chat_template: str | None) -> RowFormat:
    """The :class:`RowFormat` for one dataset entry."""
    if cfg.type == "alpaca":
        return AlpacaFormat(cfg, source)
    if cfg.type == "completion":
        return CompletionFormat(cfg, source)
    if cfg.type == "pretokenized":
        return PretokenizedFormat(cfg, source, vocab_size=len(tokenizer))
    if cfg.type == "chat":
        return ChatFormat(cfg, source, tokenizer, chat_template)
    if cfg.type == "preference":
        return PreferenceFormat(cfg, source, tokenizer, chat_template)
    raise AssertionError(f"unhandled dataset type {cfg.type!r}")  # the config's union is closed
