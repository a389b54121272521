"""Context parallelism in the run, without processes: what the config and the launch refuse (each
message naming the key, the value and what is allowed), which micro-batches the ranks of a group
read (the same ones; the global batch sequence does not depend on the layout), the padding of
unpacked rows to a multiple of N, and the memory decided for one rank's shard."""

import pytest
import torch
from pydantic import ValidationError

from hone.data.collate import MicroBatch
from hone.runtime.world import World
from hone.testing import tiny_config
from hone.train.batches import BatchStream, plan_steps
from hone.train.distributed import DistributedSetupError, check_launch
from hone.transforms.context_parallel import pad_rows, per_rank_config


def _cfg(tmp_path, distributed=None, **sections):
    return tiny_config(tmp_path, distributed={"context_parallel": 2, **(distributed or {})}, **sections)


@pytest.mark.parametrize(
    ("distributed", "sections", "expected"),
    [
        ({"context_parallel": 0}, {}, "distributed.context_parallel: 0 must be at least 1"),
        ({"expert_parallel": 2}, {}, "distributed.context_parallel: 2 and distributed.expert_parallel: 2 cannot be combined"),
        ({"strategy": "none"}, {}, "distributed.context_parallel: 2 runs on several processes, which distributed.strategy: none"),
        ({}, {"data": {"sample_packing": True, "sequence_len": 63}}, "use a data.sequence_len that is a multiple of 2"),
        ({}, {"memory": {"tiled_layers": 4, "activation_checkpointing": "full"}}, "set memory.tiled_layers: off"),
    ],
)
def test_the_config_refuses_what_context_parallelism_cannot_run_with(tmp_path, distributed, sections, expected):
    with pytest.raises(ValidationError, match=expected.replace(".", r"\.").replace("(", r"\(")):
        _cfg(tmp_path, distributed, **sections)


def test_expert_parallel_auto_stays_off_beside_context_parallelism(tmp_path):
    from hone.transforms.base import RunFacts
    from hone.transforms.expert_parallel import expert_parallel_choice

    cfg = _cfg(tmp_path, {"expert_parallel": "auto"})
    size, why = expert_parallel_choice(cfg, RunFacts(torch.device("cpu"), world=World(0, 2)))
    assert size == 1 and "distributed.context_parallel: 2" in why


def test_the_launch_refuses_a_size_that_does_not_divide_the_processes(tmp_path):
    cfg = _cfg(tmp_path, {"context_parallel": 4})
    with pytest.raises(DistributedSetupError, match=r"distributed\.context_parallel: 4 on 6 processes: N must divide"):
        check_launch(cfg, World(0, 6, 0), "cpu")
    with pytest.raises(DistributedSetupError, match=r"the model has 2 key/value heads \(num_key_value_heads\), which 4 ranks"):
        check_launch(cfg, World(0, 8, 0), "cpu")  # 2 groups of 4, but tiny-llama has 2 key/value heads
    check_launch(_cfg(tmp_path), World(0, 4, 0), "cpu")  # 2 groups of 2: fine


def test_the_ranks_of_a_group_read_the_same_micro_batches_and_the_sequence_ignores_the_layout():
    from hone.config.training import TrainingConfig

    training = TrainingConfig(micro_batch_size=2, gradient_accumulation_steps=1, max_steps=3)
    one = BatchStream(plan_steps(40, TrainingConfig(micro_batch_size=2, gradient_accumulation_steps=2, max_steps=3)), seed=3)
    # 4 processes, context parallel 2: ranks 0, 1 are replica 0, ranks 2, 3 replica 1
    layout = [World(rank, 4).data_parallel(2) for rank in range(4)]
    assert layout == [(0, 2), (0, 2), (1, 2), (1, 2)]
    streams = [BatchStream(plan_steps(40, training, replicas), seed=3, rank=replica) for replica, replicas in layout]
    for _ in range(3):
        whole = one.next_window()
        windows = [s.next_window() for s in streams]
        assert windows[0] == windows[1] == whole[:1] and windows[2] == windows[3] == whole[1:]
    assert {s.position.as_dict()["index"] for s in streams} == {one.position.index}


