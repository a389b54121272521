"""Preference pairs -> one packed micro-batch.

A micro-batch of ``P`` pairs (rows of a ``preference`` split: ``prompt_ids``, ``chosen_ids``,
``rejected_ids``, see :mod:`hone.data.preference_encode`) is **one** packed row holding the
``2P`` sequences ``prompt + chosen_p`` and ``prompt + rejected_p``, built by
:func:`~hone.data.collate.collate_packed`, so the sequences are isolated exactly as packed SFT
documents are (positions restart at 0, ``cu_seqlens`` mark the boundaries, no target crosses a
boundary). Its width is the sequences' total rounded up to a multiple of :data:`ALIGN` (one
padding document at the end): a few widths instead of one per batch for a compiled model.

Targets sit on the completion tokens; each target position also gets a **segment**, the
sequence whose log-probability it adds to: ``p`` for chosen ``p``, ``P + p`` for rejected
``p``. ORPO's NLL is taken, as TRL's ``ORPOTrainer`` takes it, over the chosen sequences'
prompt *and* completion tokens: with ``prompt_nll`` the chosen prompts' tokens (all but the
first, which nothing predicts) are targets too, in segment ``2P + p``. The objective sums each
segment with :func:`hone.kernels.sequence_logprobs.sequence_logprobs`, over the positions of
``counted`` only (found here, on the host): the prompts' and the padding's hidden states never
go through the output head.

A batch carries its pair count and token counts (host integers and a small tensor), so the
training loop divides by the window's pairs and tokens without a device sync.
"""

from collections.abc import Mapping, Sequence

import torch

from hone.data.collate import IGNORE_INDEX, MicroBatch, collate_packed

#: Pair rows are packed to a multiple of this many tokens.
ALIGN = 64

#: The columns a pair row is read with.
PAIR_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")


def pair_width(lengths: Sequence[int], align: int = ALIGN) -> int:
    """The row width for sequences of ``lengths``: their total rounded up to a multiple of ``align``."""
    total = sum(lengths)
    return max(align, -(-total // align) * align)


def collate_pairs(
    rows: Sequence[Mapping[str, Sequence[int]]], pad_id: int, prompt_nll: bool = False, reference: torch.Tensor | None = None
) -> MicroBatch:
    """One packed micro-batch of the ``len(rows)`` pairs (module docstring); ``prompt_nll``:
    the chosen prompts' tokens are targets too, in segments ``2P .. 3P - 1`` (ORPO);
    ``reference``: the pairs' precomputed reference log-probs, ``[P, 2]`` (chosen, rejected)."""
    if not rows:
        raise ValueError("collate_pairs needs at least one pair")
    pairs = len(rows)
    docs: list[dict[str, list[int]]] = []
    spans: list[tuple[int, int, int, bool]] = []  # (prompt length, completion length, pair index, chosen)
    for p, row in enumerate(rows):
        prompt = list(row["prompt_ids"])
        for key, chosen in (("chosen_ids", True), ("rejected_ids", False)):
            completion = list(row[key])
            if not prompt or not completion:
                raise ValueError(f"pair {p}: empty prompt or {key}")
            ids = prompt + completion
            masked = prompt_nll and chosen
            labels = ids if masked else [IGNORE_INDEX] * len(prompt) + completion
            docs.append({"input_ids": ids, "labels": labels})
            spans.append((len(prompt), len(completion), p, chosen))
    width = pair_width([len(d["input_ids"]) for d in docs])
    batch = collate_packed([docs], width, pad_id)
    segments = torch.full((1, width), -1, dtype=torch.long)
    completion_tokens = torch.zeros(2 * pairs, dtype=torch.float32)
    nll_tokens = 0
    at = 0
    for prompt_len, completion_len, p, chosen in spans:
        slot = p if chosen else pairs + p
        # the target at position t is the token at t + 1: the completion's targets start one early
        segments[0, at + prompt_len - 1 : at + prompt_len + completion_len - 1] = slot
        completion_tokens[slot] = completion_len
        if chosen:
            nll_tokens += completion_len
            if prompt_nll:
                segments[0, at : at + prompt_len - 1] = 2 * pairs + p
                nll_tokens += prompt_len - 1
        at += prompt_len + completion_len
    batch.pairs = pairs
    batch.segments = segments
    batch.counted = torch.nonzero(segments.reshape(-1) >= 0).squeeze(1)
    batch.completion_tokens = completion_tokens
    batch.nll_tokens = nll_tokens
    if reference is not None:
        batch.reference_logps = torch.cat([reference[:, 0], reference[:, 1]]).float()
    return batch


def pair_rows_at(dataset, indices: Sequence[int]) -> list[dict[str, list[int]]]:
    """Pairs ``indices`` of a preference split (a HF ``datasets.Dataset`` or a sequence of row
    dicts), read with one call per micro-batch."""
    indices = [int(i) for i in indices]
    if not hasattr(dataset, "column_names"):
        return [dataset[i] for i in indices]
    batch = dataset[indices]
    return [{c: batch[c][j] for c in PAIR_COLUMNS} for j in range(len(indices))]
