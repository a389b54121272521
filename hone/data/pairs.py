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

**Shared prompts** (``share_prompt``, :data:`BRANCHES`): each pair's prompt is computed once.
Its row part is ``prompt[:-1]`` (the shared trunk), then ``prompt[-1] + chosen`` (branch 1),
then ``prompt[-1] + rejected`` (branch 2); both branches continue the trunk's positions
(``len(prompt) - 1`` onwards) and attend to the trunk and to themselves only, never to each
other (hone's masks read ``branches``: :mod:`hone.models.attention.packed_mask`; the varlen
kernel reads the same tree as segments, ``tree``: :func:`tree_boundaries`). The prompt's
last token opens each branch so that the hidden state predicting each completion's first token
sits in its own branch: every target position still has one segment. A pair is then
``len(prompt) + len(chosen) + len(rejected) + 1`` tokens instead of ``2 len(prompt) + ...``;
the log-probabilities are the unshared ones (only rounding differs: the same tokens see the same
keys at the same positions).

A batch carries its pair count and token counts (host integers and a small tensor), so the
training loop divides by the window's pairs and tokens without a device sync.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from hone.data.collate import IGNORE_INDEX, MicroBatch, TreeBoundaries, collate_packed

#: Pair rows are packed to a multiple of this many tokens. Small: every padding token is computed
#: and its activations kept like a real one (at 64, a 2,049-token qwen3-8b pair row carried 63
#: of them, 3% of the step's activations, 0.19 GiB on an H200), while the widths stay few enough
#: for a compiled layer (dynamic in the row length after its first recompile) and a 16-row edge
#: matches the tensor cores' tile.
ALIGN = 16

#: The columns a pair row is read with.
PAIR_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")

#: ``MicroBatch.branches`` values of a shared-prompt row: the trunk (and padding), the chosen
#: branch, the rejected branch.
TRUNK, CHOSEN_BRANCH, REJECTED_BRANCH = 0, 1, 2
BRANCHES = (TRUNK, CHOSEN_BRANCH, REJECTED_BRANCH)


@dataclass(frozen=True)
class FixedPairRows:
    """One layout for every pair micro-batch of a run, so that a compiled layer sees the same
    shapes each step and CUDA graphs replay one recording (``performance.cuda_graphs: true``):
    rows ``width`` tokens wide; the boundaries always end in one padding segment, of zero
    length where the pairs fill the row, and count ``pairs`` pairs' segments (a last, smaller
    micro-batch of an eval split gets empty ones); with shared prompts, ``keys`` gathered keys,
    the padding segment taking those the pairs leave (built by :func:`fixed_pair_rows`)."""

    width: int
    keys: int
    pairs: int = 1


def fixed_pair_rows(splits: Sequence[Any], pairs_per_batch: int, share_prompt: bool) -> FixedPairRows:
    """The layout that holds any ``pairs_per_batch`` pairs of the preference ``splits``
    (:class:`~hone.data.stats.SplitStats`): the longest pair's row times the pairs, rounded up
    to :data:`ALIGN`, and room for the longest trunks gathered again. Bounded by the
    statistics' maxima, so a row of shorter pairs carries padding (compute the padding costs)."""
    longest, prompt = 0, 0
    for split in splits:
        if split is None or not split.pairs:
            continue
        tokens = split.max_pair_tokens or split.max_prompt + split.max_chosen + split.max_rejected
        # shared: the trunk prompt[:-1], then prompt[-1] opening each branch (one token more);
        # unshared: the prompt in both sequences
        longest = max(longest, tokens + (1 if share_prompt else split.max_prompt))
        prompt = max(prompt, split.max_prompt)
    if not longest:
        raise ValueError("fixed_pair_rows needs the statistics of a preference split")
    width = pair_width([longest * pairs_per_batch])
    keys = width + pairs_per_batch * max(prompt - 1, 0) if share_prompt else width
    return FixedPairRows(width=width, keys=keys, pairs=pairs_per_batch)


