"""Turn dataset rows into one padded micro-batch.

Rows carry ``input_ids`` and ``labels`` of equal length, labels aligned with the inputs as in
Hugging Face (``labels[t]`` is the token at position ``t``; -100 = not trained). The batch
carries ``targets``: the labels already shifted left by one (``targets[t] = labels[t + 1]``,
-100 at the end), so the loss is a plain per-position cross entropy of ``logits[:, t]`` against
``targets[:, t]`` and the count of trained tokens is simply ``(targets != -100).sum()``. The
loss normalisation of the loop depends on that count matching the loss exactly; defining both
here keeps them from drifting apart.

Padding is on the right with the pad id, attention mask 0 and target -100, so a padded row
computes exactly what the unpadded row computes at its real positions (causal attention never
looks right). An optional ``position_ids`` column is padded with zeros.

Packed rows (:func:`collate_packed`) hold several documents each, always ``sequence_len``
wide so every micro-batch has one shape (``torch.compile`` sees no new shapes). Each document
gets its own ``position_ids`` from 0 and its own shifted targets: the target of a document's
last token is -100, never the next document's first token. The batch carries no 2D
``attention_mask``: the document-isolating mask is built from the restarting ``position_ids``
once per micro-batch on the device, in the form the run's attention kernel takes (see
:mod:`hone.models.attention.layout`). The padding tail is one
more "document" of pad tokens (positions from 0, targets -100) that no real token sees.
``cu_seqlens`` gives the boundaries over the flattened batch, which varlen kernels (torch's,
flash-attn's) take instead of a mask; see :meth:`MicroBatch.boundaries`.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from hone.models.attention.layout import AttentionLayout

IGNORE_INDEX = -100


@dataclass(frozen=True)
class TreeBoundaries:
    """Shared-prompt pairs as varlen segments (:mod:`hone.data.pairs`): each pair's trunk and
    chosen branch are one causal segment; its rejected branch is a segment of queries whose keys
    are the trunk's, then its own (the trunk's keys gathered again, ``key_index``). Built on the
    host with the batch, so the attention needs no device sync to find them."""

    queries: torch.Tensor  # [segments + 1] int32 boundaries over the flattened batch
    keys: torch.Tensor  # [segments + 1] int32 boundaries over the gathered keys
    key_index: torch.Tensor  # [keys] long: the flat token each gathered key is
    max_keys: int | None = None
    """An upper bound on a segment's keys for the kernel's ``max_length_k`` where it can exceed
    the row width (fixed pair rows: the padding segment takes the keys the pairs leave); None:
    the row width bounds them."""

    def to(self, move: Any) -> "TreeBoundaries":
        return TreeBoundaries(move(self.queries), move(self.keys), move(self.key_index), self.max_keys)


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [B, T] long
    attention_mask: torch.Tensor | None  # [B, T] long, 1 = real token; None for packed rows
    targets: torch.Tensor  # [B, T] long, next-token labels, -100 = no loss
    trained_tokens: int  # (targets != -100).sum(): the loss's denominator contribution
    tokens: int  # real (non-padding) input tokens
    position_ids: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None  # [docs + 1] int32 boundaries over the flattened batch
    attention_inputs: dict[str, Any] = field(default_factory=dict)
    """What a packed batch carries for the run's attention kernel (boundaries or hone's document
    mask), attached once per micro-batch by :meth:`with_attention` on the device."""
    # Preference pairs (:mod:`hone.data.pairs`); absent (0 / None) for SFT rows.
    pairs: int = 0
    """``P``: the pairs of a preference micro-batch (0: SFT rows)."""
    segments: torch.Tensor | None = None
    """[B, T] long, the sequence each target position sums into: ``p`` for chosen ``p``, ``P + p``
    for rejected ``p``, ``2P + p`` for chosen ``p``'s prompt (ORPO's NLL), -1 for none."""
    completion_tokens: torch.Tensor | None = None
    """[2P] float32: the chosen then the rejected completions' token counts."""
    counted: torch.Tensor | None = None
    """[n] long: the flat positions (over ``B * T``) whose segment is not -1, in order: the only
    rows of the hidden states the objective projects through the head (found on the host)."""
    nll_tokens: int = 0
    """Target tokens of the chosen sequences that ORPO's NLL averages over (0 without pairs)."""
    reference_logps: torch.Tensor | None = None
    """[2P] float32: the reference model's summed completion log-probs (chosen, then rejected),
    once computed (:mod:`hone.runtime.step`)."""
    branches: torch.Tensor | None = None
    """[B, T] long, shared-prompt pairs only (:mod:`hone.data.pairs`): 0 for a prompt's shared
    trunk (and padding), 1 and 2 for its chosen and rejected branches, which attend to the trunk
    and to themselves only."""
    tree: TreeBoundaries | None = None
    """Shared-prompt pairs only: the same branches as varlen segments, for the varlen kernel."""

    def to(self, device: torch.device) -> "MicroBatch":
        """The batch on ``device``. To a GPU the tensors go through pinned host memory, so the
        copies are truly asynchronous (from pageable memory the host waits for each one)."""
        pin = torch.device(device).type == "cuda"

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            if pin and t.device.type == "cpu":
                t = t.pin_memory()
            return t.to(device, non_blocking=True)

        return MicroBatch(
            input_ids=move(self.input_ids),
            attention_mask=move(self.attention_mask),
            targets=move(self.targets),
            trained_tokens=self.trained_tokens,
            tokens=self.tokens,
            position_ids=move(self.position_ids),
            cu_seqlens=move(self.cu_seqlens),
            attention_inputs=self.attention_inputs,
            pairs=self.pairs,
            segments=move(self.segments),
            completion_tokens=move(self.completion_tokens),
            counted=move(self.counted),
            nll_tokens=self.nll_tokens,
            reference_logps=move(self.reference_logps),
            branches=move(self.branches),
            tree=None if self.tree is None else self.tree.to(move),
        )

    def with_attention(self, layout: "AttentionLayout") -> "MicroBatch":
        """This batch carrying what ``layout`` needs (packed batches only; built once, used by
        every layer). Call it after :meth:`to`, so masks are built on the device."""
        if not self.packed or self.position_ids is None:
            return self
        return replace(self, attention_inputs=layout.packed_inputs(self.position_ids, self.boundaries(), self.branches))

    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None

    @property
    def padded(self) -> bool:
        """Whether any row has padding (counted on the host when the batch was made)."""
        return self.tokens < self.input_ids.numel()

    def model_inputs(self) -> dict[str, torch.Tensor | int]:
        """Keyword arguments for the model's forward (no labels: the loop computes the loss).

        A padding mask goes in only when there is padding: handed an all-ones mask, transformers
        checks on the device whether it may drop it (a host sync in every forward)."""
        inputs: dict[str, torch.Tensor | int] = {"input_ids": self.input_ids}
        if self.attention_mask is not None and self.padded:
            inputs["attention_mask"] = self.attention_mask
        if self.position_ids is not None:
            inputs["position_ids"] = self.position_ids
        inputs.update(self.attention_inputs)
        return inputs

    def boundaries(self) -> dict[str, torch.Tensor | int]:
        """The document boundaries of a packed batch as the keyword arguments transformers
        defines for varlen attention (``FlashAttentionKwargs``).

        The longest-segment argument is the row width, an upper bound the kernels accept (it
        only sizes their launch grid), so that a compiled layer sees the same int every step;
        the number of boundaries varies from batch to batch and is marked dynamic for the same
        reason.
        """
        if self.cu_seqlens is None:
            raise ValueError("boundaries() is for packed micro-batches (collate_packed)")
        width = self.input_ids.shape[1]
        if self.tree is not None:  # shared-prompt pairs: the keys' own segments and order
            from hone.models.attention.varlen import TREE_KEYS

            for t in (self.tree.queries, self.tree.keys, self.tree.key_index):
                torch._dynamo.maybe_mark_dynamic(t, 0)
            return {
                "cu_seq_lens_q": self.tree.queries,
                "cu_seq_lens_k": self.tree.keys,
                "max_length_q": width,
                "max_length_k": self.tree.max_keys or width,
                TREE_KEYS: self.tree.key_index,
            }
        torch._dynamo.maybe_mark_dynamic(self.cu_seqlens, 0)
        return {"cu_seq_lens_q": self.cu_seqlens, "cu_seq_lens_k": self.cu_seqlens, "max_length_q": width, "max_length_k": width}


