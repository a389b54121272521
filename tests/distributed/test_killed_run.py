"""A 2-process FSDP2, DDP, expert-parallel or context-parallel run (gloo, CPU) killed with SIGKILL mid-run resumes from
its newest complete checkpoint to the uninterrupted run's losses. The NCCL version is in
tests/gpu/test_distributed_gpu.py."""

import json
import random

import pytest
import yaml
from dist_launch import child_env, hone_train_forked
from killed_run import kill_and_resume, train_losses

STEPS = 12  # the kill comes at step 4: 8 steps after it leave plenty of time to kill first


#: strategy -> what its run trains: a tiny llama, or under expert parallelism a tiny qwen3-moe with
#: expert LoRA (each rank holding half the experts, DDP for the rest; strategy auto resolves to it).
SETUPS = {
    "fsdp": ({"preset": "tiny-llama"}, {"lora_r": 4}, {"strategy": "fsdp"}),
    "ddp": ({"preset": "tiny-llama"}, {"lora_r": 4}, {"strategy": "ddp"}),
    # each sequence split over the 2 ranks (tiny qwen3: 4 query, 2 key/value heads); rows padded to even widths
    "context_parallel": ({"preset": "tiny-qwen3"}, {"lora_r": 4}, {"context_parallel": 2}),
    "expert_parallel": (
        {"preset": "tiny-qwen3-moe"},
        {"lora_r": 4, "lora_target_modules": ["q_proj", "v_proj", "experts"]},
        {"expert_parallel": 2},
    ),
}


def _config(tmp_path, name: str, strategy: str):
    model, adapter, distributed = SETUPS[strategy]
    data = tmp_path / "data.jsonl"
    if not data.exists():
        rng = random.Random(1)
        data.write_text(
            "".join(json.dumps({"input_ids": [rng.randint(5, 250) for _ in range(rng.randint(8, 40))]}) + "\n" for _ in range(48))
        )
    cfg = {
        "model": {**model, "dtype": "float32"},
        "data": {
            "datasets": [{"path": str(data), "type": "pretokenized"}],
            "sequence_len": 64,
            "dataset_prepared_path": str(tmp_path / "cache"),
        },
        "adapter": {"type": "lora", **adapter},
        "training": {"max_steps": STEPS, "save_steps": 4, "micro_batch_size": 2, "output_dir": str(tmp_path / name), "seed": 5},
        "optimizer": {"learning_rate": 5e-3},
        "distributed": distributed,
        "logging": {"progress_bar": False, "tensorboard": False, "plot": False},
    }
    path = tmp_path / f"{name}.yml"
    path.write_text(yaml.safe_dump(cfg))
    return path


#: make test-all runs these (~60 s each on 2 cores; CI keeps DDP and expert parallelism): a killed
#: context-parallel run resumes as the others do, and its checkpoint's resume is in
#: tests/distributed/test_context_parallel_training.py; FSDP2's sharded checkpoint after a SIGKILL is
#: in tests/distributed/test_fp8_fsdp_train.py (ranks killed directly, not through torchrun)
LONG_CASES = ("context_parallel", "fsdp")


@pytest.mark.parametrize("strategy", [pytest.param(s, marks=pytest.mark.long) if s in LONG_CASES else s for s in sorted(SETUPS)])
def test_a_killed_two_process_run_resumes_to_the_uninterrupted_losses(tmp_path, strategy):
    # the uninterrupted reference in forked ranks: the killed and the resumed runs are the launches under test
    done = kill_and_resume(
        _config(tmp_path, "straight", strategy),
        _config(tmp_path, "killed", strategy),
        child_env(),
        kill_after=4,
        timeout_s=300,
        straight=hone_train_forked,
    )
    want, got = train_losses(tmp_path / "straight"), train_losses(tmp_path / "killed")
    after = list(range(done + 1, STEPS + 1))
    assert after, "the kill came after the last step"
    assert [got[s] for s in after] == pytest.approx([want[s] for s in after], rel=1e-5)