def pair_width(lengths: Sequence[int], align: int = ALIGN) -> int:
    """The row width for sequences of ``lengths``: their total rounded up to a multiple of ``align``."""
    total = sum(lengths)
    return max(align, -(-total // align) * align)


def collate_pairs(
    rows: Sequence[Mapping[str, Sequence[int]]],
    pad_id: int,
    prompt_nll: bool = False,
    reference: torch.Tensor | None = None,
    share_prompt: bool = False,
    fixed: FixedPairRows | None = None,
) -> MicroBatch:
    """One packed micro-batch of the ``len(rows)`` pairs (module docstring); ``prompt_nll``:
    the chosen prompts' tokens are targets too, in segments ``2P .. 3P - 1`` (ORPO);
    ``reference``: the pairs' precomputed reference log-probs, ``[P, 2]`` (chosen, rejected);
    ``share_prompt``: each prompt once, with two branches (module docstring); ``fixed``: the
    run's one layout for every micro-batch (:class:`FixedPairRows`), else the row is as wide as
    its pairs."""
    if not rows:
        raise ValueError("collate_pairs needs at least one pair")
    if share_prompt:
        batch = _collate_shared(rows, pad_id, prompt_nll, fixed)
        if reference is not None:
            batch.reference_logps = torch.cat([reference[:, 0], reference[:, 1]]).float()
        return batch
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
    width = _row_width([len(d["input_ids"]) for d in docs], fixed)
    batch = collate_packed([docs], width, pad_id)
    if fixed is not None:  # two sequences a pair, then the padding: empty segments where missing
        batch.cu_seqlens = _segments(batch.cu_seqlens, 2 * fixed.pairs + 1)
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


def _segments(bounds: torch.Tensor, count: int) -> torch.Tensor:
    """``bounds`` (``[n + 1]`` segment boundaries) extended to ``count`` segments with empty ones
    at the end: every micro-batch of a fixed layout hands the kernel the same number."""
    if len(bounds) - 1 > count:
        raise ValueError(f"{len(bounds) - 1} segments exceed the fixed layout's {count}")
    return torch.cat([bounds, bounds[-1:].expand(count + 1 - len(bounds))])


def _row_width(lengths: Sequence[int], fixed: FixedPairRows | None) -> int:
    """The row width for sequences (or parts) of ``lengths``: the fixed layout's, which they
    must fit, else their own total rounded up to :data:`ALIGN`."""
    if fixed is None:
        return pair_width(lengths)
    if sum(lengths) > fixed.width:
        raise ValueError(
            f"pairs of {sum(lengths)} tokens exceed the fixed pair row of {fixed.width} tokens "
            "(FixedPairRows is sized from the data statistics of every split it serves)"
        )
    return fixed.width


def _collate_shared(
    rows: Sequence[Mapping[str, Sequence[int]]], pad_id: int, prompt_nll: bool, fixed: FixedPairRows | None = None
) -> MicroBatch:
    """The shared-prompt micro-batch: per pair the trunk ``prompt[:-1]``, then the two branches
    ``prompt[-1] + completion``, continuing the trunk's positions (module docstring)."""
    pairs = len(rows)
    parts: list[tuple[list[int], int, int, int]] = []  # (tokens, first position, pair, branch)
    for p, row in enumerate(rows):
        prompt = list(row["prompt_ids"])
        chosen, rejected = list(row["chosen_ids"]), list(row["rejected_ids"])
        if not prompt or not chosen or not rejected:
            raise ValueError(f"pair {p}: empty prompt, chosen_ids or rejected_ids")
        trunk = len(prompt) - 1
        parts.append((prompt[:-1], 0, p, TRUNK))
        parts.append((prompt[-1:] + chosen, trunk, p, CHOSEN_BRANCH))
        parts.append((prompt[-1:] + rejected, trunk, p, REJECTED_BRANCH))
    width = _row_width([len(tokens) for tokens, *_ in parts], fixed)
    input_ids = torch.full((1, width), pad_id, dtype=torch.long)
    targets = torch.full((1, width), IGNORE_INDEX, dtype=torch.long)
    position_ids = torch.zeros((1, width), dtype=torch.long)
    branches = torch.zeros((1, width), dtype=torch.long)
    segments = torch.full((1, width), -1, dtype=torch.long)
    completion_tokens = torch.zeros(2 * pairs, dtype=torch.float32)
    nll_tokens, at = 0, 0
    spans: list[tuple[int, int]] = []  # (start, length) of each part, in ``parts`` order
    for tokens, first, p, branch in parts:
        n = len(tokens)
        spans.append((at, n))
        if n:
            input_ids[0, at : at + n] = torch.as_tensor(tokens, dtype=torch.long)
            position_ids[0, at : at + n] = torch.arange(first, first + n)
            branches[0, at : at + n] = branch
        if branch == TRUNK:
            trunk_at, trunk_len = at, n
        else:
            # the target at a position is the next token of the same sequence: inside the branch,
            # and at the trunk's last position (for the chosen sequence) the branch's first token
            slot = p if branch == CHOSEN_BRANCH else pairs + p
            targets[0, at : at + n - 1] = input_ids[0, at + 1 : at + n]
            segments[0, at : at + n - 1] = slot
            completion_tokens[slot] = n - 1
            if branch == CHOSEN_BRANCH:
                nll_tokens += n - 1
                if prompt_nll and trunk_len:
                    targets[0, trunk_at : trunk_at + trunk_len] = input_ids[0, trunk_at + 1 : trunk_at + trunk_len + 1]
                    segments[0, trunk_at : trunk_at + trunk_len] = 2 * pairs + p
                    nll_tokens += trunk_len
        at += n
    if at < width:  # the padding tail: a document of its own (positions from 0), no targets
        position_ids[0, at:] = torch.arange(width - at)
    starts = torch.nonzero(position_ids[0] == 0).squeeze(1).to(torch.int32)  # each pair's first token, the padding's
    batch = MicroBatch(
        input_ids=input_ids,
        attention_mask=None,
        targets=targets,
        trained_tokens=int((targets != IGNORE_INDEX).sum()),
        tokens=at,
        position_ids=position_ids,
        cu_seqlens=torch.cat([starts, starts.new_tensor([width])]),
        branches=branches,
        tree=tree_boundaries(spans, width) if fixed is None else _fixed_tree(spans, width, fixed),
    )
    batch.pairs = pairs
    batch.segments = segments
    batch.counted = torch.nonzero(segments.reshape(-1) >= 0).squeeze(1)
    batch.completion_tokens = completion_tokens
    batch.nll_tokens = nll_tokens
    return batch


def _fixed_tree(spans: Sequence[tuple[int, int]], width: int, fixed: FixedPairRows) -> TreeBoundaries:
    """:func:`tree_boundaries` in the fixed layout: its key count, and as many segments as
    ``fixed.pairs`` pairs and the padding make (two a pair, one), empty ones appended after the
    padding's where the batch has fewer pairs."""
    tree = tree_boundaries(spans, width, fixed.keys)
    count = 2 * fixed.pairs + 1
    return replace(tree, queries=_segments(tree.queries, count), keys=_segments(tree.keys, count))


def tree_boundaries(spans: Sequence[tuple[int, int]], width: int, fixed_keys: int | None = None) -> TreeBoundaries:
    """The varlen segments of a shared-prompt row whose parts (trunk, chosen, rejected per pair,
    in order) start and run as ``spans``; the padding from the last part to ``width`` is one
    more segment. Queries stay in row order: per pair, trunk + chosen is one segment (keys: the
    same tokens), rejected another (keys: the trunk's tokens, then its own), so the kernel's
    bottom-right causal alignment gives each rejected token the whole trunk and its own prefix.

    ``fixed_keys``: a fixed count of gathered keys (:class:`FixedPairRows`): the padding segment is
    always there, even empty, and takes the keys the pairs leave (the padding's own tokens, then
    the row's last token again), so every row of the run has the same boundary and key counts.
    Nothing but padding queries sees those keys."""
    queries, keys, key_index = [0], [0], []
    for (trunk, t), (chosen, c), (rejected, r) in zip(spans[0::3], spans[1::3], spans[2::3]):
        if chosen != trunk + t or rejected != chosen + c:
            raise ValueError(f"shared-prompt parts must lie trunk, chosen, rejected in a row, got {spans}")
        key_index += [range(trunk, trunk + t + c), range(trunk, trunk + t), range(rejected, rejected + r)]
        queries += [queries[-1] + t + c, queries[-1] + t + c + r]
        keys += [keys[-1] + t + c, keys[-1] + t + c + t + r]
    end = queries[-1]
    if fixed_keys is not None:
        used = keys[-1] + width - end
        if used > fixed_keys:
            raise ValueError(f"the pairs gather {used} keys, more than the fixed {fixed_keys}")
        key_index += [range(end, width), [width - 1] * (fixed_keys - used)]
        queries.append(width)
        keys.append(fixed_keys)
    elif end < width:
        key_index.append(range(end, width))
        queries.append(width)
        keys.append(keys[-1] + width - end)
    index = torch.tensor([i for part in key_index for i in part], dtype=torch.long)
    bounds = torch.tensor(queries, dtype=torch.int32), torch.tensor(keys, dtype=torch.int32)
    return TreeBoundaries(*bounds, index, max_keys=fixed_keys)  # every batch of a fixed layout: one int


def pair_rows_at(dataset, indices: Sequence[int]) -> list[dict[str, list[int]]]:
    """Pairs ``indices`` of a preference split (a HF ``datasets.Dataset`` or a sequence of row
    dicts), read with one call per micro-batch."""
    indices = [int(i) for i in indices]
    if not hasattr(dataset, "column_names"):
        return [dataset[i] for i in indices]
    batch = dataset[indices]
    return [{c: batch[c][j] for c in PAIR_COLUMNS} for j in range(len(indices))]