def _padded_batch(widths: list[int], width: int) -> MicroBatch:
    ids = torch.zeros(len(widths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    targets = torch.full_like(ids, -100)
    for row, n in enumerate(widths):
        ids[row, :n] = torch.arange(5, 5 + n)
        mask[row, :n] = 1
        targets[row, : n - 1] = ids[row, 1:n]
    return MicroBatch(ids, mask, targets, trained_tokens=int((targets != -100).sum()), tokens=sum(widths))


def test_unpacked_rows_are_padded_at_the_end_to_a_multiple_of_n_without_a_trained_token_more():
    batch = _padded_batch([7, 5], 7)
    padded = pad_rows(batch, 4)
    assert padded.input_ids.shape == (2, 8)
    assert torch.equal(padded.input_ids[:, :7], batch.input_ids) and torch.equal(padded.targets[:, :7], batch.targets)
    assert padded.attention_mask[:, 7].tolist() == [0, 0] and padded.targets[:, 7].tolist() == [-100, -100]
    assert (padded.trained_tokens, padded.tokens) == (batch.trained_tokens, batch.tokens)
    assert pad_rows(_padded_batch([8, 5], 8), 4).input_ids.shape == (2, 8)  # already a multiple: as it is


def test_the_memory_is_decided_for_one_ranks_shard(tmp_path):
    cfg = _cfg(tmp_path, data={"sequence_len": 1000})
    assert cfg.micro_batch_tokens_per_rank() == 500 * cfg.training.micro_batch_size
    assert cfg.micro_batch_tokens_per_rank(2000) == 1000 * cfg.training.micro_batch_size
    three = _cfg(tmp_path, {"context_parallel": 3}, data={"sequence_len": 1000})
    assert three.micro_batch_tokens_per_rank() == 334 * three.training.micro_batch_size
    assert tiny_config(tmp_path).micro_batch_tokens_per_rank() == 64 * cfg.training.micro_batch_size
    # the decisions see the config's N (the estimate divides by it and counts the exchanges), tiled layers off
    ranked = per_rank_config(_cfg(tmp_path, data={"sequence_len": 1000}, memory={"tiled_layers": "auto"}))
    assert ranked.distributed.context_parallel == 2 and ranked.data.sequence_len == 1000
    assert ranked.memory.tiled_layers == "off"


@pytest.mark.parametrize("budget", [0.0, 0.2, 0.5])
def test_a_compiled_layer_keeps_the_exchanged_attention_tensors_whatever_its_budget(tmp_path, budget):
    """Inductor's partitioner never recomputes a collective: under context parallelism each layer
    keeps the exchanged q, k, v and attention output beside its input, and the budget applies to
    the rest only (a qwen3-8b 128K row over 4 H100s estimated without them at 52 GiB ran out of 80)."""
    from hone.transforms.memory.estimate import estimate_memory, resolve_step
    from hone.transforms.memory.facts import model_facts
    from hone.transforms.memory.knobs import Knobs

    knobs = Knobs("selective", "fused_linear_ce", compiled=True, selective_budget=budget)
    split, whole = _cfg(tmp_path, data={"sequence_len": 1024}), tiny_config(tmp_path, data={"sequence_len": 512})
    m = model_facts(split)
    step = resolve_step(split, knobs, m)
    exchanged = m.compute_bytes * 2 * (m.heads + m.kv_heads) * m.head_dim
    assert step.exchanged_per_token == exchanged and step.tokens == 512 * split.training.micro_batch_size
    assert resolve_step(whole, knobs, model_facts(whole)).exchanged_per_token == 0
    kept = estimate_memory(split, knobs).activations_per_layer
    alone = estimate_memory(whole, knobs).activations_per_layer  # the same tokens on one rank, nothing exchanged
    forced = exchanged * step.tokens
    assert kept == pytest.approx(alone + (1 - budget) * forced, rel=1e-6, abs=8)
    if budget == 0.0:
        assert kept == step.input_bytes + forced
