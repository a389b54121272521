"""Expert parallelism over part of the job: 4 gloo ranks with ``distributed.expert_parallel: 2``
(groups {0, 1} and {2, 3}; ranks 0 and 2, 1 and 3 hold the same experts and sum their gradients)
give the losses, gradient norms (clipping), eval losses and final weights of one process with the
same global batch (accumulation 4), fp32, 1e-5: LoRA on attention + experts, padded, and a full
fine-tune, packed (slow: LoRA through regional compile and full checkpointing). A checkpoint after
step 2 resumes to the same end on the same layout (4 ranks, scrambled weights), on 2 ranks with
``expert_parallel: 2`` and on one process; the final adapter / model is the one-process run's.
The layout of the groups is checked without processes."""

import os
import random

import pytest
import torch
from ep_groups import groups_ranks, replica_sums, resume_on_two_ranks
from ep_training import CPU, Case, joined_weights, make_config, reference_model, run, trainable
from fsdp_harness import spawn

from hone.parallel.groups import group_layout
from hone.track.metrics import read_metrics

SEED = int(os.environ.get("HONE_TEST_SEED", random.randrange(10_000)))  # fresh each session; fix it to reproduce
WORLD, N = 4, 2
LORA_CASE = Case("lora", False)
FULL_CASE = Case("full", True)
FSDP_CASE = Case("lora", True, fsdp=True)
FSDP_FULL_CASE = Case("full", False, fsdp=True)
COMPOSED_CASE = Case("lora", True, composed=True)  # regional compile (aot_eager) and full checkpointing


def test_groups_are_consecutive_ranks_and_replicas_hold_the_same_block():
    assert group_layout(4, 2) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    assert group_layout(8, 4) == ([[0, 1, 2, 3], [4, 5, 6, 7]], [[0, 4], [1, 5], [2, 6], [3, 7]])
    assert group_layout(6, 6) == ([[0, 1, 2, 3, 4, 5]], [[0], [1], [2], [3], [4], [5]])
    with pytest.raises(ValueError, match="expert parallel size 4 does not divide the 6 ranks"):
        group_layout(6, 4)


def test_replica_sums_in_buckets_are_the_sums_in_place(tmp_path):
    spawn(replica_sums, 2, tmp_path, timeout_s=120)
    ranks = [torch.load(tmp_path / f"sums-rank{r}.pt") for r in range(2)]
    for i, want in enumerate(a + b for a, b in zip(ranks[0]["before"], ranks[1]["before"], strict=True)):
        for saved in ranks:
            assert saved["after"][i].dtype == want.dtype and saved["after"][i].shape == want.shape
            torch.testing.assert_close(saved["after"][i], want, rtol=0, atol=0)


def _spawn(out, cases):
    for case in cases:
        (out / case.name).mkdir()
    try:
        spawn(groups_ranks, WORLD, out, SEED, cases, timeout_s=600)
    except Exception as exc:
        raise AssertionError(f"expert-parallel runs over 2 of 4 ranks (seed {SEED}) failed:\n{exc}") from exc
    return out


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory):
    return _spawn(tmp_path_factory.mktemp("ep-groups"), [LORA_CASE])


@pytest.fixture(scope="module")
def composed_runs(tmp_path_factory):
    return _spawn(tmp_path_factory.mktemp("ep-groups-composed"), [COMPOSED_CASE])


@pytest.fixture(scope="module")
def full_runs(tmp_path_factory):
    return _spawn(tmp_path_factory.mktemp("ep-groups-full"), [FULL_CASE])


def _reference(case: Case, out, resume_from=None) -> dict[str, torch.Tensor]:
    """One process, accumulation 4 (the same global batch); from a checkpoint where given, in a
    model whose trained weights were scrambled first. Its final output goes to ``out / "final"``."""
    from hone.models.save import save_final
    from hone.runtime.world import SINGLE
    from hone.transforms.base import RunFacts

    cfg = make_config(out, case, accumulation=WORLD, expert_parallel=1, save_steps=2)
    model = reference_model(case, SEED)
    if resume_from is not None:
        with torch.no_grad():
            for param in model.parameters():
                if param.requires_grad:
                    param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(7)))
    run(model, cfg, SINGLE, RunFacts(CPU, world=SINGLE), SEED, resume_from=resume_from)
    save_final(model, None, out / "final", cfg.adapter)
    return trainable(model)


def _losses(path):
    rows = read_metrics(path / "metrics.jsonl")
    train = [x for r in rows if "loss" in r for x in (r["loss"], r["grad_norm"])]
    return train, [r["eval_loss"] for r in rows if "eval_loss" in r]


def _joined(run_dir):
    """The 4 ranks' trained weights as one model's: the blocks of group {0, 1} joined; every
    replica (rank 2 of rank 0, 3 of 1) and every weight outside the experts the same on all ranks."""
    for rank in range(WORLD):
        assert torch.load(run_dir / f"weights-rank{rank}.pt")["layout"] == {
            "ep_rank": rank % N,
            "ep_size": N,
            "group": [rank - rank % N + i for i in range(N)],
            "replicas": list(range(rank % N, WORLD, N)),
            "gathers": rank < N,  # only the group of rank 0 (the writer) gathers checkpoints and final outputs
        }
    return joined_weights(run_dir, WORLD, N)


