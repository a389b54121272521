"""Context parallelism in one process: the shard's slices and counts (``shard_micro_batch``), its
refusals (left padding, a length N does not divide, a packed batch without its whole-sequence
attention inputs), what ``context_parallel_problems`` refuses and why, and how
``enable_context_parallel`` switches a model (the exchange itself runs on several ranks:
tests/distributed/test_context_parallel.py)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from hone.data.collate import MicroBatch, collate, collate_packed
from hone.models.attention.causal import CAUSAL_SDPA, register_causal_sdpa
from hone.models.attention.layout import layout_for
from hone.models.attention.ulysses import (
    CONTEXT_SHARD_ATTR,
    ContextParallelError,
    context_parallel_problems,
    enable_context_parallel,
    ulysses_attention,
)
from hone.models.attention.varlen import VARLEN_SDPA, register_varlen_sdpa
from hone.models.attention.wrapped import ULYSSES_NAMES, inner_implementation
from hone.models.presets import build_preset_config
from hone.parallel.context_parallel import ContextShard, heads_to_seq, seq_to_heads, shard_micro_batch


def _rows(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for n in lengths:
        ids = torch.randint(1, 50, (n,), generator=gen).tolist()
        rows.append({"input_ids": ids, "labels": [-100] + ids[1:]})
    return rows


def _shards(batch, size):
    return [shard_micro_batch(batch, ContextShard(size, rank)) for rank in range(size)]


# ---------------------------------------------------------------- ContextShard


def test_a_shard_is_a_contiguous_slice():
    t = torch.arange(24).view(2, 12)
    assert ContextShard(3, 1).local(t).tolist() == [[4, 5, 6, 7], [16, 17, 18, 19]]
    assert ContextShard(2, 1).local(t, dim=0).tolist() == [list(range(12, 24))]


@pytest.mark.parametrize("size,rank", [(0, 0), (2, 2), (2, -1)])
def test_a_shard_outside_its_group_is_refused(size, rank):
    with pytest.raises(ValueError, match="context parallel"):
        ContextShard(size, rank)


def test_a_length_the_ranks_cannot_split_is_named():
    with pytest.raises(ValueError, match=r"10 is not a multiple of context_parallel 4"):
        ContextShard(4, 0).local(torch.zeros(1, 10))


def test_one_rank_exchanges_nothing():
    x = torch.randn(2, 4, 6, 3)
    shard = ContextShard(1, 0)
    assert seq_to_heads(x, shard) is x and heads_to_seq(x, shard) is x


# ---------------------------------------------------------------- shard_micro_batch


def test_padded_rows_are_sliced_with_global_positions_and_recounted():
    batch = collate(_rows([8, 5, 2]), pad_id=0)
    shards = _shards(batch, 2)
    for rank, shard in enumerate(shards):
        cut = slice(4 * rank, 4 * rank + 4)
        assert torch.equal(shard.input_ids, batch.input_ids[:, cut])
        assert torch.equal(shard.targets, batch.targets[:, cut])
        assert shard.position_ids.tolist() == [list(range(4 * rank, 4 * rank + 4))] * 3
        assert shard.attention_mask is None and "attention_mask" not in shard.model_inputs()
    assert [s.trained_tokens for s in shards] == [
        int((batch.targets[:, :4] != -100).sum()),
        int((batch.targets[:, 4:] != -100).sum()),
    ]
    assert sum(s.trained_tokens for s in shards) == batch.trained_tokens
    assert [s.tokens for s in shards] == [4 + 4 + 2, 4 + 1 + 0]
    assert sum(s.tokens for s in shards) == batch.tokens


def test_the_counts_read_the_host_copy_never_the_device():
    """Given the batch's host copy, sharding reads nothing from the device batch: here its tensors
    are on the meta device, which has no values, so any count or check taken from them fails."""
    host = collate(_rows([8, 5, 2], seed=3), pad_id=0)
    device = host.to(torch.device("meta"))
    for rank in range(2):
        shard = ContextShard(2, rank)
        got, want = shard_micro_batch(device, shard, host), shard_micro_batch(host, shard)
        assert (got.trained_tokens, got.tokens) == (want.trained_tokens, want.tokens)
        assert got.input_ids.device.type == "meta" and got.input_ids.shape == want.input_ids.shape
    with pytest.raises(RuntimeError):  # without its host copy it reads the device (meta: no values)
        shard_micro_batch(device, ContextShard(2, 0))


def test_packed_rows_keep_their_document_positions_and_whole_attention_inputs():
    batch = collate_packed([_rows([3, 4]), _rows([5, 1], seed=1)], 8, pad_id=0)
    batch = batch.with_attention(layout_for(_model(CAUSAL_SDPA)))
    assert batch.attention_inputs["attention_mask"].shape == (2, 1, 8, 8)
    shards = _shards(batch, 4)
    for rank, shard in enumerate(shards):
        assert torch.equal(shard.position_ids, batch.position_ids[:, 2 * rank : 2 * rank + 2])
        assert shard.attention_inputs["attention_mask"] is batch.attention_inputs["attention_mask"]  # whole
    assert shards[1].position_ids.tolist() == [[2, 0], [2, 3]]  # restarting per document
    assert sum(s.trained_tokens for s in shards) == batch.trained_tokens
    assert sum(s.tokens for s in shards) == batch.tokens == 13


def test_one_rank_keeps_the_batch():
    batch = collate(_rows([4, 3]), pad_id=0)
    assert shard_micro_batch(batch, ContextShard(1, 0)) is batch


def test_a_left_padded_row_is_refused():
    batch = collate(_rows([6, 6]), pad_id=0)
    mask = batch.attention_mask.clone()
    mask[1, :2] = 0
    left = MicroBatch(batch.input_ids, mask, batch.targets, batch.trained_tokens, int(mask.sum()))
    with pytest.raises(ValueError, match=r"row\(s\) \[1\].*left padding.*padded on the right"):
        shard_micro_batch(left, ContextShard(2, 0))


def test_a_width_the_ranks_cannot_split_is_refused():
    batch = collate(_rows([6, 3]), pad_id=0)
    with pytest.raises(ValueError, match=r"micro-batch width 6.*6 is not a multiple of context_parallel 4"):
        shard_micro_batch(batch, ContextShard(4, 0))


def test_a_packed_batch_without_its_attention_inputs_is_refused():
    batch = collate_packed([_rows([3, 4])], 8, pad_id=0)
    with pytest.raises(ValueError, match="with_attention"):
        shard_micro_batch(batch, ContextShard(2, 0))


# ---------------------------------------------------------------- the model side


def _config(preset="tiny-qwen3", **overrides):
    return build_preset_config(preset, overrides, 64)


def _model(implementation="sdpa", preset="tiny-qwen3"):
    model = AutoModelForCausalLM.from_config(_config(preset), dtype=torch.float32)
    if implementation == CAUSAL_SDPA:
        implementation = register_causal_sdpa()
    elif implementation == VARLEN_SDPA:
        implementation = register_varlen_sdpa()
    model.set_attn_implementation(implementation)
    return model


def test_a_model_that_splits_has_no_problems():
    for implementation in ("sdpa", CAUSAL_SDPA, VARLEN_SDPA, None):
        assert context_parallel_problems(_config(), 2, implementation) == []
    assert context_parallel_problems(_config(num_key_value_heads=4), 4) == []
    assert context_parallel_problems(_config(), 1, "eager") == []  # off


def test_head_counts_the_ranks_cannot_split_are_named():
    (problem,) = context_parallel_problems(_config(), 4)  # 4 query heads, 2 key/value heads
    assert "2 key/value heads (num_key_value_heads), which 4 ranks cannot split evenly: use one of [1, 2]" in problem
    assert problem.startswith("distributed.context_parallel: 4:")
    assert len(context_parallel_problems(_config(), 3)) == 2  # neither 4 nor 2 heads


@pytest.mark.parametrize(
    "implementation,why",
    [
        ("eager", "eager attention adds a mask"),
        ("flex_attention", "BlockMask"),
        ("flash_attention_2", "picks the flash kernel by the backend's name"),
        ("hone_sdpa_tiled", "memory.tiled_layers: off"),
        ("something_else", "hone cannot wrap it"),
    ],
)
def test_backends_the_wrapper_cannot_keep_exact_are_refused(implementation, why):
    (problem,) = context_parallel_problems(_config(), 2, implementation)
    assert f"attention through '{implementation}' cannot be split: " in problem and why in problem and "allowed: sdpa" in problem


def test_sliding_windows_are_refused():
    problems = context_parallel_problems(_config("tiny-gemma"), 2, "sdpa")
    assert any("sliding-window layers" in p for p in problems), problems


def test_a_size_below_one_is_refused():
    assert context_parallel_problems(_config(), 0) == [
        "distributed.context_parallel: 0 must be at least 1 (1: off; N > 1: each sequence split over N ranks)"
    ]


@pytest.mark.parametrize("inner,layout", [("sdpa", "dense_mask"), (CAUSAL_SDPA, "dense_mask"), (VARLEN_SDPA, "boundaries")])
def test_enabling_marks_every_attention_and_wraps_the_kernel(inner, layout):
    model = _model(inner)
    shard = ContextShard(2, 1)
    record = enable_context_parallel(model, shard)
    assert model.config._attn_implementation == ULYSSES_NAMES[inner] == record["attention"]
    assert inner_implementation(model.config._attn_implementation) == inner == record["wraps"]
    marked = [layer.self_attn for layer in model.model.layers]
    assert record["layers"] == len(marked) == 2 and all(getattr(m, CONTEXT_SHARD_ATTR) is shard for m in marked)
    assert layout_for(model).kind == layout  # packed rows get the inputs of the kernel inside
    assert enable_context_parallel(model, shard) == record  # idempotent


def test_enabling_refuses_a_model_it_cannot_split():
    with pytest.raises(ContextParallelError, match="attention through 'eager'"):
        enable_context_parallel(_model("eager"), ContextShard(2, 0))
    with pytest.raises(ContextParallelError, match="num_key_value_heads"):
        enable_context_parallel(_model(), ContextShard(4, 0))


def test_the_wrapper_refuses_an_unmarked_module_and_a_kv_cache():
    q = torch.randn(1, 4, 6, 8)
    inner = pytest.fail  # never reached
    with pytest.raises(ContextParallelError, match=f"carries no {CONTEXT_SHARD_ATTR}"):
        ulysses_attention(inner, torch.nn.Module(), q, q, q, None)
    module = torch.nn.Module()
    setattr(module, CONTEXT_SHARD_ATTR, ContextShard(1, 0))
    with pytest.raises(ContextParallelError, match="no KV cache"):
        ulysses_attention(inner, module, q[:, :, :1], q, q, None)


def test_the_wrapper_refuses_a_mask_of_the_local_length():
    module = torch.nn.Module()
    setattr(module, CONTEXT_SHARD_ATTR, ContextShard(1, 0))
    q = torch.randn(1, 4, 6, 8)
    with pytest.raises(ContextParallelError, match=r"whole sequence of 6 positions.*\(1, 1, 3, 3\)"):
        ulysses_attention(pytest.fail, module, q, q, q, torch.ones(1, 1, 3, 3, dtype=torch.bool))
