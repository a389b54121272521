"""Fixed pair rows (:class:`hone.data.pairs.FixedPairRows`): under CUDA graphs every pair
micro-batch of a run takes one layout, so a compiled layer sees one set of shapes. The layout's
size from the data statistics, the shapes of batches of different pairs, the log-probabilities
against the rows as wide as their pairs (fp32, 1e-5), where the plan takes it, and the mark of a
new CUDA-graph generation at each pass over the layers."""

import os
import random

import numpy as np
import pytest
import torch

from hone import testing
from hone.data.pairs import ALIGN, FixedPairRows, collate_pairs, fixed_pair_rows
from hone.data.stats import SplitStats
from hone.models.adapters import adapters_off
from hone.models.attention.layout import layout_for
from hone.models.attention.varlen import register_varlen_sdpa
from hone.models.structure import causal_lm_parts
from hone.runtime.pair_loss import PairLoss
from hone.runtime.step import forward_hidden
from hone.testing import tiny_model, tiny_tokenizer

SEED = int(os.environ.get("HONE_TEST_SEED", random.randrange(10_000)))


def _stats(pairs) -> SplitStats:
    parts = np.array([[len(p["prompt_ids"]), len(p["chosen_ids"]), len(p["rejected_ids"])] for p in pairs])
    lengths = parts[:, 0] + parts[:, 1:].max(axis=1)
    return SplitStats.from_arrays(lengths, parts[:, 1:].sum(axis=1), [], parts)


def _batches(pairs, per_batch, share, fixed):
    return [
        collate_pairs(pairs[i : i + per_batch], pad_id=0, share_prompt=share, fixed=fixed)
        for i in range(0, len(pairs), per_batch)
    ]


