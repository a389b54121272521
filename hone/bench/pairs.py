"""The ``data: pairs`` workload: preference pairs of random words with exact token lengths.

hone's ``preference`` type reads text (or chat messages) and tokenizes each part itself (a
text prompt gets BOS, each completion EOS; docs/datasets.md), so the pairs are written as text
whose tokens are known: words that are one token of the model's tokenizer each, with their
leading space, which a byte-level BPE never merges across (its pre-tokenizer splits before
every space). A pair's prompt is then exactly ``prompt_len`` tokens (BOS included) and each
completion ``completion_len`` (EOS included), as the TRL peer's (benchmarks/peer/trl_dpo.py).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from hone.bench.spec import Workload


def single_token_words(tokenizer: Any) -> list[str]:
    """Every ``" word"`` (a space, then ASCII letters) that the tokenizer encodes to one token."""
    words = []
    for token_id in range(len(tokenizer)):
        text = tokenizer.decode([token_id])
        if len(text) > 1 and text[0] == " " and text[1:].isascii() and text[1:].isalpha():
            if tokenizer.encode(text, add_special_tokens=False) == [token_id]:
                words.append(text)
    return words


def _text(rng: random.Random, words: list[str], count: int) -> str:
    return "".join(rng.choice(words) for _ in range(count))


def write_pairs(path: Path, workload: Workload, tokenizer: Any, count: int, seed: int) -> None:
    """Write ``count`` text pairs as a ``preference`` JSONL file; raises when the tokenizer
    has too few one-token words, or when a prompt does not tokenize to the length asked for."""
    words = single_token_words(tokenizer)
    if len(words) < 16:
        raise ValueError(f"the tokenizer has {len(words)} one-token words; data: pairs needs at least 16")
    bos = 1 if tokenizer.bos_token_id is not None else 0
    prompt_words = workload.prompt_len - bos
    rng = random.Random(seed)
    with path.open("w") as f:
        for index in range(count):
            prompt = _text(rng, words, prompt_words)
            chosen = _text(rng, words, workload.completion_len - 1)
            rejected = chosen
            while rejected == chosen:
                rejected = _text(rng, words, workload.completion_len - 1)
            expected = prompt_words + workload.completion_len - 1
            if index == 0 and len(tokenizer.encode(prompt + chosen, add_special_tokens=False)) != expected:
                raise ValueError("the one-token words merged across a boundary: the pairs would not have the lengths asked for")
            f.write(json.dumps({"prompt": prompt, "chosen": chosen, "rejected": rejected}) + "\n")


def pair_stats(workload: Workload, count: int) -> Any:
    """The data statistics ``hone train`` finds for :func:`write_pairs`' file (every part of the
    length asked for), built as the data preparation builds them, which the bench's memory
    estimate is made with, as the run's decisions are."""
    import numpy as np

    from hone.data.stats import SplitStats

    prompt, completion = workload.prompt_len, workload.completion_len
    parts = np.tile(np.array([prompt, completion, completion], dtype=np.int64), (count, 1))
    lengths = np.full(count, prompt + completion, dtype=np.int64)  # a pair's row: the prompt and its longer completion
    return SplitStats.from_arrays(lengths, np.full(count, 2 * completion, dtype=np.int64), [], parts)
