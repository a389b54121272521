"""scripts/routing_balance.py: the busiest expert-parallel rank's share of a layer's pairs."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import routing_balance  # noqa: E402


def test_a_balanced_router_scores_one_and_a_skewed_one_its_busiest_block():
    # 8 experts over 2 ranks: rank 0 holds experts 0-3, rank 1 experts 4-7
    balanced = torch.tensor([[0, 4], [1, 5], [2, 6], [3, 7]])
    assert routing_balance.busiest_over_mean(balanced, 8, 2) == pytest.approx(1.0)
    skewed = torch.tensor([[0, 1], [2, 3], [0, 5], [1, 2]])  # 7 pairs on rank 0, 1 on rank 1: mean 4
    assert routing_balance.busiest_over_mean(skewed, 8, 2) == pytest.approx(7 / 4)
    assert routing_balance.busiest_over_mean(skewed, 8, 4) == pytest.approx(4 / 2)  # experts 0-1: 4 pairs of 8


def test_placing_experts_by_load_evens_out_the_ranks():
    # expert loads 6, 5, 1, 0 over 2 ranks: contiguous blocks carry 11 and 1; by load 6+0 and 5+1
    choices = torch.tensor([0] * 6 + [1] * 5 + [2]).view(-1, 1)
    assert routing_balance.busiest_over_mean(choices, 4, 2) == pytest.approx(11 / 6)
    owner = routing_balance.placed_by_load(choices, 4, 2)
    assert sorted(torch.bincount(owner, minlength=2).tolist()) == [2, 2]  # E / N experts a rank
    assert owner[0] != owner[1] and routing_balance.busiest_over_mean(choices, 4, 2, owner) == pytest.approx(1.0)


def test_router_choices_reads_every_moe_layers_top_k():
    from transformers import AutoModelForCausalLM

    from hone.models.presets import build_preset_config

    config = build_preset_config("tiny-qwen3-moe", {}, vocab_size=128)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(1, 128, (1, 16))
    choices, alike = routing_balance.router_choices(model, ids, config.num_experts_per_tok)
    assert len(choices) == len(alike) == config.num_hidden_layers
    assert all(-1.0 <= a <= 1.0 for a in alike)
    assert all(c.shape == (16, config.num_experts_per_tok) for c in choices)
    table = routing_balance.report(choices, config.num_experts, [2], "t", later=choices)
    assert table.splitlines()[-1].startswith("| 2 | ") and table.splitlines()[-1].count("|") == 7
