"""Exact expert parallelism in training: 2 ranks, each holding 4 of a tiny Qwen3-MoE's 8 experts
(micro-batch 1), give the losses, eval losses and final weights of one process holding all
experts with accumulation 2 (fp32, 1e-5): LoRA on attention + experts and a full fine-tune,
padded and packed, gradients clipped by the global norm; gpt-oss' experts (biases, transposed
layout); and, slow, through regional compile and full activation checkpointing. The reference computes its experts
with transformers' own implementation (and PEFT's own expert LoRA), not hone's."""

import os
import random

import pytest
import torch
from ep_training import (
    CAPPED,
    CASES,
    FSDP_CASES,
    GPT_OSS,
    SLOW_CASES,
    joined_weights,
    overflow_ranks,
    resume_with_another_capacity,
    run_ranks,
    run_reference,
)
from fsdp_harness import spawn

from hone.track.metrics import read_metrics

SEED = int(os.environ.get("HONE_TEST_SEED", random.randrange(10_000)))  # fresh each session; fix it to reproduce


def _spawn(out, cases):
    for case in cases:
        (out / case.name).mkdir()
    try:
        spawn(run_ranks, 2, out, SEED, cases, timeout_s=300)
    except Exception as exc:
        raise AssertionError(f"expert-parallel runs (seed {SEED}) failed:\n{exc}") from exc
    return out


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    return _spawn(tmp_path_factory.mktemp("ep-parity"), [*CASES, GPT_OSS, CAPPED])


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory):
    return _spawn(tmp_path_factory.mktemp("ep-fsdp"), FSDP_CASES)


@pytest.fixture(scope="module")
def composed_runs(tmp_path_factory):
    return _spawn(tmp_path_factory.mktemp("ep-composed"), SLOW_CASES)


def _losses(path):
    rows = read_metrics(path / "metrics.jsonl")
    train = [(r["loss"], r["grad_norm"]) for r in rows if "loss" in r]
    return train, [r["eval_loss"] for r in rows if "eval_loss" in r]


def _joined(two_ranks):
    """The trained weights of the 2 ranks as one model's: expert blocks joined, the rest equal."""
    return joined_weights(two_ranks, 2)


@pytest.mark.parametrize("case", [*CASES, GPT_OSS, CAPPED], ids=lambda c: c.name)
def test_expert_parallel_equals_one_process(two_rank_runs, tmp_path, case):
    _assert_same_run(two_rank_runs / case.name, tmp_path / case.name, run_reference(case, tmp_path / case.name, SEED), case)


@pytest.mark.parametrize("case", FSDP_CASES, ids=lambda c: c.name)
def test_expert_parallel_beside_fsdp2_equals_one_process(fsdp_runs, tmp_path, case):
    """FSDP2 shards every weight outside the experts; the blocks stay plain tensors, their
    gradients unreduced; the norm and AdamW (foreach, one kind of tensor per group) see both."""
    _assert_same_run(fsdp_runs / case.name, tmp_path / case.name, run_reference(case, tmp_path / case.name, SEED), case)
    kinds = torch.load(fsdp_runs / case.name / "weights-rank0.pt")["kinds"]
    sharded = torch.load(fsdp_runs / case.name / "weights-rank0.pt")["sharded"]
    assert {kinds[n] for n in sharded if n in kinds} == {"Parameter"}  # the trained expert blocks: plain tensors
    assert {k for n, k in kinds.items() if n not in sharded} == {"DTensor"}  # the rest: FSDP2's shards


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW_CASES, ids=lambda c: c.name)
def test_expert_parallel_composes_with_regional_compile_and_checkpointing(composed_runs, tmp_path, case):
    _assert_same_run(composed_runs / case.name, tmp_path / case.name, run_reference(case, tmp_path / case.name, SEED), case)


def test_a_capacity_overflow_stops_every_rank_with_the_key_named(tmp_path):
    import json

    spawn(overflow_ranks, 2, tmp_path, SEED, timeout_s=300)
    for rank in (0, 1):
        outcome = json.loads((tmp_path / f"outcome-rank{rank}.json").read_text())
        assert outcome["result"] == "ExpertCapacityError", outcome
        assert outcome["message"].startswith("distributed.expert_capacity_factor: 0.1: expert parallel: ")
        assert "exceeded the capacity of 16 rows of a rank's experts" in outcome["message"]  # 0.1 x T x k, rounded up
        assert "x the balanced share of" in outcome["message"] and "training.resume=latest" in outcome["message"]


