"""``hone plan`` under expert parallelism: per rank, the experts' weights, LoRA factors,
gradients and optimizer state are 1/N of one process's, everything else is whole; the received
token rows (N x T of hidden per MoE layer) and the experts' pair rows past one process's count
as activations, by default and with a capacity factor. qwen3-30b-a3b (128 experts, top-8), 8 of its layers, LoRA r16 on
attention and experts, described on the meta device."""

import pytest
import torch

from hone.config import parse_config
from hone.transforms.memory.estimate import estimate_memory, training_state
from hone.transforms.memory.facts import model_facts
from hone.transforms.memory.knobs import Knobs

LAYERS, R = 8, 16
E, HIDDEN, MOE_INTER, TOP_K = 128, 2048, 768, 8


def config(
    expert_parallel: int = 1,
    seq: int = 1024,
    factor: float | None = None,
    layers: int = LAYERS,
    lora: bool = True,
    recompute: bool = False,
):
    cfg = parse_config(
        {
            "model": {"preset": "qwen3-30b-a3b", "dtype": "bfloat16", "preset_overrides": {"num_hidden_layers": layers}},
            "data": {"datasets": [{"path": "x.jsonl", "type": "pretokenized"}], "sequence_len": seq},
            "adapter": {
                "type": "lora",
                "lora_r": R,
                "lora_alpha": 32,
                "lora_target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "experts"],
            }
            if lora
            else {"type": "none"},
        }
    )
    # the key distributed.expert_parallel may not be in this config schema yet: set it as the run reads it
    distributed = cfg.distributed.model_copy(
        update={"expert_parallel": expert_parallel, "expert_capacity_factor": factor, "expert_parallel_recompute": recompute}
    )
    return cfg.model_copy(update={"distributed": distributed})


def estimate(cfg):
    return estimate_memory(cfg, Knobs("none", "standard", device="cuda", compiled=False))


def test_the_facts_count_the_experts_and_their_lora_factors():
    m = model_facts(config())
    weights = LAYERS * E * 3 * HIDDEN * MOE_INTER  # gate_up [E, 2I, H] + down [E, H, I]
    lora = LAYERS * R * E * ((HIDDEN + 2 * MOE_INTER) + (MOE_INTER + HIDDEN))  # A [rE, in] + B [out, rE], both projections
    assert m.expert_trainable_params == lora
    assert m.expert_params == weights + lora
    assert m.expert_bytes == 2 * weights + lora * m.trainable_elem_bytes


