"""``distributed.expert_parallel: auto``: 1 on one process; on several, the number of processes
only where expert parallelism can run (MoE layers hone's experts forward computes, experts the
processes divide, nothing that refuses it) and is needed (the replicated training state does not
fit one device by the rule that makes ``strategy: auto`` leave DDP, and the split state does).
The plan's estimates, strategy, experts implementation and CUDA graphs follow the decided size,
and ``hone plan`` prints it with its reason. Estimates on the meta device; nothing loads."""

import pytest
import torch

from hone.config import parse_config
from hone.config.errors import ConfigError
from hone.runtime.world import World
from hone.train.distributed import expert_parallel_problems
from hone.transforms.base import RunFacts
from hone.transforms.data_parallel import FIT_FRACTION, training_state_bytes
from hone.transforms.decide import decide
from hone.transforms.expert_parallel import expert_parallel_choice, with_expert_parallel
from hone.transforms.plan_report import plan_view, resolved_optimizations
from hone.transforms.planner import PlanError, decisions, plan_optimizations
from hone.units import GIB

HOST = 512 * GIB
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def config(preset="qwen3-30b-a3b", targets=(*ATTENTION, "experts"), adapter="lora", **sections):
    raw = {
        "model": {"preset": preset, "dtype": "bfloat16", **sections.pop("model", {})},
        "data": {"datasets": [{"path": "x.jsonl", "type": "pretokenized"}], "sequence_len": 4096},
        "adapter": {"type": "lora", "lora_r": 16, "lora_alpha": 32, "lora_target_modules": list(targets)}
        if adapter == "lora"
        else {"type": "none"},
        "distributed": {"expert_parallel": "auto", **sections.pop("distributed", {})},
    }
    for key, section in sections.items():
        raw[key] = {**raw.get(key, {}), **section}
    return parse_config(raw)


def facts(processes: int, gib: float | None = 80, device: str = "cuda") -> RunFacts:
    memory = None if gib is None else int(gib * GIB)
    return RunFacts(torch.device(device), memory_bytes=memory, host_memory_bytes=HOST, world=World(0, processes, 0))


def test_qwen3_30b_lora_splits_its_experts_where_replicas_do_not_fit_an_80gb_card():
    cfg = config()
    replicated = training_state_bytes(cfg, "cuda")
    assert replicated > FIT_FRACTION * 80 * GIB  # the premise: DDP replicas do not fit
    for n in (2, 4):
        size, why = expert_parallel_choice(cfg, facts(n))
        assert size == n, why
        assert why.startswith(f"distributed.expert_parallel: auto: {n}, the replicated training state")
        assert training_state_bytes(with_expert_parallel(cfg, n), "cuda") <= FIT_FRACTION * 80 * GIB


@pytest.mark.parametrize(
    "case, cfg, run, reason",
    [
        ("one process", {}, (1, 80), "one process"),
        ("replicas fit a 141 GiB card", {}, (2, 141), "fits 80% of one device's 141.0 GiB: DDP alone"),
        ("CPU processes share the host", {}, (2, None, "cpu"), "is held by every rank"),
        ("a dense model", {"preset": "qwen3-8b", "targets": ATTENTION, "adapter": "none"}, (2, 40), "no mixture-of-experts"),
        ("3 processes, 128 experts", {}, (3, 80), "128 experts per layer do not split evenly over 3"),
        ("strategy fsdp", {"distributed": {"strategy": "fsdp"}}, (2, 80), "distributed.strategy: fsdp"),
        (
            "grouped_mm experts",
            {"model": {"experts_implementation": "grouped_mm"}},
            (2, 80),
            "experts_implementation: grouped_mm",
        ),
        ("MXFP4 experts' replicas fit", {"model": {"quantize": "mxfp4"}}, (2, 40), "26.8 GiB fits 80% of one device's 40.0"),
        ("tiled MLP asked for", {"memory": {"tiled_mlp": 4}}, (2, 80), "memory.tiled_mlp: 4"),
        ("even split does not fit", {"adapter": "none"}, (2, 80), "nor with the experts split over 2 ranks"),
    ],
)
def test_auto_keeps_one_where_expert_parallelism_cannot_run_or_is_not_needed(case, cfg, run, reason):
    size, why = expert_parallel_choice(config(**cfg), facts(*run))
    assert size == 1, case
    assert why.startswith("distributed.expert_parallel: auto: 1, ") and reason in why, (case, why)