def _assert_same_run(two_ranks, one_rank, expected, case):
    ref_train, ref_eval = _losses(one_rank)
    got_train, got_eval = _losses(two_ranks)
    assert len(got_train) == len(ref_train) == 3 and len(got_eval) == len(ref_eval) == 2
    # the losses, and the gradient norms (which clip: each rank's must be the global one)
    assert [x for row in got_train for x in row] == pytest.approx([x for row in ref_train for x in row], rel=1e-5), SEED
    assert got_eval == pytest.approx(ref_eval, rel=1e-5), f"seed {SEED}"
    joined, sharded = _joined(two_ranks)
    assert joined.keys() == expected.keys()
    assert any("experts" in n for n in sharded) and all("experts" in n for n in sharded)
    if case.adapter == "lora":
        assert any("lora_A" in n for n in sharded) and any("lora_B" in n for n in sharded)
    else:
        assert any(n.endswith("gate_up_proj") for n in sharded) and any(n.endswith("down_proj") for n in sharded)
    for key, weight in expected.items():
        # 1e-5 absolute: AdamW divides by sqrt(v), which turns the rounding of a different
        # summation order in near-zero gradients into ~1e-6 of weight
        torch.testing.assert_close(joined[key], weight, rtol=1e-5, atol=1e-5, msg=lambda m, key=key: f"{key} (seed {SEED}): {m}")


@pytest.mark.parametrize("strategy", ["auto", "fsdp"])
def test_hone_train_runs_expert_parallel_end_to_end(tmp_path, strategy):
    """``hone train`` on 2 ranks as torchrun starts it: the loader splits the experts through the
    plan, with a capacity factor and full checkpointing; the plan records it. ``fsdp``: a full
    fine-tune beside FSDP2, with a step checkpoint (DCP) and the final model written."""
    import json

    from dist_launch import hone_train_forked, tiny_moe_train_config

    fsdp = strategy == "fsdp"
    path = tiny_moe_train_config(
        tmp_path,
        training={"max_steps": 2, "micro_batch_size": 2, "save_steps": 1 if fsdp else None},
        distributed={"expert_parallel": 2, "expert_capacity_factor": 1.5, **({"strategy": "fsdp"} if fsdp else {})},
        memory={"activation_checkpointing": "full"},
        **({"adapter": {"type": "none"}} if fsdp else {}),
    )
    hone_train_forked(path)
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]
    applied = {a["name"]: a["details"] for a in json.loads((tmp_path / "run" / "optimizations.json").read_text())["applied"]}
    assert applied["expert_parallel"]["ranks"] == 2 and applied["expert_parallel"]["capacity"] == 192  # 1.5 x 64 x 2 pair rows
    assert applied["experts"]["implementation"] == "hone" and "activation_checkpointing" in applied
    if strategy == "auto":  # LoRA on the CPU: replicas
        assert "ddp" in applied and "fsdp" not in applied
        return
    assert "fsdp" in applied and "ddp" not in applied and applied["fsdp"]["expert_blocks_apart"] > 0
    assert (tmp_path / "run" / "checkpoints" / "step-1" / "dcp").is_dir()
    from safetensors.torch import load_file

    final = load_file(str(tmp_path / "run" / "final" / "model.safetensors"))
    # every expert, gathered (save_pretrained writes the checkpoint format: one tensor per expert)
    layer0 = {key.split(".")[5] for key in final if key.startswith("model.layers.0.mlp.experts.")}
    assert layer0 == {str(e) for e in range(8)}, sorted(final)


def test_a_run_resumes_with_another_capacity_factor_exactly(tmp_path):
    """What the overflow error advises: continue from the last checkpoint with a larger factor."""
    for part in ("whole", "resumed"):
        (tmp_path / part).mkdir()
    spawn(resume_with_another_capacity, 2, tmp_path, SEED, timeout_s=300)
    whole, resumed = _losses(tmp_path / "whole")[0], _losses(tmp_path / "resumed")[0]
    assert len(whole) == len(resumed) and resumed[-1] == pytest.approx(whole[-1], rel=1e-6), f"seed {SEED}"
    for rank in (0, 1):
        want = torch.load(tmp_path / "whole" / f"weights-rank{rank}.pt")
        got = torch.load(tmp_path / "resumed" / f"weights-rank{rank}.pt")
        assert got.keys() == want.keys()
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=1e-6, atol=1e-7, msg=lambda m, key=key: f"{key}: {m}")
