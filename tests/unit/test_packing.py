"""The packer (every document once, no bin over capacity, deterministic, tight on a realistic
mix), packed collation (positions and targets per document) and packed batch streams."""

import random

import numpy as np
import pytest
import torch

from hone.config.training import TrainingConfig
from hone.data.collate import IGNORE_INDEX, collate, collate_packed
from hone.data.packing import pack, row_lengths
from hone.errors import HoneError
from hone.testing import random_rows
from hone.train.batches import BatchStream, DataPosition, micro_batches, plan_steps


def lognormal_lengths(n: int, seed: int, median: int = 300, sigma: float = 1.0, cap: int = 4096) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(np.round(rng.lognormal(np.log(median), sigma, n)), 1, cap).astype(np.int64)


def test_every_document_appears_once_and_no_bin_overflows():
    seed = random.randrange(10_000)
    lengths = lognormal_lengths(20_000, seed, median=60, cap=512)
    packing = pack(lengths, 512, seed, group_size=3_000)
    assert np.array_equal(np.sort(packing.docs), np.arange(len(lengths)))
    sums = np.array([lengths[packing.bin(i)].sum() for i in range(packing.num_bins)])
    assert sums.max() <= 512 and sums.min() >= 1
    assert np.array_equal(sums, packing.bin_tokens)
    assert packing.tokens == lengths.sum()
    # best fit never leaves two bins that could have been one... per group at most a few
    assert packing.num_bins <= int(np.ceil(lengths.sum() / 512)) + 8


def test_packing_is_deterministic_by_seed():
    lengths = lognormal_lengths(5_000, 1, median=40, cap=256)
    a, b = pack(lengths, 256, seed=3, group_size=1_000), pack(lengths, 256, seed=3, group_size=1_000)
    c = pack(lengths, 256, seed=4, group_size=1_000)
    assert np.array_equal(a.docs, b.docs) and np.array_equal(a.offsets, b.offsets)
    assert not np.array_equal(a.docs, c.docs)


def test_realistic_mix_packs_above_97_percent():
    # log-normal lengths, median ~300, tail to 4096: the mix of the packing benchmark
    lengths = lognormal_lengths(50_000, random.randrange(10_000))
    packing = pack(lengths, 4096, seed=0)
    assert packing.efficiency >= 0.97
    padded_to_fixed = lengths.sum() / (len(lengths) * 4096)
    assert padded_to_fixed < 0.15  # what fixed-length padding would waste instead


def test_too_long_rows_are_refused_with_the_row():
    with pytest.raises(HoneError, match="row 1 has 9 tokens.*1..8"):
        pack(np.array([3, 9, 2]), 8, seed=0)


def _doc(length: int, gen: torch.Generator, masked_prompt: int = 0) -> dict[str, list[int]]:
    ids = torch.randint(1, 90, (length,), generator=gen).tolist()
    labels = [IGNORE_INDEX] * max(1, masked_prompt) + ids[max(1, masked_prompt) :]
    return {"input_ids": ids, "labels": labels}


def test_packed_rows_restart_positions_and_never_target_the_next_document():
    gen = torch.Generator().manual_seed(random.randrange(10_000))
    docs = [_doc(5, gen), _doc(1, gen), _doc(7, gen, masked_prompt=3), _doc(4, gen)]
    # labels[0] of these docs is trained (not -100), so only a per-document shift keeps the
    # last token of one document from targeting the next document's first token
    for d in docs:
        d["labels"][0] = d["input_ids"][0]
    batch = collate_packed([docs[:3], docs[3:]], width=16, pad_id=0)
    assert batch.input_ids.shape == (2, 16) and batch.attention_mask is None
    assert batch.position_ids[0].tolist() == [0, 1, 2, 3, 4, 0, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2]
    assert batch.position_ids[1].tolist() == [0, 1, 2, 3] + list(range(12))
    expect = []
    for d in docs[:3]:
        expect += d["labels"][1:] + [IGNORE_INDEX]
    expect += [IGNORE_INDEX] * 3
    assert batch.targets[0].tolist() == expect
    assert batch.targets[0, 4] == IGNORE_INDEX and batch.targets[0, 5] == IGNORE_INDEX  # boundaries
    assert batch.cu_seqlens.tolist() == [0, 5, 6, 13, 16, 20, 32]
    assert batch.tokens == 17
    assert batch.trained_tokens == sum(sum(l != IGNORE_INDEX for l in d["labels"][1:]) for d in docs)
    assert "attention_mask" not in batch.model_inputs() and "cu_seq_lens_q" not in batch.model_inputs()
    varlen = collate_packed([docs[:3]], width=16, pad_id=0).boundaries()
    assert varlen["cu_seq_lens_q"].tolist() == varlen["cu_seq_lens_k"].tolist() == [0, 5, 6, 13, 16]
    assert varlen["max_length_q"] == varlen["max_length_k"] == 16  # the row width: one int every step
    with pytest.raises(ValueError, match="packed micro-batches"):
        collate([docs[0]], pad_id=0).boundaries()