def collate(rows: Sequence[Mapping[str, Sequence[int]]], pad_id: int, width: int | None = None) -> MicroBatch:
    """Pad ``rows`` to the longest one (or to ``width``: one shape for every micro-batch,
    ``data.pad_to_sequence_len``) and shift the labels into next-token targets."""
    if not rows:
        raise ValueError("collate needs at least one row")
    longest = max(len(r["input_ids"]) for r in rows)
    if width is not None and longest > width:
        raise ValueError(f"collate: a row of {longest} tokens does not fit the fixed width of {width} (data.sequence_len)")
    width = longest if width is None else width
    n = len(rows)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((n, width), dtype=torch.long)
    targets = torch.full((n, width), IGNORE_INDEX, dtype=torch.long)
    has_positions = "position_ids" in rows[0]
    position_ids = torch.zeros((n, width), dtype=torch.long) if has_positions else None
    for i, row in enumerate(rows):
        ids, labels = row["input_ids"], row["labels"]
        if len(labels) != len(ids):
            raise ValueError(f"row {i}: {len(ids)} input_ids but {len(labels)} labels")
        length = len(ids)
        input_ids[i, :length] = torch.as_tensor(ids, dtype=torch.long)
        attention_mask[i, :length] = 1
        if length > 1:
            targets[i, : length - 1] = torch.as_tensor(labels[1:], dtype=torch.long)
        if position_ids is not None:
            position_ids[i, :length] = torch.as_tensor(row["position_ids"], dtype=torch.long)
    return MicroBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        targets=targets,
        trained_tokens=int((targets != IGNORE_INDEX).sum()),
        tokens=int(attention_mask.sum()),
        position_ids=position_ids,
    )


