"""Checkpoints of a 2-rank DDP run: resumed on 2 ranks it gives the losses and weights of the
uninterrupted run; resumed on 1 process with twice the accumulation (the same global batch) too."""

import os
import random

import pytest
import torch
from dist_launch import run_worker
from dist_worker import SINGLE, run_resume_case, trainable

from hone.track.metrics import read_metrics

SEED = int(os.environ.get("HONE_TEST_SEED", random.randrange(10_000)))  # fresh each session; fix it to reproduce


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp-resume")
    run_worker("resume", out, SEED)
    return out


def _train_losses(path):
    return {r["step"]: r["loss"] for r in read_metrics(path / "metrics.jsonl") if "loss" in r}


def test_a_two_rank_run_resumes_to_identical_losses(runs):
    straight, resumed = _train_losses(runs / "straight"), _train_losses(runs / "crashed")
    assert sorted(resumed) == sorted(straight) == [1, 2, 3, 4]
    assert [resumed[s] for s in (3, 4)] == pytest.approx([straight[s] for s in (3, 4)], rel=1e-6), f"seed {SEED}"
    a, b = torch.load(runs / "straight" / "weights-rank0.pt"), torch.load(runs / "crashed" / "weights-rank0.pt")
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-6, atol=1e-7, msg=key)
    # rank 0 alone wrote the checkpoints, complete
    assert (runs / "crashed" / "checkpoints" / "step-2" / "COMPLETE").is_file()
    assert (runs / "crashed" / "checkpoints" / "step-4" / "COMPLETE").is_file()


def test_a_two_rank_checkpoint_resumes_on_one_process(runs):
    run_dir = runs / "crashed-copy"
    model = run_resume_case(run_dir, SEED, SINGLE, accumulation=2, resume_from=run_dir / "checkpoints" / "step-2")
    straight, resumed = _train_losses(runs / "straight"), _train_losses(run_dir)
    assert [resumed[s] for s in (3, 4)] == pytest.approx([straight[s] for s in (3, 4)], rel=1e-5), f"seed {SEED}"
    reference = torch.load(runs / "straight" / "weights-rank0.pt")
    for key, weight in trainable(model).items():
        torch.testing.assert_close(weight, reference[key], rtol=1e-5, atol=1e-5, msg=key)  # see test_data_parallel