def test_mxfp4_experts_split_where_their_replicas_do_not_fit_and_count_at_mxfp4_bytes_per_rank():
    """MXFP4 experts split like bf16 ones: the split saves half of their MXFP4 bytes (0.53125 a
    weight, with their LoRA state), not half of what they would take in bf16."""
    from hone.models.experts.mxfp4 import MXFP4_BYTES_PER_WEIGHT
    from hone.transforms.memory.facts import model_facts

    cfg = config(model={"quantize": "mxfp4"})
    m = model_facts(cfg)
    lora_bytes = m.expert_trainable_bytes
    assert m.expert_bytes == round(m.mxfp4_weights * MXFP4_BYTES_PER_WEIGHT) + lora_bytes
    replicated, split = training_state_bytes(cfg, "cuda"), training_state_bytes(with_expert_parallel(cfg, 2), "cuda")
    frozen_half = round(m.mxfp4_weights * MXFP4_BYTES_PER_WEIGHT) // 2
    assert frozen_half < replicated - split < frozen_half + 4 * lora_bytes  # + the LoRA blocks' grads and moments
    size, why = expert_parallel_choice(cfg, facts(2, 24))  # 26.8 GiB replicated, 14.9 GiB split
    assert size == 2, why


def test_a_full_fine_tune_splits_where_the_split_state_fits():
    size, why = expert_parallel_choice(config(adapter="none"), facts(8))
    assert size == 8, why


def test_a_written_size_is_kept_as_written():
    cfg = config(distributed={"expert_parallel": 2})
    assert expert_parallel_choice(cfg, facts(2, 141)) == (2, "distributed.expert_parallel: 2")


def test_the_plan_follows_the_decided_size():
    cfg, run = config(), facts(2)
    decided = decide(cfg, run)
    assert (decided.expert_parallel, decided.strategy, decided.experts_implementation) == (2, "ddp", "hone")
    assert decided.expert_parallel_why.startswith("distributed.expert_parallel: auto: 2")
    # the memory estimates see each rank's half of the experts, as if 2 had been written
    written = config(distributed={"expert_parallel": 2})
    assert decide(written, run).checkpointing == decided.checkpointing
    split = plan_view(cfg, "t", "cuda", 80 * GIB, "test", HOST, decided=decided).estimates["none"]
    whole = plan_view(cfg, "t", "cuda", 80 * GIB, "test", HOST, decided=decide(cfg, facts(2, 141))).estimates["none"]
    assert split.weights < 0.6 * whole.weights
    # and a plan that keeps 1 neither splits nor uses the exchange's strategy
    kept = decide(cfg, facts(2, 141))
    assert (kept.expert_parallel, kept.strategy) == (1, "ddp")


def test_hone_plan_shows_the_choice_and_its_reason():
    cfg, run = config(), facts(4)
    decided = decide(cfg, run)
    rows = {name: value for name, value, _ in resolved_optimizations(cfg, "cuda", decided)}
    assert rows["expert parallel"] == "over 4 ranks (auto)"
    lines = {name: (on, why) for name, _, on, why in decisions(cfg, run, decided=decided)}
    assert lines["expert_parallel"][0] is True and "auto: 4, the replicated training state" in lines["expert_parallel"][1]
    kept = decide(cfg, facts(4, 141))
    assert {n: v for n, v, _ in resolved_optimizations(cfg, "cuda", kept)}["expert parallel"] == "off (auto)"
    lines = {name: (on, why) for name, _, on, why in decisions(cfg, facts(4, 141), decided=kept)}
    assert lines["expert_parallel"] == (False, kept.expert_parallel_why)
    assert kept.expert_parallel_why in plan_optimizations(cfg, facts(4, 141)).auto_choices(cfg)


