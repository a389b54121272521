"""Rows -> ``input_ids`` and ``labels``, with the length policy; the function ``datasets.map`` runs.

Labels follow the Hugging Face convention (``labels`` aligned with ``input_ids``; the model
shifts them), with two rules of hone's:

- ``-100`` on every token that is not trained (prompt, template headers, other roles, BOS);
- the first token's label is always ``-100``: nothing precedes it, so it can never be a
  target. This makes "trained tokens" an exact count of the targets the loss sees, and means
  packed rows never train on predicting one document's first token from the previous one.

Each row gets a ``status`` instead of raising, so one ``map`` pass (possibly over several
processes) classifies every row, and the caller decides, in row order, what is an error and
what is counted: ``ok``, ``bad row`` (skippable), ``too long`` (dropped by the ``drop``
strategy), ``no trained tokens`` (dropped), ``template`` (always an error).
"""

from __future__ import annotations

from typing import Any

from datasets import Features, List, Value

from hone.data.formats import RowFormat, RowProblem, TemplateProblem, TextRow, TokenRow
from hone.data.interrupt import check_interrupted

IGNORE_INDEX = -100

STATUS_OK = 0
STATUS_BAD_ROW = 1
STATUS_TOO_LONG = 2
STATUS_NO_TRAINED = 3
STATUS_TEMPLATE = 4

#: Columns of the encoded dataset. ``length`` is ``len(input_ids)`` (for a row dropped as too
#: long, the length it had);
#: ``status``/``problem``/``truncated``/``n_trained`` are bookkeeping, dropped before caching.
ENCODED_FEATURES = Features(
    {
        "input_ids": List(Value("int64")),
        "labels": List(Value("int64")),
        "length": Value("int64"),
        "n_trained": Value("int64"),
        "truncated": Value("bool"),
        "status": Value("int8"),
        "problem": Value("string"),
    }
)


def labels_from_offsets(
    row: TextRow, ids: list[int], offsets: list[tuple[int, int]], eos_id: int | None
) -> tuple[list[int], list[int]]:
    """Label every token that overlaps a trained span; append (and train) EOS.

    Overlap, not containment: a template whose reply header ends in a space (``Assistant: ``)
    gets the reply's first word as one token that starts with that space; it is part of the
    reply. Zero-width tokens (inserted by the tokenizer's post-processor, e.g. BOS) are never
    trained. Raises :class:`TemplateProblem` when a named span (a chat message) gets no token.
    """
    ids = list(ids)
    labels = [IGNORE_INDEX] * len(ids)
    spans = row.trained
    per_span = [0] * len(spans)
    k = 0
    for j, (start, end) in enumerate(offsets):
        if end <= start:
            continue
        while k < len(spans) and spans[k][1] <= start:
            k += 1
        if k == len(spans):
            break
        if spans[k][0] < end:
            labels[j] = ids[j]
            per_span[k] += 1
    if row.span_names is not None:
        for name, count in zip(row.span_names, per_span):
            if count == 0:
                raise TemplateProblem(f"{name} is rendered but covers no token; the chat template must separate turns")
    if row.append_eos:
        if ids and ids[-1] == eos_id and offsets and offsets[-1][0] == offsets[-1][1]:
            labels[-1] = eos_id  # the tokenizer's post-processor already appended it
        else:
            ids.append(eos_id)
            labels.append(eos_id)
    return ids, labels


class RowEncoder:
    """The batched ``datasets.map`` function: format, tokenize, label, apply the length policy.

    Picklable (it holds the format and the tokenizer), so ``map(num_proc=N)`` can ship it.
    """

    def __init__(self, fmt: RowFormat, tokenizer: Any, sequence_len: int, truncate: bool) -> None:
        self.fmt = fmt
        self.tokenizer = tokenizer
        self.eos_id = tokenizer.eos_token_id
        self.sequence_len = sequence_len
        self.truncate = truncate

    def __call__(self, batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        check_interrupted()  # a Ctrl-C that a library swallowed stops the map here
        columns = list(batch)
        count = len(batch[columns[0]]) if columns else 0
        rendered: list[Any] = []
        for i in range(count):
            row = {c: batch[c][i] for c in columns}
            try:
                rendered.append(self.fmt.render(row))
            except RowProblem as problem:
                rendered.append((STATUS_BAD_ROW, str(problem)))
            except TemplateProblem as problem:
                rendered.append((STATUS_TEMPLATE, str(problem)))
        # Per row: (ids, labels), or (status, problem) for a row that failed.
        results: list[Any] = list(rendered)
        for special in (True, False):  # one tokenizer call per add_special_tokens value
            which = [i for i, r in enumerate(rendered) if isinstance(r, TextRow) and r.add_special_tokens == special]
            if not which:
                continue
            enc = self.tokenizer(
                [rendered[i].text for i in which],
                add_special_tokens=special,
                return_offsets_mapping=True,
                verbose=False,
            )
            for j, i in enumerate(which):
                try:
                    results[i] = labels_from_offsets(rendered[i], enc["input_ids"][j], enc["offset_mapping"][j], self.eos_id)
                except TemplateProblem as problem:
                    results[i] = (STATUS_TEMPLATE, str(problem))
        for i, r in enumerate(rendered):
            if isinstance(r, TokenRow):
                results[i] = (list(r.input_ids), list(r.labels))

        out: dict[str, list[Any]] = {name: [] for name in ENCODED_FEATURES}
        for result in results:
            if isinstance(result[0], int):  # (status, problem)
                self._emit(out, [], [], 0, 0, False, result[0], result[1])
                continue
            ids, labels = result
            length = len(ids)
            truncated = False
            if length > self.sequence_len:
                if not self.truncate:
                    self._emit(out, [], [], length, 0, False, STATUS_TOO_LONG, "")
                    continue
                ids, labels, truncated = ids[: self.sequence_len], labels[: self.sequence_len], True
            labels[0] = IGNORE_INDEX
            n_trained = sum(1 for label in labels if label != IGNORE_INDEX)
            if n_trained == 0:
                self._emit(out, [], [], length, 0, truncated, STATUS_NO_TRAINED, "")
                continue
            self._emit(out, ids, labels, len(ids), n_trained, truncated, STATUS_OK, "")
        return out

    @staticmethod
    def _emit(
        out: dict[str, list[Any]],
        ids: list[int],
        labels: list[int],
        length: int,
        n_trained: int,
        truncated: bool,
        status: int,
        problem: str,
    ) -> None:
        out["input_ids"].append(ids)
        out["labels"].append(labels)
        out["length"].append(length)
        out["n_trained"].append(n_trained)
        out["truncated"].append(truncated)
        out["status"].append(status)
        out["problem"].append(problem)