def _assert_close(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key, weight in want.items():
        torch.testing.assert_close(got[key], weight, rtol=1e-5, atol=1e-5, msg=lambda m, key=key: f"{key} (seed {SEED}): {m}")


def _assert_finals_equal(got_dir, want_dir) -> None:
    from safetensors.torch import load_file

    name = next(p.name for p in want_dir.iterdir() if p.suffix == ".safetensors")
    _assert_close(load_file(str(got_dir / name)), load_file(str(want_dir / name)))


def _assert_one_process_run(runs, case, tmp_path):
    whole = runs / case.name / "whole"
    want = _reference(case, tmp_path / "one")
    ref_train, ref_eval = _losses(tmp_path / "one")
    got_train, got_eval = _losses(whole)
    assert len(got_train) == len(ref_train) == 6 and len(got_eval) == len(ref_eval) == 2
    assert got_train == pytest.approx(ref_train, rel=1e-5), SEED  # the losses, and the clipping norms
    assert got_eval == pytest.approx(ref_eval, rel=1e-5), SEED
    joined, sharded = _joined(whole)
    assert sharded and all("experts" in n for n in sharded)
    _assert_close(joined, want)
    _assert_finals_equal(whole / "final", tmp_path / "one" / "final")  # every expert once, as one process writes
    return want


def _assert_resumes(runs, case, tmp_path):
    """The step-2 checkpoint of 4 ranks, N = 2: on the same layout, on one process, and on 2 ranks with N = 2."""
    whole, resumed = runs / case.name / "whole", runs / case.name / "resumed"
    _assert_close(_joined(resumed)[0], _joined(whole)[0])
    assert _losses(resumed)[0][-2:] == pytest.approx(_losses(whole)[0][-2:], rel=1e-5)
    _assert_finals_equal(resumed / "final", whole / "final")
    one = _reference(case, tmp_path / "one-resumed", resume_from=whole / "checkpoints" / "step-2")
    _assert_close(one, _joined(whole)[0])
    two = tmp_path / "two-resumed"  # 2 ranks, expert_parallel: 2 (no replicas), accumulation 2
    two.mkdir(parents=True)
    spawn(resume_on_two_ranks, 2, two, SEED, case, whole / "checkpoints" / "step-2", timeout_s=300)
    _assert_close(joined_weights(two, 2)[0], _joined(whole)[0])
    _assert_finals_equal(two / "final", whole / "final")


def test_lora_over_2_of_4_ranks_equals_one_process(lora_runs, tmp_path):
    _assert_one_process_run(lora_runs, LORA_CASE, tmp_path)


def test_lora_over_2_of_4_ranks_resumes_on_4_ranks_on_2_and_on_one_process(lora_runs, tmp_path):
    _assert_resumes(lora_runs, LORA_CASE, tmp_path)


def test_a_full_fine_tune_over_2_of_4_ranks_equals_one_process_and_resumes(full_runs, tmp_path):
    _assert_one_process_run(full_runs, FULL_CASE, tmp_path / "run")
    _assert_resumes(full_runs, FULL_CASE, tmp_path / "resume")


@pytest.mark.long  # 4 compiling ranks on 2 cores, ~100 s; compiled expert parallelism over 2 ranks runs in CI
def test_lora_over_2_of_4_ranks_composes_with_regional_compile_and_checkpointing(composed_runs, tmp_path):
    _assert_one_process_run(composed_runs, COMPOSED_CASE, tmp_path)


def test_hone_train_splits_the_experts_over_2_of_4_processes(tmp_path):
    """``hone train`` on 4 ranks with ``expert_parallel: 2``, as torchrun starts it: the loader
    splits the experts through the plan (with a capacity factor: the overflow check runs over all
    4 ranks), the plan records the replicas, and the final adapter holds every expert."""
    import json

    from dist_launch import hone_train_forked, tiny_moe_train_config
    from safetensors.torch import load_file

    path = tiny_moe_train_config(
        tmp_path,
        training={"max_steps": 2, "micro_batch_size": 1, "save_steps": 1},
        distributed={"expert_parallel": 2, "expert_capacity_factor": 1.5},
    )
    hone_train_forked(path, processes=WORLD)
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]
    applied = {a["name"]: a["details"] for a in json.loads((tmp_path / "run" / "optimizations.json").read_text())["applied"]}
    assert applied["expert_parallel"]["ranks"] == 2 and applied["expert_parallel"]["replicas"].startswith("2 ")
    assert "ddp" in applied
    adapter = load_file(str(tmp_path / "run" / "final" / "adapter_model.safetensors"))
    a = next(v for k, v in adapter.items() if "experts" in k and "lora_A" in k)
    assert a.shape[0] == 4 * 8  # r x all 8 experts, gathered


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory):
    return _spawn(tmp_path_factory.mktemp("ep-groups-fsdp"), [FSDP_CASE, FSDP_FULL_CASE])


@pytest.mark.parametrize("case", [FSDP_CASE, FSDP_FULL_CASE], ids=lambda c: c.name)
def test_beside_fsdp2_over_2_of_4_ranks_equals_one_process_and_resumes(fsdp_runs, case, tmp_path):
    """FSDP2 shards the rest over all 4 ranks; the DCP checkpoint holds every expert once (the
    blocks as a 2-D mesh: replicated over the replicas, sharded over the group), with the
    one-process shapes, and resumes on the same layout, on one process and on 2 ranks (N = 2 beside
    FSDP2, no replicas: a 1-D mesh of the blocks)."""
    from torch.distributed.checkpoint import FileSystemReader

    want = _assert_one_process_run(fsdp_runs, case, tmp_path / "run")
    whole = fsdp_runs / case.name / "whole"
    saved = FileSystemReader(str(whole / "checkpoints" / "step-2" / "dcp")).read_metadata().state_dict_metadata
    experts = {key.removeprefix("model."): meta.size for key, meta in saved.items() if key.removeprefix("model.") in want}
    assert any("experts" in name for name in experts)
    # lora_B is saved as its [out, r, E] view: the elements of the one-process tensor, once
    assert {name: size.numel() for name, size in experts.items()} == {name: want[name].numel() for name in experts}
    _assert_resumes(fsdp_runs, case, tmp_path / "resume")
