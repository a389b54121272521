"""``hone preprocess --show N``: rows as the model sees them, with the trained tokens marked.

The rows are the prepared training split in training order (tokenized, truncated, shuffled;
before packing, which only places them side by side), decoded back to text with the special
tokens kept, so the chat template, the BOS/EOS and every masked span are visible. Trained
tokens (label not -100; the loss shifts labels by one itself) are shown in green on a terminal
and between ``[[`` and ``]]`` otherwise (``NO_COLOR`` turns colour off), the way Axolotl's
``preprocess --debug`` lets one check the masking.

Each run of consecutive tokens with the same mark is decoded as one piece: decoding token by
token would split multi-byte characters, and a piece boundary is where a reader looks anyway.
"""

from __future__ import annotations

from typing import Any

IGNORE_INDEX = -100
GREEN, RESET = "\x1b[32m", "\x1b[0m"
OPEN, CLOSE = "[[", "]]"


def trained_pieces(input_ids: list[int], labels: list[int]) -> list[tuple[list[int], bool]]:
    """``input_ids`` cut into runs of consecutive tokens that are all trained or all context."""
    pieces: list[tuple[list[int], bool]] = []
    for token, label in zip(input_ids, labels):
        trained = label != IGNORE_INDEX
        if pieces and pieces[-1][1] == trained:
            pieces[-1][0].append(token)
        else:
            pieces.append(([token], trained))
    return pieces


def render_row(input_ids: list[int], labels: list[int], tokenizer: Any, color: bool) -> str:
    """One row's text with its trained spans marked (colour, or ``[[...]]``)."""
    out = []
    for ids, trained in trained_pieces(input_ids, labels):
        text = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if trained:
            out.append(f"{GREEN}{text}{RESET}" if color else f"{OPEN}{text}{CLOSE}")
        else:
            out.append(text)
    return "".join(out)


def render_rows(split: Any, tokenizer: Any, count: int, color: bool) -> str:
    """The first ``count`` rows of a prepared split, each headed by its token counts."""
    shown = min(count, len(split))
    legend = "in green" if color else f"between {OPEN} and {CLOSE}"
    lines = [f"the first {shown} of {len(split)} training rows as the model sees them; trained tokens {legend}:"]
    if "prompt_ids" in split.column_names:
        return "\n".join([lines[0].replace("training rows", "training pairs"), *_pairs(split, tokenizer, shown, color)])
    for index in range(shown):
        row = split[index]
        ids, labels = list(row["input_ids"]), list(row["labels"])
        trained = sum(label != IGNORE_INDEX for label in labels)
        lines.append(f"--- row {index}: {len(ids)} tokens, {trained} trained")
        lines.append(render_row(ids, labels, tokenizer, color))
    return "\n".join(lines)


def _pairs(split: Any, tokenizer: Any, shown: int, color: bool) -> list[str]:
    """Preference pairs: each completion after the shared prompt, the completion marked as trained."""
    lines = []
    for index in range(shown):
        row = split[index]
        prompt = list(row["prompt_ids"])
        lines.append(f"--- pair {index}: prompt {len(prompt)} tokens")
        for name in ("chosen", "rejected"):
            completion = list(row[f"{name}_ids"])
            ids, labels = prompt + completion, [IGNORE_INDEX] * len(prompt) + completion
            lines.append(f"  {name} ({len(completion)} tokens): {render_row(ids, labels, tokenizer, color)}")
    return lines
