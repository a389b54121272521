"""Exact data parallelism: 2 ranks x micro-batch 1 == 1 rank x micro-batch 1 x accumulation 2.

The same losses at every step, the same eval loss, the same final trainable weights (fp32,
1e-5), for LoRA and a full fine-tune, with padded and packed rows; both ranks end with identical
weights. The 2-process runs go through the loop with DDP (gloo); the reference runs here, in one
process.
"""

import os
import random

import pytest
import torch
from dist_launch import run_worker
from dist_worker import CASES, SINGLE, case_name, run_case, run_composed_case, trainable

from hone.track.metrics import read_metrics

SEED = int(os.environ.get("HONE_TEST_SEED", random.randrange(10_000)))  # fresh each session; fix it to reproduce


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp-parity")
    run_worker("parity", out, SEED)
    return out


def _losses(path):
    rows = read_metrics(path / "metrics.jsonl")
    return [r["loss"] for r in rows if "loss" in r], [r["eval_loss"] for r in rows if "eval_loss" in r]


@pytest.fixture(scope="module")
def composed_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp-composed")
    run_worker("composed", out, SEED)
    return out


@pytest.mark.parametrize(("adapter", "packed"), CASES, ids=[case_name(a, p) for a, p in CASES])
def test_two_ranks_equal_one_rank_with_twice_the_accumulation(two_rank_runs, tmp_path, adapter, packed):
    name = case_name(adapter, packed)
    reference = run_case(adapter, packed, tmp_path / name, SEED, SINGLE, accumulation=2)
    _assert_same_run(two_rank_runs / name, tmp_path / name, reference)


@pytest.mark.slow
@pytest.mark.parametrize("adapter", ["lora", "full"])
def test_ddp_composes_with_regional_compile_and_checkpointing(composed_runs, tmp_path, adapter):
    reference = run_composed_case(adapter, tmp_path / adapter, SEED, SINGLE, accumulation=2)
    _assert_same_run(composed_runs / adapter, tmp_path / adapter, reference)


def _assert_same_run(two_ranks, one_rank, reference):
    ref_train, ref_eval = _losses(one_rank)
    got_train, got_eval = _losses(two_ranks)
    assert len(got_train) == len(ref_train) == 3 and len(got_eval) == len(ref_eval) == 2
    assert got_train == pytest.approx(ref_train, rel=1e-5), f"seed {SEED}"
    assert got_eval == pytest.approx(ref_eval, rel=1e-6), f"seed {SEED}"

    rank0 = torch.load(two_ranks / "weights-rank0.pt")
    rank1 = torch.load(two_ranks / "weights-rank1.pt")
    expected = trainable(reference)
    assert rank0.keys() == expected.keys() and len(expected) > 0
    moved = 0.0
    for key, weight in expected.items():
        torch.testing.assert_close(rank1[key], rank0[key], rtol=0, atol=0, msg=f"replicas differ: {key}")
        scale = weight.abs().max().item()
        # 1e-5 absolute: AdamW divides by sqrt(v), which turns the rounding of a different
        # summation order in near-zero gradients into ~1e-6 of weight (seen: 1.2e-6 after 3 steps)
        torch.testing.assert_close(rank0[key], weight, rtol=1e-5, atol=1e-5, msg=f"{key} (seed {SEED})")
        moved = max(moved, scale)
    assert moved > 0


def test_ranks_skip_a_non_finite_step_together(tmp_path):
    # rank 1 alone has NaN weights (after DDP's broadcast): its loss is NaN, rank 0's finite
    import json

    run_worker("nonfinite", tmp_path, SEED)
    outcomes = [json.loads((tmp_path / f"outcome-rank{r}.json").read_text()) for r in (0, 1)]
    for outcome in outcomes:
        assert outcome["result"] == "NonFiniteLossError" and "2 optimizer steps in a row" in outcome["message"]
        assert outcome["steps"] == [[1, True], [2, True]]
    assert outcomes[0]["unchanged"]  # rank 0 never stepped on its finite half alone
