"""Collation: right padding, next-token targets, masks and trained-token counts."""

import random

import torch
from datasets import Dataset

from hone.data.collate import IGNORE_INDEX, collate, rows_at


def _random_rows(n: int, rng: random.Random) -> list[dict[str, list[int]]]:
    rows = []
    for _ in range(n):
        length = rng.randint(1, 12)
        ids = [rng.randint(1, 50) for _ in range(length)]
        labels = [t if rng.random() < 0.7 else IGNORE_INDEX for t in ids]
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def test_padding_targets_and_counts_match_the_rows():
    rng = random.Random()
    rows = _random_rows(5, rng)
    pad = 99
    batch = collate(rows, pad_id=pad)
    width = max(len(r["input_ids"]) for r in rows)
    assert batch.input_ids.shape == batch.targets.shape == batch.attention_mask.shape == (5, width)
    expected_trained = 0
    for i, row in enumerate(rows):
        n = len(row["input_ids"])
        assert batch.input_ids[i, :n].tolist() == row["input_ids"]
        assert batch.input_ids[i, n:].eq(pad).all()
        assert batch.attention_mask[i, :n].eq(1).all() and batch.attention_mask[i, n:].eq(0).all()
        # targets[t] is the label of the next position; the last real position and padding have none
        assert batch.targets[i, : n - 1].tolist() == row["labels"][1:]
        assert batch.targets[i, n - 1 :].eq(IGNORE_INDEX).all()
        expected_trained += sum(1 for label in row["labels"][1:] if label != IGNORE_INDEX)
    assert batch.trained_tokens == expected_trained == int(batch.targets.ne(IGNORE_INDEX).sum())
    assert batch.tokens == sum(len(r["input_ids"]) for r in rows)
    assert batch.position_ids is None
    assert set(batch.model_inputs()) == {"input_ids", "attention_mask"}


def test_position_ids_are_padded_and_passed_to_the_model():
    rows = [
        {"input_ids": [5, 6, 7, 8], "labels": [5, 6, 7, 8], "position_ids": [0, 1, 0, 1]},
        {"input_ids": [9, 10], "labels": [-100, 10], "position_ids": [0, 1]},
    ]
    batch = collate(rows, pad_id=0)
    assert batch.position_ids.tolist() == [[0, 1, 0, 1], [0, 1, 0, 0]]
    assert "position_ids" in batch.model_inputs()
    assert batch.targets.tolist() == [[6, 7, 8, -100], [10, -100, -100, -100]]


def test_rows_at_reads_a_datasets_dataset_in_the_given_order():
    rows = _random_rows(7, random.Random())
    ds = Dataset.from_list(rows)
    order = [6, 0, 3]
    assert rows_at(ds, order) == [rows[i] for i in order]
    assert rows_at(rows, order) == [rows[i] for i in order]


def test_padded_rows_compute_what_unpadded_rows_compute():
    """Right padding must not change the logits of real positions (the basis of 4x1 == 1x4)."""
    from hone.testing import random_rows, tiny_llama

    model = tiny_llama(seed=random.randrange(1000)).eval()
    ds = random_rows(3, seed=random.randrange(1000), min_len=4, max_len=20)
    rows = rows_at(ds, range(3))
    together = collate(rows, pad_id=0)
    with torch.no_grad():
        logits = model(**together.model_inputs()).logits
        for i, row in enumerate(rows):
            alone = collate([row], pad_id=0)
            single = model(**alone.model_inputs()).logits[0]
            n = len(row["input_ids"])
            torch.testing.assert_close(logits[i, :n], single, rtol=1e-5, atol=1e-5)
