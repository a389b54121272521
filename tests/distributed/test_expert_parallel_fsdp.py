"""Expert parallelism beside FSDP2 (``distributed.strategy: fsdp``), 2 gloo ranks, a tiny
Qwen3-MoE in fp32: a run checkpointed after step 2 (DCP: FSDP2's shards, and each rank's expert
blocks as shards of the whole experts) and resumed in fresh, scrambled models on 2 ranks ends
with the uninterrupted run's loss and weights; the final adapter / save_pretrained directory
both write is the one-process run's (same global batch). The losses and weights of the
uninterrupted run against one process: tests/distributed/test_expert_parallel_training.py."""

import os
import random

import pytest
import torch
from ep_training import FSDP_CASES, resume_ranks, run_reference
from fsdp_harness import spawn
from safetensors.torch import load_file

from hone.track.metrics import read_metrics

SEED = int(os.environ.get("HONE_TEST_SEED", random.randrange(10_000)))  # fresh each session; fix it to reproduce


@pytest.fixture(scope="module")
def resumed_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("ep-fsdp-resume")
    for case in FSDP_CASES:
        (out / case.name).mkdir()
    try:
        spawn(resume_ranks, 2, out, SEED, FSDP_CASES, timeout_s=300)
    except Exception as exc:
        raise AssertionError(f"expert-parallel FSDP2 runs (seed {SEED}) failed:\n{exc}") from exc
    return out


def _train_rows(path):
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in read_metrics(path / "metrics.jsonl") if "loss" in r}


def _final_tensors(directory):
    name = "adapter_model.safetensors" if (directory / "adapter_model.safetensors").is_file() else "model.safetensors"
    return load_file(str(directory / name))


@pytest.mark.parametrize("case", FSDP_CASES, ids=lambda c: c.name)
def test_a_resumed_run_ends_as_the_uninterrupted_one(resumed_runs, case):
    whole, resumed = resumed_runs / case.name / "whole", resumed_runs / case.name / "resumed"
    assert (whole / "checkpoints" / "step-2" / "dcp").is_dir()  # DCP: the FSDP2 checkpoint path
    rows, again = _train_rows(whole), _train_rows(resumed)
    assert sorted(rows) == [1, 2, 3] and 3 in again, (rows, again)  # (the resumed run's log carries steps 1-2 over)
    assert again[3] == pytest.approx(rows[3], rel=1e-6), f"seed {SEED}"
    for rank in (0, 1):
        want = torch.load(whole / f"weights-rank{rank}.pt")
        got = torch.load(resumed / f"weights-rank{rank}.pt")
        assert got.keys() == want.keys()
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=1e-6, atol=1e-7, msg=lambda m, key=key: f"{key}: {m}")
    final, final_again = _final_tensors(whole / "final"), _final_tensors(resumed / "final")
    assert final.keys() == final_again.keys()
    for key in final:
        torch.testing.assert_close(final_again[key], final[key], rtol=1e-6, atol=1e-7, msg=key)


@pytest.mark.parametrize("case", FSDP_CASES, ids=lambda c: c.name)
def test_the_final_output_is_the_one_process_one(resumed_runs, tmp_path, case):
    run_reference(case, tmp_path / case.name, SEED, final=tmp_path / "final")
    want, got = _final_tensors(tmp_path / "final"), _final_tensors(resumed_runs / case.name / "whole" / "final")
    assert got.keys() == want.keys()
    assert any(".experts." in key for key in got)
    for key in want:
        # 1e-5: the runs sum gradients in another order (see test_expert_parallel_training.py)
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-5, msg=lambda m, key=key: f"{key} (seed {SEED}): {m}")
    if case.adapter == "full":  # a save_pretrained directory
        assert (resumed_runs / case.name / "whole" / "final" / "config.json").is_file()


def test_resuming_it_on_another_layout_is_refused_with_the_reason(resumed_runs, tmp_path):
    """One process groups the optimizer's weights otherwise (no DTensors to keep apart): a clear
    refusal, not a half-restored optimizer."""
    from ep_training import CPU, make_config, reference_model, run

    from hone.errors import HoneError
    from hone.runtime.world import SINGLE
    from hone.transforms.base import RunFacts

    case = next(c for c in FSDP_CASES if c.adapter == "full")
    cfg = make_config(tmp_path, case, accumulation=2, expert_parallel=1)
    checkpoint = resumed_runs / case.name / "whole" / "checkpoints" / "step-2"
    with pytest.raises(HoneError, match="its optimizer had 3 parameter groups and this run's has 2"):
        run(reference_model(case, SEED), cfg, SINGLE, RunFacts(CPU, world=SINGLE), SEED, resume_from=checkpoint)