def test_the_statistics_count_the_longest_pair_and_size_the_rows_from_it():
    pairs = [
        {"prompt_ids": [1] * 30, "chosen_ids": [2] * 5, "rejected_ids": [3] * 5},  # the longest prompt
        {"prompt_ids": [1] * 4, "chosen_ids": [2] * 40, "rejected_ids": [3] * 20},  # the longest pair: 64
    ]
    stats = _stats(pairs)
    assert stats.max_pair_tokens == 64
    shared = fixed_pair_rows([stats], 2, share_prompt=True)
    width = -(-2 * 65 // ALIGN) * ALIGN  # two pairs of 64 tokens and their branches' extra token
    assert shared == FixedPairRows(width=width, keys=width + 2 * 29, pairs=2)  # trunks 2 x 29 gathered again
    unshared = fixed_pair_rows([stats], 1, share_prompt=False)
    assert unshared.width == -(-94 // ALIGN) * ALIGN  # 64 + its prompt bound 30
    older = SplitStats(**{**stats.__dict__, "max_pair_tokens": 0})  # statistics written before the count
    assert fixed_pair_rows([older], 1, share_prompt=True).width >= fixed_pair_rows([stats], 1, share_prompt=True).width
    with pytest.raises(ValueError, match="statistics of a preference split"):
        fixed_pair_rows([SplitStats.from_arrays(np.array([3]), np.array([3]), [])], 1, share_prompt=True)


@pytest.mark.parametrize("share", [True, False])
def test_every_micro_batch_has_the_same_shapes_and_one_padding_segment_even_when_full(share):
    pairs = testing.random_pairs(6, SEED, shortest_prompt=1)
    fixed = fixed_pair_rows([_stats(pairs)], 2, share_prompt=share)

    def shapes(batch):
        bounds = (batch.tree.queries, batch.tree.keys, batch.tree.key_index) if share else (batch.cu_seqlens,)
        return tuple(tuple(t.shape) for t in (batch.input_ids, batch.position_ids, *bounds))

    batches = _batches(pairs, 2, share, fixed)
    batches.append(collate_pairs(pairs[:1], pad_id=0, share_prompt=share, fixed=fixed))  # a last, smaller batch
    assert len({shapes(b) for b in batches}) == 1
    # pairs that fill a row to its last token still end in a (now empty) padding segment
    tokens = collate_pairs(pairs[:2], pad_id=0, share_prompt=share).tokens
    trunks = sum(len(p["prompt_ids"]) - 1 for p in pairs[:2]) if share else 0
    full = collate_pairs(pairs[:2], pad_id=0, share_prompt=share, fixed=FixedPairRows(tokens, tokens + trunks, pairs=2))
    bounds = full.tree.queries if share else full.cu_seqlens
    assert bounds[-1] == bounds[-2] == tokens
    assert len(bounds) == len(batches[0].tree.queries if share else batches[0].cu_seqlens)
    if share:
        assert full.tree.keys[-1] == len(full.tree.key_index) == tokens + trunks
        assert batches[0].tree.keys[-1] == len(batches[0].tree.key_index) == fixed.keys
        # the kernel's longest-key-segment bound: one int for every batch, above any segment
        kwargs = {b.boundaries()["max_length_k"] for b in batches}
        assert kwargs == {fixed.keys} and all(int(b.tree.keys.diff().max()) <= fixed.keys for b in batches)


def test_pairs_longer_than_the_fixed_row_are_refused():
    pairs = testing.random_pairs(2, SEED, shortest_prompt=1)
    with pytest.raises(ValueError, match="exceed the fixed pair row of 64 tokens"):
        collate_pairs(pairs * 40, pad_id=0, share_prompt=True, fixed=FixedPairRows(width=64, keys=200, pairs=80))


@pytest.mark.parametrize("share", [True, False])
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3"])
def test_fixed_rows_give_the_log_probs_of_rows_as_wide_as_their_pairs(preset, share):
    """Through hone's varlen backend (its reference on the CPU): the padding segment and the
    keys it takes change nothing for the pairs."""
    model = tiny_model(preset, tiny_tokenizer(), seed=SEED)
    model.set_attn_implementation(register_varlen_sdpa())
    model.eval()
    pairs = testing.random_pairs(4, SEED + 3, vocab=model.config.vocab_size, shortest_prompt=1)
    fixed = fixed_pair_rows([_stats(pairs)], 2, share_prompt=share)
    decoder, head = causal_lm_parts(model)
    layout = layout_for(model, shares_prompt=share)
    loss = PairLoss("dpo", beta=0.1)
    frees, pinned_batches = _batches(pairs, 2, share, None), _batches(pairs, 2, share, fixed)
    frees.append(collate_pairs(pairs[:1], pad_id=0, share_prompt=share))  # a last, smaller batch
    pinned_batches.append(collate_pairs(pairs[:1], pad_id=0, share_prompt=share, fixed=fixed))
    for free, pinned in zip(frees, pinned_batches, strict=True):
        assert pinned.input_ids.shape[1] >= free.input_ids.shape[1]
        with torch.no_grad():
            want = loss.logps(forward_hidden(decoder, free.with_attention(layout)), head, free)
            got = loss.logps(forward_hidden(decoder, pinned.with_attention(layout)), head, pinned)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _preference(reference="auto", **performance):
    from hone.config import parse_config

    return parse_config(
        {
            "model": {"preset": "tiny-qwen3", "dtype": "bfloat16"},
            "data": {"datasets": [{"path": "p.jsonl", "type": "preference"}], "sequence_len": 64},
            "training": {"objective": "dpo", "micro_batch_size": 2, "preference": {"reference": reference}},
            "performance": performance,
        }
    )


def test_cuda_graphs_true_lays_every_pair_row_out_alike_and_auto_leaves_them_off():
    """Explicit CUDA graphs on a preference run: the config no longer refuses them, the plan
    finds one shape, and the attention layout carries the fixed rows sized for the plan's
    sharing; ``auto`` keeps them off (a dense step, not measured with graphs)."""
    from hone.train.run import shape_note
    from hone.transforms.base import RunFacts
    from hone.transforms.planner import plan_optimizations

    pairs = testing.random_pairs(6, SEED, shortest_prompt=1)
    stats = _stats(pairs)
    model = testing.with_random_lora(tiny_model("tiny-qwen3", tiny_tokenizer(), seed=SEED), seed=SEED)
    for explicit, on in ((True, True), ("auto", False)):
        cfg = _preference(cuda_graphs=explicit, torch_compile=True)
        note = shape_note(cfg, None)
        assert (note is None) is on
        facts = RunFacts(torch.device("cuda"), shape_note=note, pair_splits=(stats,), memory_bytes=80 * 2**30)
        plan = plan_optimizations(cfg, facts)
        assert plan.decided.cuda_graphs is on
        hooks = plan.hooks(model, cfg, facts)
        if on:
            fixed = fixed_pair_rows([stats], 2, share_prompt=plan.decided.share_prompt)
            assert hooks.fixed_pairs == fixed
            recorded = {k: v for a in plan.applied for k, v in a.details.items()}
            assert recorded["pair_rows"] == {"width": fixed.width, "keys": fixed.keys}  # optimizations.json says so
        else:
            assert hooks.fixed_pairs is None


def test_every_pass_over_the_layers_marks_a_new_cuda_graph_generation(monkeypatch):
    """The reference's pass, the policy's and eval's each begin a cudagraph-trees generation
    (hone.runtime.step.begin_pass), so a pass without grad keeps its layers' outputs alive
    through the pass; the mark is a counter where no graph was recorded (CPU)."""
    from hone.runtime import step

    marks = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    model = testing.with_random_lora(tiny_model("tiny-qwen3", tiny_tokenizer(), seed=SEED), seed=SEED)
    pairs = testing.random_pairs(2, SEED, vocab=model.config.vocab_size, shortest_prompt=1)
    batch = collate_pairs(pairs, pad_id=0).with_attention(layout_for(model))
    decoder, head = causal_lm_parts(model)
    loss = PairLoss("dpo", beta=0.1, reference_off=adapters_off(model))
    step.decoder_head_loss(decoder, head, batch, loss)  # the reference's pass, then the policy's
    assert len(marks) == 2
