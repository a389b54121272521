"""``hone plan`` under expert parallelism: per rank, the experts' weights, LoRA factors,
gradients and optimizer state are 1/N of one process's, everything else is whole; the received
token rows (N x T of hidden per MoE layer) and the experts' pair rows past one process's count
as activations, by default and with a capacity factor. qwen3-30b-a3b (128 experts, top-8), 8 of its layers, LoRA r16 on
attention and experts, described on the meta device."""

import pytest

from hone.config import parse_config
from hone.transforms.memory.estimate import estimate_memory, training_state
from hone.transforms.memory.facts import model_facts
from hone.transforms.memory.knobs import Knobs

LAYERS, R = 8, 16
E, HIDDEN, MOE_INTER, TOP_K = 128, 2048, 768, 8


def config(expert_parallel: int = 1, seq: int = 1024, factor: float | None = None):
    cfg = parse_config(
        {
            "model": {"preset": "qwen3-30b-a3b", "dtype": "bfloat16", "preset_overrides": {"num_hidden_layers": LAYERS}},
            "data": {"datasets": [{"path": "x.jsonl", "type": "pretokenized"}], "sequence_len": seq},
            "adapter": {
                "type": "lora",
                "lora_r": R,
                "lora_alpha": 32,
                "lora_target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "experts"],
            },
        }
    )
    # the key distributed.expert_parallel may not be in this config schema yet: set it as the run reads it
    distributed = cfg.distributed.model_copy(update={"expert_parallel": expert_parallel, "expert_capacity_factor": factor})
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
