"""Expert parallelism beside FSDP2 (``distributed.strategy: fsdp``), 2 gloo ranks, a tiny
Qwen3-MoE in fp32: a run checkpointed after step 2 (DCP: FSDP2's shards, and each rank's expert
blocks as shards of the whole experts) and resumed in fresh, scrambled models on 2 ranks ends
with the uninterrupted run's loss and weights; the final adapter / save_pretrained directory
both write is the one-process run's (same global batch). The checkpoint resumes on other layouts
too (one process; FSDP2 alone), and a one-process checkpoint resumes under it. The losses and weights of the
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


def _assert_same_final(got_dir, want_dir, what):
    want, got = _final_tensors(want_dir), _final_tensors(got_dir)
    assert got.keys() == want.keys()
    for key in want:
        # 1e-5: the layouts sum gradients in another order
        torch.testing.assert_close(
            got[key], want[key], rtol=1e-5, atol=1e-5, msg=lambda m, key=key: f"{what} {key} (seed {SEED}): {m}"
        )


@pytest.mark.parametrize("case", FSDP_CASES, ids=lambda c: c.name)
def test_its_checkpoint_resumes_on_one_process(resumed_runs, tmp_path, case):
    """2 ranks (expert parallel + FSDP2, 3 optimizer groups) -> one process (2 groups, whole experts,
    an expert lora_B as [out, r * E]): the next loss and the final output are the uninterrupted run's."""
    from ep_training import CPU, make_config, reference_model, run, scramble

    from hone.models.save import save_final
    from hone.runtime.world import SINGLE
    from hone.transforms.base import RunFacts

    whole = resumed_runs / case.name / "whole"
    cfg = make_config(tmp_path, case, accumulation=2, expert_parallel=1)
    model = reference_model(case, SEED)
    scramble(model, 0)
    run(model, cfg, SINGLE, RunFacts(CPU, world=SINGLE), SEED, resume_from=whole / "checkpoints" / "step-2")
    save_final(model, None, tmp_path / "final", cfg.adapter)
    again = _train_rows(tmp_path)
    assert again[3][0] == pytest.approx(_train_rows(whole)[3][0], rel=1e-5, abs=1e-6), f"seed {SEED}"
    _assert_same_final(tmp_path / "final", whole / "final", "2 ranks -> 1")


def test_its_checkpoint_resumes_under_fsdp_alone(resumed_runs, tmp_path):
    """2 ranks (expert parallel + FSDP2) -> 2 ranks of FSDP2 alone (every weight a DTensor, the
    experts sharded by FSDP2 on their first dimension)."""
    from ep_training import resume_on_layout

    for case in FSDP_CASES:
        (tmp_path / case.name).mkdir()
    try:
        spawn(resume_on_layout, 2, tmp_path, SEED, FSDP_CASES, resumed_runs, 1, "whole", timeout_s=300)
    except Exception as exc:
        raise AssertionError(f"FSDP2 runs resumed from expert-parallel checkpoints (seed {SEED}) failed:\n{exc}") from exc
    for case in FSDP_CASES:
        whole = resumed_runs / case.name / "whole"
        assert _train_rows(tmp_path / case.name)[3][0] == pytest.approx(_train_rows(whole)[3][0], rel=1e-5, abs=1e-6)
        _assert_same_final(tmp_path / case.name / "final", whole / "final", f"{case.name} -> FSDP2 alone")


def test_its_checkpoint_resumes_under_expert_parallelism_beside_ddp(resumed_runs, tmp_path):
    """2 ranks (expert parallel + FSDP2) -> 2 ranks of expert parallelism beside DDP (every weight
    plain, two optimizer groups): each rank reads its blocks of the DCP checkpoint."""
    from ep_training import resume_on_layout

    for case in FSDP_CASES:
        (tmp_path / case.name).mkdir()
    try:
        spawn(resume_on_layout, 2, tmp_path, SEED, FSDP_CASES, resumed_runs, 2, "whole", True, timeout_s=300)
    except Exception as exc:
        raise AssertionError(f"DDP runs resumed from expert-parallel FSDP2 checkpoints (seed {SEED}) failed:\n{exc}") from exc
    for case in FSDP_CASES:
        whole = resumed_runs / case.name / "whole"
        assert _train_rows(tmp_path / case.name)[3][0] == pytest.approx(_train_rows(whole)[3][0], rel=1e-5, abs=1e-6)
        _assert_same_final(tmp_path / case.name / "final", whole / "final", f"{case.name} -> beside DDP")


def test_a_one_process_checkpoint_resumes_under_it(tmp_path):
    """One process (a checkpoint after step 2, the one-process format) -> 2 ranks of expert
    parallelism beside FSDP2: each rank keeps its block of the whole experts and their moments."""
    from ep_training import CPU, make_config, reference_model, resume_on_layout, run

    from hone.models.save import save_final
    from hone.runtime.world import SINGLE
    from hone.transforms.base import RunFacts

    source, out = tmp_path / "one", tmp_path / "two"
    for case in FSDP_CASES:
        cfg = make_config(source / case.name, case, accumulation=2, expert_parallel=1, save_steps=2)
        model = reference_model(case, SEED)
        run(model, cfg, SINGLE, RunFacts(CPU, world=SINGLE), SEED)
        save_final(model, None, source / case.name / "final", cfg.adapter)
        (out / case.name).mkdir(parents=True)
    try:
        spawn(resume_on_layout, 2, out, SEED, FSDP_CASES, source, 2, timeout_s=300)
    except Exception as exc:
        raise AssertionError(f"expert-parallel runs resumed from one-process checkpoints (seed {SEED}) failed:\n{exc}") from exc
    for case in FSDP_CASES:
        assert (out / case.name / "final").is_dir()
        got, want = _train_rows(out / case.name), _train_rows(source / case.name)
        assert got[3][0] == pytest.approx(want[3][0], rel=1e-5, abs=1e-6), f"{case.name} (seed {SEED})"
        _assert_same_final(out / case.name / "final", source / case.name / "final", f"1 -> {case.name}")


def test_a_checkpoint_of_fsdp_alone_resumes_under_it(tmp_path):
    """2 ranks of FSDP2 alone (an expert lora_B saved as [out, r * E], sharded on out) -> 2 ranks of
    expert parallelism beside FSDP2 (its block of [out, r, E] on E): each rank reads the whole
    factor and keeps its block."""
    from ep_training import resume_on_layout

    source, out = tmp_path / "alone", tmp_path / "ep"
    for case in FSDP_CASES:
        (source / case.name).mkdir(parents=True)
        (out / case.name).mkdir(parents=True)
    try:
        spawn(resume_on_layout, 2, source, SEED, FSDP_CASES, None, 1, timeout_s=300)
        spawn(resume_on_layout, 2, out, SEED, FSDP_CASES, source, 2, timeout_s=300)
    except Exception as exc:
        raise AssertionError(f"FSDP2 alone -> expert parallel runs (seed {SEED}) failed:\n{exc}") from exc
    for case in FSDP_CASES:
        got, want = _train_rows(out / case.name), _train_rows(source / case.name)
        assert got[3][0] == pytest.approx(want[3][0], rel=1e-5, abs=1e-6), f"{case.name} (seed {SEED})"
        _assert_same_final(out / case.name / "final", source / case.name / "final", f"FSDP2 alone -> {case.name}")
