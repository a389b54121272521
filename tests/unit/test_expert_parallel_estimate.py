"""The memory estimate of expert-parallel runs against measured GPU peaks, and the ``auto``
checkpointing it then decides: the whole qwen3-30b-a3b (48 layers, 128 experts, top-8), LoRA r16
alpha 32 on q, k, v, o and every expert, seq 4096 per rank, micro-batch 1, bf16, compiled layers,
the fused loss: the workload of benchmarks/specs/qwen3-30b-a3b-48l-expert-parallel.yml, described
on the meta device (nothing loads); and its FSDP2-alone rows, whose peak is the preset's load."""

import pytest
import torch

from hone.config import parse_config
from hone.runtime.world import World
from hone.transforms.base import RunFacts
from hone.transforms.decide import decide
from hone.transforms.memory.decide import usable_bytes
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
# (expert parallel ranks, checkpointing, compiler memory budget, measured GiB)
MEASURED = [
    # 4 x H100 80GB, one machine (benchmarks/2026-11-27-h100-expert-parallel.md, commit 2ae2853)
    (1, "selective", 0.25, 68.05),
    (2, "selective", 0.95, 42.54),
    (4, "selective", 0.8, 28.67),
    (2, "full", None, 35.8),
    (4, "full", None, 21.80),
    # H200s, no checkpointing (benchmarks/2026-11-27-h200-expert-parallel.md; the bytes do not depend on the card)
    (1, "none", None, 88.3),
    (2, "none", None, 45.4),
]


@pytest.mark.parametrize("row", MEASURED, ids=lambda r: f"ep{r[0]}-{r[1]}{'' if r[2] is None else r[2]}")
def test_expert_parallel_estimate_within_ten_percent_of_measured_peaks(row):
    ranks, policy, budget, measured = row
    est = estimate_memory(config(ranks), Knobs(policy, "fused_linear_ce", compiled=True, selective_budget=budget))
    assert est.total / GIB == pytest.approx(measured, rel=0.10)


def test_each_rank_keeps_less_per_layer_than_one_process_without_checkpointing():
    """A rank keeps its received rows (N x T x hidden) per MoE layer where one process keeps its
    T x k pair rows (gate/up, activation, expert output): less per layer at N = 2 and 4 with k = 8;
    the worst-case pair rows of one layer at a time are what grows with N."""
    knobs = Knobs("none", "fused_linear_ce", compiled=True)
    one, two, four = (estimate_memory(config(n), knobs) for n in (1, 2, 4))
    assert two.activations_per_layer < one.activations_per_layer
    assert two.activations_per_layer < four.activations_per_layer < one.activations_per_layer


def facts(processes: int, gib: float) -> RunFacts:
    return RunFacts(torch.device("cuda"), memory_bytes=int(gib * GIB), host_memory_bytes=512 * GIB, world=World(0, processes, 0))


@pytest.mark.parametrize("ranks", [2, 4])
def test_auto_keeps_every_activation_at_expert_parallel_on_80gb_cards(ranks):
    """With the experts split, ``activation_checkpointing: auto`` on 80 GB cards picks no
    checkpointing (the fastest policy), because its estimate fits: measured 45.4 GiB at N = 2 on
    H200s; selective at 0.95 / 0.8 measured 42.5 / 28.7 GiB on H100s, where the old estimate
    (71.1 / 68.6 GiB) made ``auto`` recompute."""
    cfg = config(ranks)
    decided = decide(cfg, facts(ranks, 80))
    assert decided.expert_parallel == ranks and decided.strategy == "ddp"
    assert decided.checkpointing == "none", decided.checkpointing_why
    est = estimate_memory(cfg, Knobs("none", "fused_linear_ce", compiled=True))
    assert est.total <= usable_bytes(80 * GIB)


def test_auto_follows_the_estimate_where_no_checkpointing_does_not_fit():
    """The same run on 48 GB cards at N = 2: no checkpointing (about 45 GiB) does not fit 90% of the
    card, so ``auto`` picks selective with the largest compiler budget that fits; one GPU of 80 GB
    still needs selective (no checkpointing: about 87 GiB)."""
    cfg = config(2)
    none = estimate_memory(cfg, Knobs("none", "fused_linear_ce", compiled=True)).total
    assert usable_bytes(48 * GIB) < none <= usable_bytes(80 * GIB)
    decided = decide(cfg, facts(2, 48))
    assert decided.checkpointing == "selective" and decided.compiler_memory_budget is not None
    budget = decided.compiler_memory_budget
    fits = estimate_memory(cfg, Knobs("selective", "fused_linear_ce", compiled=True, selective_budget=budget)).total
    assert fits <= usable_bytes(48 * GIB)
    if budget < 1:  # the next larger budget would not fit
        larger = round(budget + 0.05, 2)
        over = estimate_memory(cfg, Knobs("selective", "fused_linear_ce", compiled=True, selective_budget=larger)).total
        assert over > usable_bytes(48 * GIB)
    one = decide(config(1), facts(1, 80))
    assert one.checkpointing == "selective", one.checkpointing_why


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
