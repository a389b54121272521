"""The memory estimate under context parallelism: one rank's step at ``N`` ranks per sequence is
one process's step on ``1/N`` of the sequence (the weights whole on every rank; the activations,
the loss and the offloaded inputs of a shard), the ``auto`` decisions are made on it, and the
longest-sequence table by GPU count grows with the GPUs where the activations dominate."""

import torch

from hone.config import parse_config
from hone.runtime.world import World
from hone.transforms.base import RunFacts
from hone.transforms.decide import decide
from hone.transforms.memory.estimate import estimate_memory
from hone.transforms.memory.knobs import Knobs
from hone.transforms.memory.longest import longest_sequence
from hone.units import GIB

H100 = 80 * GIB


def _cfg(seq: int, context_parallel: int = 1, preset: str = "qwen3-8b"):
    return parse_config(
        {
            "model": {"preset": preset, "dtype": "bfloat16"},
            "data": {"datasets": [{"path": "x.jsonl", "type": "pretokenized"}], "sequence_len": seq},
            "adapter": {"type": "lora", "lora_r": 16, "lora_target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
            "distributed": {"context_parallel": context_parallel},
        }
    )


def test_one_rank_of_n_is_one_process_on_a_shard_of_the_sequence():
    knobs = Knobs("full", "fused_linear_ce", device="cuda", compiled=True)
    split = estimate_memory(_cfg(65536, 4), knobs)
    shard = estimate_memory(_cfg(16384), knobs)
    whole = estimate_memory(_cfg(65536), knobs)
    assert split.total == shard.total and split.activations == shard.activations and split.tokens == 16384
    assert split.weights == whole.weights  # every rank holds the whole model
    assert split.activations * 3.9 < whole.activations < split.activations * 4.1
    # the knob overrides the config: the bench and the table ask for other counts
    assert (
        estimate_memory(_cfg(65536), Knobs("full", "fused_linear_ce", device="cuda", compiled=True, context_parallel=4)).total
        == split.total
    )


def test_the_auto_memory_decisions_see_one_ranks_shard():
    facts = RunFacts(torch.device("cuda"), memory_bytes=H100, host_memory_bytes=128 * GIB, world=World(0, 4, 0))
    alone = decide(_cfg(16384), RunFacts(torch.device("cuda"), memory_bytes=H100, host_memory_bytes=128 * GIB))
    split = decide(_cfg(65536, 4), facts)
    assert split.context_parallel == 4
    assert (split.checkpointing, split.tiled_mlp_shards) == (alone.checkpointing, alone.tiled_mlp_shards)
    # tiled layers, which context parallelism refuses, are never auto's choice beside it
    long = decide(_cfg(1 << 20, 4), facts)
    assert long.tiled_layers_chunks == 0 and long.context_parallel == 4


def test_the_longest_sequence_grows_with_the_ranks_splitting_it():
    knobs = Knobs("full", "fused_linear_ce", device="cuda", compiled=True, tiled_mlp="auto")
    one = longest_sequence(_cfg(4096), knobs, H100, multiple=1024)
    four = longest_sequence(
        _cfg(4096),
        Knobs("full", "fused_linear_ce", device="cuda", compiled=True, tiled_mlp="auto", context_parallel=4),
        H100,
        multiple=1024,
    )
    assert one > 0 and four > 3 * one  # the weights (16 GiB) are not split, the activations are


def test_the_table_by_gpu_count_refuses_a_count_the_heads_do_not_divide():
    from hone.transforms.context_plan import longest_by_gpus, render_by_gpus

    rows = longest_by_gpus(_cfg(4096, 2), H100, 128 * GIB, losses=("fused_linear_ce",), counts=(1, 2, 3))
    assert [r.gpus for r in rows] == [1, 2, 3]
    assert rows[0].longest > 0 and rows[1].longest > 0
    assert rows[2].refused is not None and "which 3 ranks cannot split evenly" in rows[2].refused
    lines = render_by_gpus(rows, H100, 128 * GIB)
    assert lines[0].startswith("Longest sequence by GPU count") and "refused" in lines[-1]