def test_auto_falls_back_to_one_where_the_activations_need_tiling():
    cfg = config(data={"sequence_len": 196608})  # 192K tokens: split 2 ways, the MLP would be tiled
    assert expert_parallel_choice(cfg, facts(2))[0] == 2  # the training state alone would split
    decided = decide(cfg, facts(2))
    assert decided.expert_parallel == 1, decided.expert_parallel_why
    assert decided.expert_parallel_why.startswith("distributed.expert_parallel: auto: 1, the activations need tiling")
    assert decided.strategy == "fsdp"  # the replicas do not fit: FSDP2, which may tile


def test_cuda_graphs_auto_record_the_exchanges_beside_ddp_only():
    """Measured beside DDP with one group of every process (2 and 4 H100): on there; beside
    FSDP2, or groups smaller than the job, off with the reason."""
    eight = {"preset_overrides": {"num_hidden_layers": 8}}
    one = decide(config(distributed={"expert_parallel": 1}, model=eight), facts(1))
    assert one.cuda_graphs is True  # the premise: this run alone records graphs
    for n in (2, 4):
        decided = decide(config(distributed={"expert_parallel": n}, model=eight), facts(n))
        assert (decided.strategy, decided.cuda_graphs) == ("ddp", True), decided.cuda_graphs_why
        assert decided.cuda_graphs_why.startswith("cuda_graphs: auto: on, expert parallelism's exchanges")
    beside_fsdp = decide(config(distributed={"expert_parallel": 2, "strategy": "fsdp"}, model=eight), facts(2))
    assert beside_fsdp.cuda_graphs is False
    assert beside_fsdp.cuda_graphs_why.startswith("cuda_graphs: auto: off, FSDP2 gathers each layer's parameters")
    assert beside_fsdp.cuda_graphs_why.endswith("with LoRA, prefer distributed.strategy: ddp")
    groups = decide(config(distributed={"expert_parallel": 2}, model=eight), facts(4))
    assert groups.cuda_graphs is False
    assert "expert parallel groups of 2 in 4 processes" in groups.cuda_graphs_why
    ddp_alone = decide(config(distributed={"expert_parallel": 1, "strategy": "ddp"}, model=eight), facts(2))
    assert ddp_alone.cuda_graphs is False and "data parallelism (ddp)" in ddp_alone.cuda_graphs_why
    asked = config(distributed={"expert_parallel": 2, "strategy": "fsdp"}, performance={"cuda_graphs": True})
    assert decide(asked, facts(2)).cuda_graphs is True  # written in the config: decided as asked, then refused:
    with pytest.raises(PlanError) as info:
        plan_optimizations(asked, facts(2))
    message = str(info.value)
    assert "performance.cuda_graphs: true uses CUDA graphs, which cannot replay beside distributed.strategy: fsdp" in message
    assert "2,786 ms a step with graphs asked for" in message and "distributed.strategy: ddp" in message
    ddp = config(distributed={"expert_parallel": 2, "strategy": "ddp"}, performance={"cuda_graphs": True})
    assert "compile" in plan_optimizations(ddp, facts(2)).names  # beside DDP they replay: planned as asked


def test_the_config_takes_auto_and_the_launch_accepts_it_on_any_world():
    cfg = config(distributed={"expert_capacity_factor": 1.25, "strategy": "fsdp"})  # auto resolves to 1 under FSDP2
    assert cfg.distributed.expert_parallel == "auto"
    for n in (1, 2, 3):
        assert expert_parallel_problems(cfg, World(0, n, 0)) == []
    with pytest.raises(ConfigError, match="expert_parallel"):
        config(distributed={"expert_parallel": "many"})
    with pytest.raises(ConfigError, match="must be at least 1"):
        config(distributed={"expert_parallel": 0})