def test_prepared_rows_make_the_shift_safe_either_way(tmp_path, tokenizer, write_jsonl, make_data_config):
    """Prepared rows have labels[0] == -100 (nothing precedes a document's first token), so even
    shifting the concatenation would be safe; the per-document shift gives exactly the targets
    of a padded batch, and so the same trained-token count for the loss normalisation."""
    from hone.data.prepare import prepare_data

    rng = random.Random(random.randrange(10_000))
    words = ["red", "green", "blue", "fox", "lemon", "dog", "lime", "yes", "no"]
    rows = [{"text": " ".join(rng.choice(words) for _ in range(rng.randint(2, 12)))} for _ in range(12)]
    path = write_jsonl(tmp_path, rows)
    cfg = make_data_config([{"path": path, "type": "completion"}], sequence_len=64, sample_packing=True)
    prepared = prepare_data(cfg, tokenizer, use_cache=False)
    docs = [prepared.train[i] for i in range(len(prepared.train))]
    assert all(d["labels"][0] == IGNORE_INDEX for d in docs)
    packed = collate_packed([docs], width=sum(len(d["input_ids"]) for d in docs) + 3, pad_id=0)
    concat = [label for d in docs for label in d["labels"]]
    assert packed.targets[0, : len(concat)].tolist() == concat[1:] + [IGNORE_INDEX]
    padded = collate(docs, pad_id=0)
    assert packed.trained_tokens == padded.trained_tokens
    assert packed.targets[0, : len(concat)].tolist() == padded.targets[padded.attention_mask.bool()].tolist()
    assert prepared.packing["train"].rows == 12 and prepared.packing["train"].efficiency > 0.5


def test_collate_packed_refuses_an_overfull_bin():
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="more than 8 tokens"):
        collate_packed([[_doc(5, gen), _doc(4, gen)]], width=8, pad_id=0)


def test_packed_stream_steps_follow_bins_and_reshuffle_bins_each_epoch():
    rows = random_rows(60, seed=random.randrange(10_000), as_list=True, min_len=3, max_len=20)
    batches = micro_batches(rows, pack(row_lengths(rows), 32, seed=5, group_size=1000), pad_id=0)
    bins = batches.units
    assert bins < 60 and batches.packing.efficiency > 0.8
    training = TrainingConfig(micro_batch_size=2, gradient_accumulation_steps=1, num_epochs=2)
    plan = plan_steps(bins, training)
    assert plan.steps_per_epoch == bins // 2 and plan.total_steps == 2 * (bins // 2)
    stream = BatchStream(plan, seed=5)
    epochs = [[i for _ in range(plan.steps_per_epoch) for mb in stream.next_window() for i in mb] for _ in range(2)]
    for epoch in epochs:  # every bin at most once per epoch (an odd one out sits out)
        assert len(set(epoch)) == len(epoch) == 2 * plan.steps_per_epoch and set(epoch) <= set(range(bins))
    assert epochs[0] != epochs[1]
    # the position is resumable: a stream started at a saved position continues identically
    again = BatchStream(plan, seed=5)
    for _ in range(3):
        again.next_window()
    resumed = BatchStream(plan, seed=5, position=DataPosition(**again.position.as_dict()))
    assert resumed.next_window() == again.next_window()
    batch = batches([0, 1])
    assert batch.input_ids.shape == (2, 32) and batch.packed
    docs = [rows[int(d)] for b in (0, 1) for d in batches.packing.bin(b)]
    assert batch.tokens == sum(len(d["input_ids"]) for d in docs)


def test_fixed_boundaries_give_every_micro_batch_one_count_and_the_same_documents():
    """CUDA graphs over packed rows: each micro-batch's boundaries count the most segments any
    two bins hold (documents and padding tails), the real boundaries first, then empty segments
    at the end; nothing else about the batch changes."""
    rows = random_rows(80, seed=random.randrange(10_000), as_list=True, min_len=2, max_len=30)
    packing = pack(row_lengths(rows), 32, seed=3, group_size=1000)
    free = micro_batches(rows, packing, pad_id=0)
    fixed = micro_batches(rows, packing, pad_id=0, fixed_boundaries=2)
    per_bin = [len(packing.bin(b)) + int(packing.bin_tokens[b] < 32) for b in range(packing.num_bins)]
    most = sum(sorted(per_bin)[-2:])
    assert fixed.segments == packing.most_segments(2) == most and packing.most_segments(1) == max(per_bin)
    counts = set()
    for pair in ([b, (b + 1) % packing.num_bins] for b in range(packing.num_bins)):
        a, b = free(pair), fixed(pair)
        assert len(b.cu_seqlens) == most + 1
        real = len(a.cu_seqlens)
        assert torch.equal(b.cu_seqlens[:real], a.cu_seqlens) and (b.cu_seqlens[real:] == 2 * 32).all()
        for name in ("input_ids", "targets", "position_ids"):
            assert torch.equal(getattr(a, name), getattr(b, name))
        assert (a.tokens, a.trained_tokens) == (b.tokens, b.trained_tokens)
        counts.add(real - 1)
    assert len(counts) > 1  # the data really varies in its segment count: the test can fail
    one = fixed([0])  # a smaller last micro-batch still fits the count
    assert len(one.cu_seqlens) == most + 1 and one.cu_seqlens[-1] == 32


