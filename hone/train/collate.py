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
looks right). An optional ``position_ids`` column (packed rows) is padded with zeros.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

IGNORE_INDEX = -100


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [B, T] long
    attention_mask: torch.Tensor  # [B, T] long, 1 = real token
    targets: torch.Tensor  # [B, T] long, next-token labels, -100 = no loss
    trained_tokens: int  # (targets != -100).sum(): the loss's denominator contribution
    tokens: int  # real (non-padding) input tokens
    position_ids: torch.Tensor | None = None

    def to(self, device: torch.device) -> "MicroBatch":
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        return MicroBatch(
            input_ids=move(self.input_ids),
            attention_mask=move(self.attention_mask),
            targets=move(self.targets),
            trained_tokens=self.trained_tokens,
            tokens=self.tokens,
            position_ids=move(self.position_ids),
        )

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """Keyword arguments for the model's forward (no labels: the loop computes the loss)."""
        inputs = {"input_ids": self.input_ids, "attention_mask": self.attention_mask}
        if self.position_ids is not None:
            inputs["position_ids"] = self.position_ids
        return inputs


def collate(rows: Sequence[Mapping[str, Sequence[int]]], pad_id: int) -> MicroBatch:
    """Pad ``rows`` to the longest one and shift the labels into next-token targets."""
    if not rows:
        raise ValueError("collate needs at least one row")
    width = max(len(r["input_ids"]) for r in rows)
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
