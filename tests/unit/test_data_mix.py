"""Length policy (drop / truncate), mixing weights, validation split, shuffling."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest

from hone.data import mix
from hone.data.errors import DataError
from hone.data.prepare import prepare_data


def completion_rows(rng: random.Random, n: int, tag: str = "row", max_words: int = 40) -> list[dict]:
    words = ["lemon", "river", "Veloria", "yellow", "stone", "über", "42", "capital"]
    return [{"text": f"{tag}{i}: " + " ".join(rng.choices(words, k=rng.randint(1, max_words)))} for i in range(n)]


def tag_of(tokenizer, row) -> str:
    return tokenizer.decode(row["input_ids"], skip_special_tokens=True).split(":")[0]


# ---------------------------------------------------------------- length


@pytest.mark.parametrize("strategy", ["drop", "truncate"])
def test_rows_longer_than_sequence_len_are_dropped_or_truncated_and_counted(
    tmp_path, write_jsonl, make_data_config, tokenizer, strategy
):
    rng = random.Random(10)
    rows = completion_rows(rng, 60)
    full_lengths = {r["text"]: len(tokenizer(r["text"])["input_ids"]) + 1 for r in rows}  # + EOS
    limit = int(np.median(list(full_lengths.values())))
    too_long = sum(length > limit for length in full_lengths.values())
    assert 0 < too_long < len(rows)
    path = write_jsonl(tmp_path, rows)
    cfg = make_data_config([{"path": path, "type": "completion"}], sequence_len=limit, excess_length_strategy=strategy)
    prepared = prepare_data(cfg, tokenizer)
    stats = prepared.stats.sources[0]
    lengths = [len(r["input_ids"]) for r in prepared.train]
    assert max(lengths) <= limit and all(r["length"] == len(r["input_ids"]) for r in prepared.train)
    if strategy == "drop":
        assert stats.dropped_too_long == too_long and stats.truncated == 0
        assert len(prepared.train) == len(rows) - too_long
        assert all(r["input_ids"][-1] == tokenizer.eos_token_id for r in prepared.train)
    else:
        assert stats.truncated == too_long and stats.dropped_too_long == 0
        assert len(prepared.train) == len(rows)
        cut = [r for r in prepared.train if len(r["input_ids"]) == limit and r["input_ids"][-1] != tokenizer.eos_token_id]
        assert len(cut) == too_long  # a truncated row loses its EOS: the text did not end there
    assert prepared.stats.train.dropped_too_long == stats.dropped_too_long
    assert prepared.stats.train.truncated == stats.truncated


def test_truncation_that_removes_every_trained_token_drops_the_row(tmp_path, write_jsonl, make_data_config, tokenizer):
    long_prompt = "lemon " * 40
    rows = [
        {"instruction": long_prompt, "output": "yellow"},  # the answer lies beyond sequence_len
        {"instruction": "short", "output": "yes"},
        {"instruction": "lemon " * 5, "output": "kept"},
    ]
    path = write_jsonl(tmp_path, rows)
    cfg = make_data_config([{"path": path, "type": "alpaca"}], sequence_len=32, excess_length_strategy="truncate")
    prepared = prepare_data(cfg, tokenizer)
    stats = prepared.stats.sources[0]
    assert stats.dropped_no_trained == 1 and prepared.stats.train.dropped_no_trained == 1
    assert len(prepared.train) == 2
    assert all(any(label != -100 for label in r["labels"]) for r in prepared.train)
    assert stats.truncated == 0  # counted over kept rows only


# ---------------------------------------------------------------- weights


def test_mixing_weights_use_each_row_weight_times(tmp_path, write_jsonl, make_data_config, tokenizer):
    rng = random.Random(11)
    sizes = {"half": 40, "once": 30, "twice": 20, "oneandahalf": 24}
    weights = {"half": 0.5, "once": 1.0, "twice": 2.0, "oneandahalf": 1.5}
    datasets = []
    for tag, n in sizes.items():
        path = write_jsonl(tmp_path, completion_rows(rng, n, tag=f"{tag}-", max_words=5), name=f"{tag}.jsonl")
        datasets.append({"path": path, "type": "completion", "weight": weights[tag]})
    prepared = prepare_data(make_data_config(datasets), tokenizer)
    uses = Counter(tag_of(tokenizer, r) for r in prepared.train)
    per_tag = {tag: sum(count for name, count in uses.items() if name.startswith(f"{tag}-")) for tag in sizes}
    assert per_tag["half"] == 20 and per_tag["once"] == 30 and per_tag["twice"] == 40 and per_tag["oneandahalf"] == 36
    assert {uses[f"twice-{i}"] for i in range(20)} == {2}
    assert {uses[f"once-{i}"] for i in range(30)} == {1}
    assert set(uses[f"half-{i}"] for i in range(40)) == {0, 1}
    assert Counter(uses[f"oneandahalf-{i}"] for i in range(24)) == {1: 12, 2: 12}
    assert [s.rows_train for s in prepared.stats.sources] == [20, 30, 40, 36]
    assert prepared.stats.train.rows == len(prepared.train) == 126


def test_apply_weight_is_seeded_and_fractional_part_has_no_repeats():
    rows = np.arange(100, 150)
    a = mix.apply_weight(rows, 0.3, seed=1, index=0)
    assert len(a) == 15 and len(set(a.tolist())) == 15 and set(a.tolist()) <= set(rows.tolist())
    assert np.array_equal(a, mix.apply_weight(rows, 0.3, seed=1, index=0))
    assert not np.array_equal(a, mix.apply_weight(rows, 0.3, seed=2, index=0))
    assert not np.array_equal(a, mix.apply_weight(rows, 0.3, seed=1, index=1))
    assert Counter(mix.apply_weight(rows, 3.0, seed=1, index=0).tolist()) == {r: 3 for r in rows.tolist()}


# ---------------------------------------------------------------- validation split and order


def test_val_split_is_deterministic_disjoint_and_sized(tmp_path, write_jsonl, make_data_config, tokenizer):
    rng = random.Random(12)
    path_a = write_jsonl(tmp_path, completion_rows(rng, 80, tag="a", max_words=6), name="a.jsonl")
    path_b = write_jsonl(tmp_path, completion_rows(rng, 40, tag="b", max_words=6), name="b.jsonl")
    datasets = [{"path": path_a, "type": "completion"}, {"path": path_b, "type": "completion", "weight": 2}]

    def split(seed: int, cache: str):
        prepared = prepare_data(
            make_data_config(datasets, seed=seed, val_set_size=0.25, dataset_prepared_path=str(tmp_path / cache)), tokenizer
        )
        return [tag_of(tokenizer, r) for r in prepared.train], [tag_of(tokenizer, r) for r in prepared.eval], prepared

    train, evaluation, prepared = split(7, "c1")
    assert len(evaluation) == 20 + 10 == prepared.stats.eval.rows
    assert set(train).isdisjoint(evaluation)
    assert len(train) == 60 + 2 * 30
    assert [s.rows_eval for s in prepared.stats.sources] == [20, 10]
    train2, evaluation2, hit = split(7, "c2")  # a fresh cache: recomputed, not loaded
    assert not hit.cache_hit
    assert (train2, evaluation2) == (train, evaluation)
    train3, evaluation3, _ = split(8, "c3")
    assert set(evaluation3) != set(evaluation) and len(evaluation3) == len(evaluation)


def test_train_is_shuffled_by_seed(tmp_path, write_jsonl, make_data_config, tokenizer):
    rows = completion_rows(random.Random(13), 50, max_words=4)
    path = write_jsonl(tmp_path, rows)

    def order(seed):
        return [
            tag_of(tokenizer, r)
            for r in prepare_data(make_data_config([{"path": path, "type": "completion"}], seed=seed), tokenizer).train
        ]

    first = order(1)
    assert sorted(first) == sorted(f"row{i}" for i in range(50))
    assert first != [f"row{i}" for i in range(50)]
    assert order(1) == first and order(2) != first


def test_test_datasets_are_the_eval_split(tmp_path, write_jsonl, make_data_config, tokenizer):
    rng = random.Random(14)
    train = write_jsonl(tmp_path, completion_rows(rng, 30, tag="t", max_words=4), name="train.jsonl")
    evaluation = write_jsonl(tmp_path, completion_rows(rng, 12, tag="e", max_words=4), name="eval.jsonl")
    cfg = make_data_config(
        [{"path": train, "type": "completion"}], test_datasets=[{"path": evaluation, "type": "completion", "weight": 0.5}]
    )
    prepared = prepare_data(cfg, tokenizer)
    assert len(prepared.train) == 30 and len(prepared.eval) == 6
    assert all(tag_of(tokenizer, r).startswith("e") for r in prepared.eval)
    assert prepared.stats.sources[1].split == "eval" and prepared.stats.sources[1].rows_eval == 6


def test_no_eval_without_val_split_or_test_datasets(tmp_path, write_jsonl, make_data_config, tokenizer):
    path = write_jsonl(tmp_path, completion_rows(random.Random(15), 5))
    prepared = prepare_data(make_data_config([{"path": path, "type": "completion"}]), tokenizer)
    assert prepared.eval is None and prepared.stats.eval is None


def test_val_split_that_holds_out_nothing_is_an_error(tmp_path, write_jsonl, make_data_config, tokenizer):
    path = write_jsonl(tmp_path, completion_rows(random.Random(16), 5))
    with pytest.raises(DataError, match=r"val_set_size = 0.01 of 5 usable rows holds out no row"):
        prepare_data(make_data_config([{"path": path, "type": "completion"}], val_set_size=0.01), tokenizer)