def test_the_default_stays_one():
    raw = {"model": {"preset": "tiny-qwen3-moe"}, "data": {"datasets": [{"path": "x.jsonl", "type": "pretokenized"}]}}
    assert parse_config(raw).distributed.expert_parallel == 1


def test_fsdp_checks_read_the_decided_size_not_the_written_auto():
    """``strategy: fsdp`` with ``cpu_offload`` refuses expert parallelism beside it: the check reads
    the plan's decided size (``auto`` is 1 beside FSDP2, so it passes), not the config's ``auto``."""
    cfg = config(distributed={"strategy": "fsdp", "cpu_offload": True})
    lines = {name: (on, why) for name, _, on, why in decisions(cfg, facts(2))}
    assert lines["fsdp"][0] is True and "REFUSED" not in lines["fsdp"][1], lines["fsdp"]
    split = config(distributed={"strategy": "fsdp", "cpu_offload": True, "expert_parallel": 2})
    lines = {name: (on, why) for name, _, on, why in decisions(split, facts(2))}
    assert "REFUSED" in lines["fsdp"][1] and "distributed.expert_parallel: 2" in lines["fsdp"][1], lines["fsdp"]


def test_auto_never_tiles_beside_expert_parallelism_and_says_why():
    """A 42 GiB card at selective 0.15: one process would tile the MLP in two to fit; expert
    parallelism refuses tiling, so ``auto`` leaves it off (the plan runs, naming why) instead of
    picking what the plan then refuses (found by a bench row on H200s)."""
    cfg = config(
        distributed={"expert_parallel": 2, "expert_capacity_factor": 1.25},
        memory={"activation_checkpointing": "selective", "selective_memory_budget": 0.15},
    )
    decided = decide(cfg, facts(2, gib=40))
    assert decided.tiled_mlp_shards == 0 and decided.tiled_layers_chunks == 0
    assert decided.tiled_mlp_why == "tiled_mlp: auto: off, expert parallelism does not run with it yet " + (
        "(every rank takes part in each layer's exchange)"
    )
    plan_optimizations(cfg, facts(2, gib=40))  # refused before: "does not run with memory.tiled_mlp yet"
    written = config(distributed={"expert_parallel": 2}, memory={"tiled_mlp": 2})
    with pytest.raises(Exception, match="does not run with memory.tiled_mlp yet"):
        plan_optimizations(written, facts(2, gib=40))


def test_the_selective_floor_is_lower_under_expert_parallelism_than_full_checkpointing():
    """``auto`` goes down to budget 0.15 under expert parallelism before it takes ``full`` (which
    repeats the exchanges: 1,549 against 402.9 ms a step on 2 H200s); one process keeps 0.2."""
    from hone.config.memory import SELECTIVE_BUDGET_FLOOR, SELECTIVE_BUDGET_FLOOR_EXPERT_PARALLEL, selective_budget_floor

    assert SELECTIVE_BUDGET_FLOOR_EXPERT_PARALLEL < SELECTIVE_BUDGET_FLOOR
    decided = decide(config(distributed={"expert_parallel": 2, "expert_capacity_factor": 1.25}), facts(2, gib=44))
    assert decided.checkpointing == "selective", decided.checkpointing_why
    assert decided.compiler_memory_budget == SELECTIVE_BUDGET_FLOOR_EXPERT_PARALLEL, decided.compiler_memory_budget_why
    # (at 0.2, auto's floor without expert parallelism, the estimate is 40.4 GiB: over 44 GiB less 10%)
    assert [selective_budget_floor(n) for n in (1, "auto", 2, 4)] == [SELECTIVE_BUDGET_FLOOR] * 2 + [
        SELECTIVE_BUDGET_FLOOR_EXPERT_PARALLEL
    ] * 2
