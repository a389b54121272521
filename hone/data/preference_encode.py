"""Preference rows -> ``prompt_ids``, ``chosen_ids``, ``rejected_ids``, with the length policy.

The cached schema of a ``preference`` split (one row per pair):

- ``prompt_ids``: the prompt's ids, tokenized once (a chat prompt: the template applied to
  the prompt turns with the generation prompt; a text prompt: the tokenizer's BOS, if it has
  one, then the text), never empty;
- ``chosen_ids`` / ``rejected_ids``: each completion's ids, ending with EOS (appended unless
  the completion already ends with it), never empty, never equal;
- ``length``: ``len(prompt_ids) + max(len(chosen_ids), len(rejected_ids))``, the longer of the
  two sequences an objective builds (``prompt + completion``, labels on the completion only).

Each part is tokenized on its own (``add_special_tokens=False``), as TRL's DPO trainer does,
so a completion's first token never merges with the prompt's last one. A row gets a status,
as in :mod:`hone.data.encode`; ``STATUS_PROMPT_TOO_LONG`` is a prompt that leaves no room
for a completion in ``sequence_len``: dropped under ``drop``, refused under ``truncate``.
"""

from __future__ import annotations

from typing import Any

from datasets import Features, List, Value

from hone.data.encode import STATUS_BAD_ROW, STATUS_OK, STATUS_TEMPLATE, STATUS_TOO_LONG
from hone.data.formats import RowProblem, TemplateProblem
from hone.data.interrupt import check_interrupted
from hone.data.preference import PreferenceFormat, PreferenceRow

STATUS_PROMPT_TOO_LONG = 5

#: The cached columns of a preference split.
PREFERENCE_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids", "length")

#: Columns of the encoded dataset; the last five are bookkeeping, dropped before caching.
PREFERENCE_FEATURES = Features(
    {
        "prompt_ids": List(Value("int64")),
        "chosen_ids": List(Value("int64")),
        "rejected_ids": List(Value("int64")),
        "length": Value("int64"),
        "n_trained": Value("int64"),
        "truncated": Value("bool"),
        "status": Value("int8"),
        "problem": Value("string"),
        "lengths": List(Value("int64")),  # prompt, chosen, rejected (as read, before truncation)
    }
)


class PreferenceEncoder:
    """The batched ``datasets.map`` function for preference rows (picklable, like ``RowEncoder``)."""

    def __init__(self, fmt: PreferenceFormat, tokenizer: Any, sequence_len: int, truncate: bool) -> None:
        self.fmt = fmt
        self.tokenizer = tokenizer
        self.eos_id = tokenizer.eos_token_id
        self.bos_id = tokenizer.bos_token_id
        self.sequence_len = sequence_len
        self.truncate = truncate

    def __call__(self, batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        check_interrupted()
        columns = list(batch)
        count = len(batch[columns[0]]) if columns else 0
        out: dict[str, list[Any]] = {name: [] for name in PREFERENCE_FEATURES}
        rendered: list[PreferenceRow | tuple[int, str]] = []
        for i in range(count):
            try:
                rendered.append(self.fmt.render({c: batch[c][i] for c in columns}))
            except RowProblem as problem:
                rendered.append((STATUS_BAD_ROW, str(problem)))
            except TemplateProblem as problem:
                rendered.append((STATUS_TEMPLATE, str(problem)))
        rows = [r for r in rendered if isinstance(r, PreferenceRow)]
        texts = [text for r in rows for text in (r.prompt, r.chosen, r.rejected)]
        ids = iter(self.tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"] if texts else [])
        for row in rendered:
            if isinstance(row, tuple):
                self._emit(out, [], [], [], [0, 0, 0], False, *row)
                continue
            prompt, chosen, rejected = next(ids), next(ids), next(ids)
            if not row.chat and self.bos_id is not None and prompt[:1] != [self.bos_id]:
                prompt = [self.bos_id, *prompt]
            self._pair(out, list(prompt), self._ended(chosen), self._ended(rejected))
        return out

    def _ended(self, ids: list[int]) -> list[int]:
        return list(ids) if ids and ids[-1] == self.eos_id else [*ids, self.eos_id]

    def _pair(self, out: dict[str, list[Any]], prompt: list[int], chosen: list[int], rejected: list[int]) -> None:
        lengths = [len(prompt), len(chosen), len(rejected)]
        if not prompt:
            self._emit(out, [], [], [], lengths, False, STATUS_BAD_ROW, "the prompt is empty (expected at least one token)")
            return
        room = self.sequence_len - len(prompt)
        if room < 1:
            message = (
                f"the prompt alone has {len(prompt)} tokens, which leaves no room for a completion in "
                f"data.sequence_len = {self.sequence_len}"
            )
            self._emit(out, [], [], [], lengths, False, STATUS_PROMPT_TOO_LONG, message)
            return
        truncated = max(len(chosen), len(rejected)) > room
        if truncated and not self.truncate:
            self._emit(out, [], [], [], lengths, False, STATUS_TOO_LONG, "")
            return
        chosen, rejected = chosen[:room], rejected[:room]
        if chosen == rejected:
            message = f"chosen and rejected are identical once cut to data.sequence_len = {self.sequence_len}"
            self._emit(out, [], [], [], lengths, truncated, STATUS_BAD_ROW, message)
            return
        self._emit(out, prompt, chosen, rejected, lengths, truncated, STATUS_OK, "")

    @staticmethod
    def _emit(
        out: dict[str, list[Any]],
        prompt: list[int],
        chosen: list[int],
        rejected: list[int],
        lengths: list[int],
        truncated: bool,
        status: int,
        problem: str,
    ) -> None:
        if status == STATUS_OK:
            lengths = [len(prompt), len(chosen), len(rejected)]
        out["prompt_ids"].append(prompt)
        out["chosen_ids"].append(chosen)
        out["rejected_ids"].append(rejected)
        out["length"].append(lengths[0] + max(lengths[1], lengths[2]))
        out["n_trained"].append(len(chosen) + len(rejected))
        out["truncated"].append(truncated)
        out["status"].append(status)
        out["problem"].append(problem)
        out["lengths"].append(lengths)