@pytest.mark.parametrize("n", [2, 4])
def test_per_rank_expert_bytes_are_1_over_n(n):
    cfg1, cfgn = config(1), config(n)
    m = model_facts(cfg1)
    one, split = estimate(cfg1), estimate(cfgn)
    assert one.weights - split.weights == m.expert_bytes * (n - 1) // n
    assert one.weights - m.expert_bytes == split.weights - m.expert_bytes // n  # the rest: whole on every rank
    (_, grads_one, _), (_, grads_split, _) = training_state(cfg1, m, 1), training_state(cfgn, m, 1)
    assert grads_one - grads_split == m.expert_trainable_bytes * (n - 1) // n
    per_param = cfg1.optimizer.state_bytes(1, m.trainable_elem_bytes)
    assert one.optimizer - split.optimizer == per_param * (m.expert_trainable_params * (n - 1) // n)
    assert f"expert parallel over {n} ranks" in " ".join(split.notes)
    assert not any("expert parallel" in note for note in one.notes)


@pytest.mark.parametrize("factor", [None, 1.25])
def test_the_received_rows_and_the_pair_rows_count_as_activations(factor):
    m, tokens, c = model_facts(config()), 1024, 2
    one, two = estimate(config(1, tokens)), estimate(config(2, tokens, factor))
    per_pair = c * (3 * MOE_INTER + HIDDEN)  # gate_up, activation, expert output (frozen experts)
    extra_pairs = TOP_K if factor is None else 0.25 * TOP_K  # 2 x min(8, 64) = 16 pair rows per token, or 1.25 x 8
    per_layer = tokens * int(c * 2 * HIDDEN + extra_pairs * per_pair)  # the 2 x T received rows, the extra pair rows
    assert two.activations_per_layer - one.activations_per_layer == per_layer
    assert all(layer.moe for layer in m.layers)


def test_recomputed_local_experts_keep_the_received_rows_and_one_output_row_per_pair_row():
    """``expert_parallel_recompute``: no pair row's activations are kept (not even one process's k
    per token) but one hidden-wide row per worst-case pair row, as measured on 4 H200; one
    layer's worst-case pair rows exist while its backward rebuilds them."""
    tokens, c, n = 1024, 2, 4
    one, kept, recomputed = (
        estimate(config(size, tokens, recompute=size > 1 and r)) for size, r in ((1, False), (n, False), (n, True))
    )
    per_pair = c * (3 * MOE_INTER + HIDDEN)
    pair_rows = n * TOP_K  # 4 x min(8, 32) pair rows a token
    measured_rows = pair_rows * c * HIDDEN
    assert recomputed.activations_per_layer - one.activations_per_layer == tokens * (
        c * n * HIDDEN - TOP_K * per_pair + measured_rows
    )
    layer_pairs = tokens * pair_rows * per_pair  # one layer
    freed = layer_pairs - tokens * measured_rows
    # every layer's kept pair rows go but the output rows, one layer's come back in its backward
    assert 0.9 * (LAYERS - 1) * freed <= kept.total - recomputed.total <= 1.1 * LAYERS * freed


@pytest.mark.parametrize("n", [2, 4])
def test_fsdp2_beside_expert_parallel_shards_only_what_lies_outside_the_experts(n):
    """Each rank's block of the experts stays whole (fully_shard leaves it out): FSDP2 divides
    the rest by N and gathers a layer's non-expert weights at a time, never the experts."""
    cfg = config(n)
    m = model_facts(cfg)
    whole, sharded = training_state(cfg, m, 1), training_state(cfg, m, n)
    block_weights = m.expert_bytes - m.expert_bytes * (n - 1) // n
    block_grads = m.expert_trainable_bytes - m.expert_trainable_bytes * (n - 1) // n
    block_moments = cfg.optimizer.state_bytes(m.expert_trainable_params - m.expert_trainable_params * (n - 1) // n, 4)
    gathered = (m.frozen_bytes + m.trainable_bytes - m.expert_bytes) // LAYERS
    assert sharded[0] == block_weights + -(-(whole[0] - block_weights) // n) + 2 * gathered
    assert sharded[1] == block_grads + -(-(whole[1] - block_grads) // n)
    assert sharded[2] == block_moments + -(-(whole[2] - block_moments) // n)
    assert block_weights < sharded[0] < whole[0]


def test_strategy_auto_with_expert_parallel_shards_a_full_fine_tune_that_does_not_fit_and_keeps_ddp_for_lora():
    """The fit rule of ``auto`` with the experts counted at E / N: a full fine-tune of the whole
    qwen3-30b-a3b on 4 x 80 GB does not fit replicated (FSDP2); its LoRA does (DDP)."""
    from hone.runtime.world import World
    from hone.transforms.base import RunFacts
    from hone.transforms.data_parallel import resolve_strategy
    from hone.units import GIB

    facts = RunFacts(torch.device("cuda"), world=World(0, 4, 0), memory_bytes=80 * GIB)
    assert resolve_strategy(config(4, layers=48), facts)[0] == "ddp"
    strategy, why = resolve_strategy(config(4, layers=48, lora=False), facts)
    assert strategy == "fsdp" and "experts split over 4 ranks" in why, why


def test_strategy_fsdp_with_expert_parallel_validates_and_hone_plan_shows_the_rank_s_memory(tmp_path, capsys):
    """``hone plan --nproc-per-node 2`` of a full fine-tune under FSDP2 + expert parallelism:
    both transforms in the plan, and the weights row is one rank's (experts / 2 kept whole, the
    rest sharded over 2), as :func:`training_state` computes it."""
    import yaml

    from hone.cli import main
    from hone.units import GIB

    raw = {
        "model": {"preset": "qwen3-30b-a3b", "dtype": "bfloat16", "preset_overrides": {"num_hidden_layers": LAYERS}},
        "data": {"datasets": [{"path": "x.jsonl", "type": "pretokenized"}], "sequence_len": 1024},
        "adapter": {"type": "none"},
        "distributed": {"strategy": "fsdp", "expert_parallel": 2},
    }
    cfg = parse_config(raw)  # validates
    assert (cfg.distributed.strategy, cfg.distributed.expert_parallel) == ("fsdp", 2)
    path = tmp_path / "cfg.yml"
    path.write_text(yaml.safe_dump(raw))
    assert main(["plan", str(path), "--nproc-per-node", "2", "--gpu-memory", "80GiB", "--device", "cuda"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.split()}
    assert rows["expert_parallel"][0] == "on" and rows["fsdp"][0] == "on" and rows["ddp"][0] == "off", out
    weights = training_state(cfg, model_facts(cfg), 2)[0]
    assert float(rows["weights"][0]) == pytest.approx(weights / GIB, abs=0.006)
    assert "expert parallel over 2 ranks" in out


def test_hone_plan_of_a_bench_spec_plans_each_condition_on_its_processes(capsys):
    """A spec condition's ``nproc`` is the world it is planned on: the 4-GPU full fine-tune of
    qwen3-30b-a3b runs expert parallel beside FSDP2, not as one process holding every expert."""
    from pathlib import Path

    from hone.cli import main

    spec = Path(__file__).resolve().parents[2] / "benchmarks" / "specs" / "qwen3-30b-a3b-48l-full-ep4-fsdp.yml"
    assert main(["plan", str(spec), "--gpu-memory", "80GiB", "--device", "cuda"]) == 0
    out = capsys.readouterr().out
    states = [line.split()[:2] for line in out.splitlines() if line.split()[:1] in (["fsdp"], ["expert_parallel"])]
    assert states and all(state == "on" for _, state in states), states
    assert "distributed.strategy: fsdp (4 processes)" in out
