"""A float8 full fine-tune under FSDP2 on 2 GPUs (NCCL, torchao's float8 kernels, weights
all-gathered in float8): a launch SIGKILLed after a checkpoint resumes to the uninterrupted run's
losses, and its checkpoints hold no float8 tensor. The CPU version (gloo, emulated float8) is
tests/distributed/test_fp8_fsdp_train.py; this one runs the real ``_scaled_mm`` and NCCL's float8
all-gather, compiled (``torch_compile: auto`` compiles on CUDA).

Eager attention: its backward is plain matmuls, where sdpa's flash or memory-efficient kernels
accumulate with atomics, so the two runs' steps are bitwise repeatable and the tolerance can stay
at float32 rounding (a float8 scale taken from the wrong weights moved a resumed loss by 4e-5 on
the CPU).

Run on a machine with at least 2 GPUs of compute capability >= 8.9 (H100):
    python -m pytest -q -m gpu tests/gpu/test_fp8_fsdp_gpu.py
"""

import json
import os
import random
import sys
from pathlib import Path

import pytest
import torch
import yaml

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
    pytest.mark.skipif(
        torch.cuda.is_available() and torch.cuda.get_device_capability(0) < (8, 9),
        reason="float8 matmuls need compute capability >= 8.9",
    ),
]

REPO = Path(__file__).resolve().parent.parent.parent
TIMEOUT_S = 600
STEPS = 40


def _config(tmp_path: Path, name: str) -> Path:
    data = tmp_path / "data.jsonl"
    if not data.exists():
        rng = random.Random(0)
        rows = [{"input_ids": [rng.randint(5, 250) for _ in range(rng.randint(64, 256))]} for _ in range(256)]
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = {
        "model": {
            "preset": "tiny-llama",
            # every linear a multiple of 16 and wide enough for the float8 kernels to matter
            "preset_overrides": {
                "hidden_size": 512,
                "intermediate_size": 1536,
                "num_hidden_layers": 4,
                "num_attention_heads": 8,
                "num_key_value_heads": 4,
                "head_dim": 64,
            },
            "dtype": "bfloat16",
            "attn_implementation": "eager",
        },
        "data": {
            "datasets": [{"path": str(data), "type": "pretokenized"}],
            "sequence_len": 256,
            "sample_packing": True,
            "dataset_prepared_path": str(tmp_path / "cache"),
        },
        "adapter": {"type": "none"},
        "performance": {"fp8": "tensorwise"},
        "training": {"max_steps": STEPS, "save_steps": 4, "micro_batch_size": 2, "output_dir": str(tmp_path / name), "seed": 3},
        "optimizer": {"learning_rate": 1e-3},
        "distributed": {"strategy": "fsdp"},
        "logging": {"progress_bar": False, "tensorboard": False, "plot": False},
    }
    path = tmp_path / f"{name}.yml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_a_killed_float8_fsdp2_run_on_two_gpus_resumes_to_the_uninterrupted_losses(tmp_path):
    sys.path.insert(0, str(REPO / "tests" / "distributed"))
    from killed_run import kill_and_resume, train_losses

    env = {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": "0,1",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    done = kill_and_resume(_config(tmp_path, "straight"), _config(tmp_path, "killed"), env, kill_after=8, timeout_s=TIMEOUT_S)
    applied = json.loads((tmp_path / "killed" / "optimizations.json").read_text())["applied"]
    fp8 = next(t for t in applied if t["name"] == "fp8")["details"]
    assert fp8["fsdp_float8_all_gather"] and not fp8["emulated"]
    want, got = train_losses(tmp_path / "straight"), train_losses(tmp_path / "killed")
    after = list(range(done + 1, STEPS + 1))
    assert after and [got[s] for s in after] == pytest.approx([want[s] for s in after], rel=1e-5)
    from safetensors.torch import load_file

    final, straight = (
        load_file(tmp_path / "killed" / "final" / "model.safetensors"),
        load_file(tmp_path / "straight" / "final" / "model.safetensors"),
    )
    assert {str(t.dtype) for t in final.values()} == {"torch.bfloat16"}
    for name, weight in straight.items():
        torch.testing.assert_close(final[name], weight, rtol=2**-7, atol=1e-6, msg=name)