def test_a_micro_batch_with_more_segments_than_its_fixed_count_is_refused():
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="the micro-batch has 3 segments .* more than the 2 its fixed boundaries hold"):
        collate_packed([[_doc(3, gen), _doc(3, gen)]], width=8, pad_id=0, segments=2)


def _completion_rows(n: int, seed: int) -> list[dict[str, str]]:
    rng = random.Random(seed)
    words = ["red", "green", "blue", "fox", "lemon", "dog", "lime", "yes", "no"]
    return [{"text": " ".join(rng.choice(words) for _ in range(rng.randint(2, 12)))} for _ in range(n)]


def test_splits_are_packed_once_and_the_saved_bins_are_what_the_loop_gets(
    tmp_path, tokenizer, write_jsonl, make_data_config, monkeypatch
):
    """prepare_data packs each split once and saves the bins with the cached data; a cache hit,
    the loop's train split and its eval split load those bins (no second packing), and they
    equal packing the rows afresh with the config's seed."""
    import hone.data.packing as packing_module
    from hone.data.packing import PACKING_FILES, packing_for, split_packing
    from hone.data.prepare import prepare_data

    seed = random.randrange(10_000)
    path = write_jsonl(tmp_path, _completion_rows(40, seed))
    cfg = make_data_config(
        [{"path": path, "type": "completion"}],
        seed=seed,
        sequence_len=64,
        sample_packing=True,
        val_set_size=0.25,
        sample_packing_group_size=7,
    )
    first = prepare_data(cfg, tokenizer)
    assert set(first.packing) == {"train", "eval"}
    for name in ("train", "eval"):
        assert (first.cache_dir / PACKING_FILES[name]).is_file()

    def no_packing(*args, **kwargs):
        raise AssertionError("packed again")

    monkeypatch.setattr(packing_module, "pack", no_packing)
    again = prepare_data(cfg, tokenizer)
    assert again.cache_hit
    loop_train, loop_eval = packing_for(again.train, cfg, "train"), packing_for(again.eval, cfg, "eval")
    monkeypatch.undo()
    for name, split, loaded in (("train", again.train, loop_train), ("eval", again.eval, loop_eval)):
        fresh = split_packing(row_lengths(split), cfg, name)
        for got in (first.packing[name], again.packing[name], loaded):
            assert np.array_equal(got.docs, fresh.docs) and np.array_equal(got.offsets, fresh.offsets)
            assert np.array_equal(got.bin_tokens, fresh.bin_tokens) and got.capacity == 64
    assert np.array_equal(np.sort(loop_eval.docs), np.arange(len(again.eval)))  # every eval row, once
    assert loop_train.num_bins < len(again.train)


def test_saved_bins_for_other_rows_are_not_used(tmp_path):
    from hone.data.packing import load_packing, save_packing

    lengths = np.array([5, 3, 9, 2, 7], dtype=np.int64)
    packing = pack(lengths, 12, seed=1)
    save_packing(packing, lengths, tmp_path / "bins.npz")
    assert np.array_equal(load_packing(tmp_path / "bins.npz", lengths).docs, packing.docs)
    assert load_packing(tmp_path / "bins.npz", lengths[::-1].copy()) is None  # other rows: pack again
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    assert load_packing(tmp_path / "bad.npz") is None


def test_unpacked_splits_have_no_bins(tmp_path, make_data_config):
    from hone.data.packing import packing_for

    rows = random_rows(10, seed=1, as_list=True)
    cfg = make_data_config([{"path": tmp_path / "x.jsonl", "type": "completion"}], sequence_len=64)
    assert packing_for(rows, cfg, "train") is None and packing_for(rows, cfg, "eval") is None
    packed_eval_only = make_data_config(
        [{"path": tmp_path / "x.jsonl", "type": "completion"}], sequence_len=64, eval_sample_packing=True
    )
    assert packing_for(rows, packed_eval_only, "train") is None and packing_for(rows, packed_eval_only, "eval").rows == 10