def collate_packed(
    bins: Sequence[Sequence[Mapping[str, Sequence[int]]]], width: int, pad_id: int, segments: int | None = None
) -> MicroBatch:
    """One packed micro-batch of ``len(bins)`` rows, each ``width`` tokens wide.

    ``bins[i]`` are the documents (rows with ``input_ids`` and ``labels``) packed into row ``i``.
    ``segments``: the boundaries count exactly that many segments, the real ones followed by
    empty ones (every boundary past the last token repeats it), so that every micro-batch hands
    the attention one shape (CUDA graphs; varlen kernels skip an empty segment, hone's
    document mask never reads the boundaries); None: as many as the batch has.
    """
    if not bins:
        raise ValueError("collate_packed needs at least one bin")
    n = len(bins)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    targets = torch.full((n, width), IGNORE_INDEX, dtype=torch.long)
    position_ids = torch.zeros((n, width), dtype=torch.long)
    lengths: list[int] = []  # of documents and padding tails, row after row
    real = 0
    for i, docs in enumerate(bins):
        at = 0
        for j, doc in enumerate(docs):
            ids, labels = doc["input_ids"], doc["labels"]
            length = len(ids)
            if len(labels) != length:
                raise ValueError(f"bin {i}, document {j}: {length} input_ids but {len(labels)} labels")
            if at + length > width:
                raise ValueError(f"bin {i} holds more than {width} tokens")
            input_ids[i, at : at + length] = torch.as_tensor(ids, dtype=torch.long)
            if length > 1:  # shifted inside the document: its last token has no target
                targets[i, at : at + length - 1] = torch.as_tensor(labels[1:], dtype=torch.long)
            position_ids[i, at : at + length] = torch.arange(length)
            lengths.append(length)
            at += length
        real += at
        if at < width:
            position_ids[i, at:] = torch.arange(width - at)
            lengths.append(width - at)
    cu_seqlens = _boundaries(lengths, segments)
    return MicroBatch(
        input_ids=input_ids,
        attention_mask=None,
        targets=targets,
        trained_tokens=int((targets != IGNORE_INDEX).sum()),
        tokens=real,
        position_ids=position_ids,
        cu_seqlens=cu_seqlens,
    )


def _boundaries(lengths: Sequence[int], segments: int | None) -> torch.Tensor:
    """``cu_seqlens`` of segments of ``lengths``, padded with empty segments to ``segments``."""
    count = len(lengths) if segments is None else segments
    if count < len(lengths):
        raise ValueError(
            f"collate_packed: the micro-batch has {len(lengths)} segments (documents and padding tails), "
            f"more than the {segments} its fixed boundaries hold"
        )
    cu_seqlens = torch.zeros(count + 1, dtype=torch.int32)
    cu_seqlens[1 : len(lengths) + 1] = torch.cumsum(torch.as_tensor(lengths, dtype=torch.int32), 0)
    cu_seqlens[len(lengths) + 1 :] = sum(lengths)
    return cu_seqlens


def rows_at(dataset, indices: Sequence[int]) -> list[dict[str, list[int]]]:
    """Rows ``indices`` of a HF ``datasets.Dataset`` (or any sequence of row dicts), as dicts.

    Fetching a whole micro-batch with one ``dataset[list]`` call reads Arrow once per column
    instead of once per row.
    """
    indices = [int(i) for i in indices]
    if not hasattr(dataset, "column_names"):  # a plain sequence of row dicts
        return [dataset[i] for i in indices]
    batch = dataset[indices]  # a dict of columns
    columns = [c for c in ("input_ids", "labels", "position_ids") if c in batch]
    return [{c: batch[c][j] for c in columns} for j in range(len(indices))]
