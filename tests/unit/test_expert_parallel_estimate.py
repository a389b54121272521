"""The memory estimate of the expert-parallel workload against measured GPU peaks: the whole
qwen3-30b-a3b (48 layers, 128 experts, top-8), LoRA r16 alpha 32 on q, k, v, o and every expert,
seq 4096 per rank, micro-batch 1, bf16, compiled layers, the fused loss: the workload of
benchmarks/specs/qwen3-30b-a3b-48l-expert-parallel.yml, described on the meta device (nothing
loads); and its FSDP2-alone rows, whose peak is the preset's load."""

import pytest

from hone.config import parse_config
from hone.runtime.world import World
from hone.transforms.memory.estimate import estimate_memory
from hone.transforms.memory.knobs import Knobs
from hone.units import GIB

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "experts"]


def config(expert_parallel: int = 1, **memory):
    """The spec's workload as ``hone bench`` configures it (the defaults: ``auto`` everything)."""
    return parse_config(
        {
            "model": {"preset": "qwen3-30b-a3b", "dtype": "bfloat16"},
            "data": {"datasets": [{"path": "x.jsonl", "type": "pretokenized"}], "sequence_len": 4096},
            "adapter": {"type": "lora", "lora_r": 16, "lora_alpha": 32, "lora_target_modules": TARGETS},
            "training": {"micro_batch_size": 1, "max_grad_norm": None},
            "distributed": {"expert_parallel": expert_parallel},
            "memory": memory,
        }
    )


# torch.cuda.max_memory_allocated of the fullest rank, hone bench rows:
# (expert parallel ranks, checkpointing, compiler memory budget, measured GiB). Only one-GPU rows:
# every expert-parallel row measured so far (2026-11-27) ran a compiled exchange whose gradient
# torch 2.11 traced as zero (hone/parallel/exchange.py), so its peak lacks the experts' backward.
MEASURED = [
    # 4 x H100 80GB, one machine (benchmarks/2026-11-27-h100-expert-parallel.md, commit 2ae2853)
    (1, "selective", 0.25, 68.05),
    # H200, no checkpointing (benchmarks/2026-11-27-h200-expert-parallel.md; the bytes do not depend on the card)
    (1, "none", None, 88.3),
]


@pytest.mark.parametrize("row", MEASURED, ids=lambda r: f"ep{r[0]}-{r[1]}{'' if r[2] is None else r[2]}")
def test_one_gpu_estimate_within_ten_percent_of_measured_peaks(row):
    ranks, policy, budget, measured = row
    est = estimate_memory(config(ranks), Knobs(policy, "fused_linear_ce", compiled=True, selective_budget=budget))
    assert est.total / GIB == pytest.approx(measured, rel=0.10)


def test_the_bench_estimate_is_the_rank_s_step_of_its_world():
    """``decided_estimate`` (what ``hone bench`` records beside each peak) plans the rank of the
    world torchrun launched: FSDP2 alone on N GPUs shards the weights over N (a world of one
    recorded the one-GPU estimate, 70.6 GiB, for the FSDP2 rows), and ``expert_parallel: auto``
    estimates the experts split as decided."""
    from hone.transforms.decide import decided_estimate

    fsdp = parse_config(
        {
            "model": {"preset": "qwen3-30b-a3b", "dtype": "bfloat16"},
            "data": {"datasets": [{"path": "x.jsonl", "type": "pretokenized"}], "sequence_len": 4096},
            "adapter": {"type": "lora", "lora_r": 16, "lora_alpha": 32, "lora_target_modules": TARGETS},
            "distributed": {"strategy": "fsdp"},
        }
    )
    one = decided_estimate(fsdp, "cuda", host_budget=512 * GIB)
    two = decided_estimate(fsdp, "cuda", host_budget=512 * GIB, world=World(0, 2, 0))
    assert (one.param_shards, two.param_shards) == (1, 2)
    assert two.weights < 0.6 * one.weights
    auto = config().model_copy(update={"distributed": config().distributed.model_copy(update={"expert_parallel": "auto"})})
    split = decided_estimate(auto, "cuda", host_budget=512 * GIB, world=World(0, 4, 0), memory_bytes=80 * GIB)
    assert split.weights == estimate_memory(config(4), Knobs("none", "fused_linear_ce")).weights


def fsdp_config():
    return parse_config(
        {
            "model": {"preset": "qwen3-30b-a3b", "dtype": "bfloat16"},
            "data": {"datasets": [{"path": "x.jsonl", "type": "pretokenized"}], "sequence_len": 4096},
            "adapter": {"type": "lora", "lora_r": 16, "lora_alpha": 32, "lora_target_modules": TARGETS},
            "training": {"micro_batch_size": 1, "max_grad_norm": None},
            "distributed": {"strategy": "fsdp"},
        }
    )


# FSDP2 alone, 2 and 4 H100 80GB, the same machine as MEASURED's H100 rows: (processes, measured GiB)
MEASURED_FSDP = [(2, 59.87), (4, 59.57)]


@pytest.mark.parametrize("processes, measured", MEASURED_FSDP)
def test_fsdp2_alone_on_a_preset_peaks_at_the_load_within_ten_percent(processes, measured):
    """FSDP2 alone on a preset: the loader draws the whole base on each GPU before FSDP2 shards it,
    so the rank's peak is the load (one process's weights, 59.3 GiB), not the sharded step (57 and
    41 GiB): the estimate the bench records (its world, this card) says so."""
    from hone.transforms.decide import decided_estimate

    est = decided_estimate(fsdp_config(), "cuda", host_budget=512 * GIB, world=World(0, processes, 0), memory_bytes=80 * GIB)
    assert est.phase == "model load" and est.param_shards == processes
    assert est.total / GIB == pytest.approx(measured, rel=0.10)
    assert sum(b for _, b in est.components()) == est.total


def test_a_model_directory_loads_sharded_so_no_load_phase():
    from hone.transforms.memory.terms.load import drawn_whole_bytes

    cfg = fsdp_config()
    directory = cfg.model_copy(update={"model": cfg.model.model_copy(update={"preset": None, "path": "/models/qwen3"})})
    assert drawn_whole_bytes(cfg, 100, 2) == 100
    assert drawn_whole_bytes(directory, 100, 2) == 0
    assert drawn_whole_bytes(cfg, 100, 1) == 0
